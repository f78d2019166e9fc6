#!/usr/bin/env bash
# The README's main command: set up (cached, idempotent), then serve the default model with
# a quantized KV cache behind vLLM's OpenAI-compatible API. Arguments go to `vllm-kvq serve`,
# whose defaults hold flag by flag (--kv-method kivi2, 16 concurrent sequences, a KV budget
# that fits the free memory, port 8000; see vllm_kvq/serve_defaults.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/env.sh
exec vllm-kvq serve "$@"
