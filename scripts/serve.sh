#!/usr/bin/env bash
# The README's main command: set up (cached, idempotent), then serve the default model with
# a quantized KV cache behind vLLM's OpenAI-compatible API. Arguments go to `vllm-kvq serve`
# (default: --kv-method kivi2, 16 concurrent sequences, 1 GiB of KV cache, port 8000).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/env.sh
if [[ $# -eq 0 ]]; then
  set -- --kv-method kivi2 --max-num-seqs 16 --kv-cache-memory-bytes 1073741824
fi
exec vllm-kvq serve "$@"
