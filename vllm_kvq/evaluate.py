"""Temporary alias: moved to vllm_kvq.tools.evaluate (remove once its importers switch)."""
import sys
from vllm_kvq.tools import evaluate as _moved
sys.modules[__name__] = _moved
