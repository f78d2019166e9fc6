"""Temporary alias: moved to vllm_kvq.tools.corpus (remove once its importers switch)."""
import sys
from vllm_kvq.tools import corpus as _moved
sys.modules[__name__] = _moved
