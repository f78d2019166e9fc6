"""`vllm-kvq compare`: every KV-cache method through the real vLLM engine, side by side.

For each method one engine runs in its own process (`python -m vllm_kvq.tools.compare
worker SPEC OUT`, like `python -m vllm_kvq.tools.evaluate`), and measures, on identical
inputs made once by the parent:

- memory: bytes per token (page layout from csrc/kvq_layout.h: codes, scales, zero-points,
  padding), the full-precision residual window per sequence, and the KV capacity in tokens
  that vLLM's own block manager reports at a fixed KV budget (evaluate.capacity);
- quality, teacher-forced (evaluate.prompt_logprobs / compare_runs): perplexity, mean KL over
  the top-20 and top-1 agreement against our bf16 cache on held-out real text; greedy
  decoding agreement; a passkey hidden at seeded depths of 2k-8k token prompts;
- speed: prefill tokens/s and decode tokens/s / time per output token at several context
  lengths and batch sizes (one shared prompt prefix from the prefix cache, so the long
  prefill is paid once per context), each also as a ratio to our bf16 in the same run;
- the attention kernel alone (vllm_kvq.tools.kernel_timing) against vLLM's own CPU
  attention op, in one more process.

vLLM's own CPU paths run as peers: "vllm" (its cache in the model's dtype) and "vllm-fp8";
a peer that cannot start here (vLLM's fp8 CPU cache needs AVX-512) is reported as
unavailable with vLLM's reason. Output: report.md, results.json, PNG plots, logs/ and
runs/ (each engine's raw measurements) in --out.

Modules, in the order of a run: plan (methods, sizes, presets), inputs (held-out windows,
greedy and passkey prompts), run (the parent) and children (child processes, their
progress and errors), worker (one engine) and bench (the kernel alone), then scoring,
memory, report (assembly, files), markdown, plots, machine; cli (flags, entry points).
"""
