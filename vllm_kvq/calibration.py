"""Temporary alias: the calibration file format moved to vllm_kvq.codebook_file, the
`vllm-kvq calibrate` tool to vllm_kvq.tools.calibrate (remove once its importers switch)."""
import sys
from vllm_kvq import codebook_file as _moved
sys.modules[__name__] = _moved
