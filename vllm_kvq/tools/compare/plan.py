"""What one comparison measures: the methods and the Plan (sizes of every measurement),
with the two documented presets (full and --quick)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvq.tools.compare.inputs import GREEDY_TEXT_PROMPT, PASSKEY_NEW_TOKENS


BASELINE = "bf16"
FAULT_SUFFIX = "+clobber_cache"  # test-only: VLLM_KVQ_FAULT=clobber_cache for this method
ALL_METHODS = ["bf16", "fp8_e4m3", "fp8_e4m3_token", "int8_token", "int8_group32",
               "int4_token", "int4_group32", "int4_group32_r128", "int3_group32",
               "int2_token", "int2_group32", "int2_group32_r128", "kivi4", "kivi2",
               "vllm", "vllm-fp8"]
QUICK_METHODS = ["bf16", "int4_group32", "kivi2", "vllm-fp8"]
KERNEL_SHAPE = (9, 3, 64)  # SmolLM2-135M: query heads, kv heads, head_dim


@dataclass
class Plan:
    """What one comparison measures; `preset(quick)` gives the two documented modes."""

    methods: list[str]
    model: str
    dtype: str = "float32"
    kv_budget: int = 1 << 30
    max_num_seqs: int = 16
    quality_windows: int = 4
    quality_window: int = 2048
    greedy_tokens: int = 64
    contexts: list[int] = field(default_factory=lambda: [512, 2048, 8000])
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    decode_tokens: int = 32
    speed_repeats: int = 3
    speed_timing: str = "engine"  # "engine": vLLM's request timestamps + CPU time; "wall"
    passkey_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8000])
    passkey_positions: int = 4
    passkey_counts: dict = field(default_factory=dict)  # {length: positions} overrides
    passkey_filler: str = "repeat"   # "repeat" (classic filler) or "text" (held-out speeches)
    kernel: bool = True
    kernel_contexts: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    kernel_batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    skip_unsupported: bool = False  # --quick: don't start vllm-fp8 where it cannot run
    kernel_threads: int = 1  # as vLLM's CPU worker here: it binds 1 OpenMP thread on 2 cores
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for the engines (None: vLLM's auto)
    seed: int = 0
    timeout_s: int = 3600

    @property
    def max_model_len(self) -> int:
        longest = max([self.quality_window + 1] + list(self.contexts)
                      + list(self.passkey_lengths) + [GREEDY_TEXT_PROMPT])
        return longest + max(self.decode_tokens, self.greedy_tokens, PASSKEY_NEW_TOKENS) + 8


def preset(quick: bool, methods: list[str] | None, model: str) -> Plan:
    if not quick:
        return Plan(methods=list(methods or ALL_METHODS), model=model)
    return Plan(methods=list(methods or QUICK_METHODS), model=model, quality_windows=2,
                quality_window=1024, greedy_tokens=32, contexts=[512, 2048], batches=[1, 4],
                decode_tokens=16, speed_repeats=2, passkey_lengths=[2048],
                passkey_positions=3, kernel_contexts=[512, 2048], kernel_batches=[1, 4],
                timeout_s=900, skip_unsupported=True)


def base_method(method: str) -> str:
    return method.removesuffix(FAULT_SUFFIX)
