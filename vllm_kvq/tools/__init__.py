"""Tools apart from the serving path: `vllm-kvq compare` (tools/compare), `vllm-kvq
calibrate` (tools/calibrate), one method through the engine (tools/evaluate.py), the text
they measure on (tools/corpus.py) and the attention-kernel timing (tools/kernel_timing.py).

Tools may import the serving path (formats, config, codebook_file, ops, ...); the serving
path never imports a tool (tests/test_import_contract.py checks it)."""
