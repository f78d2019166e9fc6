"""`vllm-kvq serve`'s defaults, flag by flag: each holds unless the user passes that flag.

vLLM's own CPU defaults suit a dedicated server, not a first try on a shared machine: with
no KV budget its worker reserves --gpu-memory-utilization (0.92) of the NUMA node for the
cache and refuses to start unless that much is free, and it schedules 256 sequences. Here:
16 sequences, and when no budget is given (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE
or --gpu-memory-utilization), half of what is free after the weights and a margin, at
most MAX_BUDGET, said in one log line. With --tensor-parallel-size / --pipeline-parallel-size
on the CPU, the workers' thread binding (VLLM_CPU_OMP_THREADS_BIND) is set unless given.
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_MAX_NUM_SEQS = 16
MARGIN = 2 << 30          # left free for the server process, activations, the tokenizer
MIN_BUDGET = 256 << 20
MAX_BUDGET = 2 << 30   # a first try, not a dedicated server: pass the flag for more
BUDGET_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def weights_bytes(model: str) -> int:
    """Bytes of the model's weight files (a local folder), x2 in case they are loaded in
    float32; 1 GiB when the model is not a local folder."""
    files = [p for p in Path(model).glob("*") if p.suffix in (".safetensors", ".bin")]
    return 2 * sum(p.stat().st_size for p in files) if files else 1 << 30


def fitting_budget(available: int, weights: int) -> int:
    """Half of what is free after the weights and the margin, in [MIN, MAX], 64 MiB steps."""
    room = available - weights - MARGIN
    if room < 2 * MIN_BUDGET:
        raise ValueError(
            f"vllm-kvq serve: only {available / 2**30:.1f} GiB of memory is available; the "
            f"model needs ~{weights / 2**30:.1f} GiB plus a {MARGIN >> 30} GiB margin, which "
            f"leaves less than {2 * MIN_BUDGET >> 20} MiB for the KV cache. Free memory or "
            f"pass --kv-cache-memory-bytes N")
    return max(MIN_BUDGET, min(MAX_BUDGET, room // 2)) >> 26 << 26


def flag_value(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def thread_binding(world: int, cpus: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `world` local workers: the allowed cores split into
    that many contiguous lists ("0|1" on 2 cores). vLLM's "auto" wants one NUMA node per
    worker and refuses to start on a one-node machine."""
    if world > len(cpus):
        raise ValueError(f"vllm-kvq serve: {world} parallel workers need at least {world} "
                         f"cores; this process may use {len(cpus)}")
    per = len(cpus) // world
    lists = [cpus[i * per:(i + 1) * per] for i in range(world)]
    return "|".join(",".join(map(str, c)) for c in lists)


def parallel_env(args: list[str], env: dict, cpus: list[int]) -> dict:
    """The thread binding for TP x PP workers on the CPU, unless the user set one."""
    tp = int(flag_value(args, "--tensor-parallel-size", "-tp") or 1)
    pp = int(flag_value(args, "--pipeline-parallel-size", "-pp") or 1)
    if tp * pp == 1 or env.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(tp * pp, cpus)}


def with_defaults(model: str, args: list[str], env: dict,
                  available: int | None = None) -> tuple[list[str], list[str]]:
    """(the missing defaults, then the user's vLLM flags; log lines saying what was chosen)."""
    defaults, notes = [], []
    if not has_flag(args, "--max-num-seqs"):
        defaults += ["--max-num-seqs", str(DEFAULT_MAX_NUM_SEQS)]
    if not any(has_flag(args, f) for f in BUDGET_FLAGS) and not env.get(
            "VLLM_CPU_KVCACHE_SPACE"):
        if available is None:
            import psutil
            available = psutil.virtual_memory().available
        w = weights_bytes(model)
        budget = fitting_budget(available, w)
        defaults += ["--kv-cache-memory-bytes", str(budget)]
        notes.append(f"vllm-kvq serve: no KV budget given; using {budget / 2**30:.2f} GiB "
                     f"(half of the {available / 2**30:.1f} GiB available after ~"
                     f"{w / 2**30:.1f} GiB of weights and a {MARGIN >> 30} GiB margin, at "
                     f"most {MAX_BUDGET >> 30} GiB); pass --kv-cache-memory-bytes to choose")
    return defaults + list(args), notes
