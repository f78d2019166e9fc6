"""`vllm-kvq compare` flags and entry points; `python -m vllm_kvq.tools.compare` also runs the
children (`worker SPEC OUT`, `kernel SPEC OUT`) and `report DIR [--note TEXT]` (rewrites a
folder's report from its results.json and raw runs, no engines)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_kvq.tools.compare.plan import (ALL_METHODS, BASELINE, FAULT_SUFFIX, QUICK_METHODS, Plan,
                                         preset)
from vllm_kvq.tools.compare.report import rebuild, write_outputs
from vllm_kvq.tools.compare.run import run_compare
from vllm_kvq.tools.evaluate import VLLM_PEERS


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="local HF model folder (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods: kvq formats and vLLM peers vllm, vllm-fp8 "
                   f"(default: full {','.join(ALL_METHODS)}; --quick {','.join(QUICK_METHODS)})"
                   "; bf16 is always added as the baseline")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes on 2 cores: 4 methods, 2x1024 quality tokens, contexts "
                   "512/2k, batch 1/4, passkey at 2k")
    p.add_argument("--out", default="compare-results", help="output folder")
    p.add_argument("--dtype", default=None, help="model dtype (default float32: fast on CPUs "
                   "without AVX512-BF16; the cache format does not depend on it)")
    p.add_argument("--kv-budget", type=int, default=None, help="KV cache bytes per engine")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--quality-windows", type=int, default=None)
    p.add_argument("--quality-window", type=int, default=None, help="tokens per window")
    p.add_argument("--greedy-tokens", type=int, default=None,
                   help="greedy tokens generated after held-out text, compared with bf16 "
                   "(0: none, teacher-forced quality only)")
    p.add_argument("--contexts", default=None, help="e.g. 512,2048,8000 ('' skips speed)")
    p.add_argument("--batches", default=None, help="e.g. 1,4,16")
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--speed-repeats", type=int, default=None, help="best of N (default 3)")
    p.add_argument("--speed-timing", choices=["engine", "wall"], default=None,
                   help="engine (default): vLLM's per-request timestamps, plus CPU time per "
                   "step; wall: difference of two wall-clock generate() calls")
    p.add_argument("--passkey-lengths", default=None,
                   help="e.g. 2048,4096,8000 ('' skips); LENxN sets N positions for LEN")
    p.add_argument("--passkey-positions", type=int, default=None)
    p.add_argument("--passkey-filler", choices=["repeat", "text"], default=None)
    p.add_argument("--kernel-contexts", default=None)
    p.add_argument("--kernel-batches", default=None)
    p.add_argument("--kernel-threads", type=int, default=None,
                   help="threads for the kernel-alone benchmark (default 1, as vLLM's worker "
                   "uses on a 2-core machine)")
    p.add_argument("--no-kernel", action="store_true", help="skip the kernel-alone benchmark")
    p.add_argument("--cpu-bind", default=None, metavar="CORES",
                   help="VLLM_CPU_OMP_THREADS_BIND for the engines, e.g. 1 or 0-1 (default: "
                   "vLLM's auto, which on 2 cores binds every engine's worker to core 0)")
    p.add_argument("--inject-fault", default=None, metavar="METHOD",
                   help="test-only: also run METHOD with every stored byte clobbered "
                   "(VLLM_KVQ_FAULT=clobber_cache), to show the comparison catches it")
    p.add_argument("--timeout", type=int, default=None, help="seconds per engine")


def plan_from_args(args) -> Plan:
    model = args.model
    if model is None:
        from vllm_kvq.model_prep import ensure_default_model
        model = str(ensure_default_model())
    elif not (Path(model) / "config.json").exists():
        raise SystemExit(f"vllm-kvq compare: {model} is not a local HF model folder "
                         f"(no config.json)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    plan = preset(args.quick, methods, str(Path(model).resolve()))
    if methods is not None and "all" in methods:
        plan.methods = list(ALL_METHODS)
    for m in plan.methods:  # fail now, not after the first engines ran
        if m not in VLLM_PEERS:
            from vllm_kvq.config import config_from_dict
            config_from_dict({"method": m})
    if args.inject_fault:
        plan.methods.append(args.inject_fault + FAULT_SUFFIX)
    simple = {"dtype": "dtype", "kv_budget": "kv_budget", "max_num_seqs": "max_num_seqs",
              "quality_windows": "quality_windows", "quality_window": "quality_window",
              "decode_tokens": "decode_tokens", "passkey_positions": "passkey_positions",
              "passkey_filler": "passkey_filler", "timeout": "timeout_s",
              "kernel_threads": "kernel_threads", "greedy_tokens": "greedy_tokens",
              "cpu_bind": "cpu_bind", "speed_repeats": "speed_repeats",
              "speed_timing": "speed_timing"}
    for a, f in simple.items():
        if getattr(args, a) is not None:
            setattr(plan, f, getattr(args, a))
    if args.passkey_lengths is not None:
        pairs = [x.split("x") for x in args.passkey_lengths.split(",") if x.strip()]
        plan.passkey_lengths = [int(x[0]) for x in pairs]
        plan.passkey_counts = {x[0]: int(x[1]) for x in pairs if len(x) > 1}
        args.passkey_lengths = None
    for a in ("contexts", "batches", "passkey_lengths", "kernel_contexts", "kernel_batches"):
        if getattr(args, a) is not None:
            setattr(plan, a, _ints(getattr(args, a)))
    if args.no_kernel:
        plan.kernel = False
    if plan.batches and max(plan.batches) > plan.max_num_seqs:
        plan.max_num_seqs = max(plan.batches)
    return plan


def cmd_compare(args, argv: list[str] | None = None) -> int:
    plan = plan_from_args(args)
    out = Path(args.out)
    command = " ".join(["vllm-kvq", "compare", *(argv or [])])
    result = run_compare(plan, out)
    files = write_outputs(result, out, command)
    print((out / "report.md").read_text())
    print(f"\nwrote {files['report']}, {files['json']}, "
          + ", ".join(str(p) for p in files["plots"])
          + f" in {result['total_s'] / 60:.1f} min")
    ok = {r["method"] for r in result["rows"] if not r.get("unavailable")}
    return 0 if BASELINE in ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report" and len(argv) >= 2:
        # rewrite report.md and the plots from a folder's results.json, re-scored from the
        # raw runs/ when they are there (no engines); `--note TEXT` adds a note to it
        out = Path(argv[1])
        result = rebuild(out)
        notes = [argv[i + 1] for i in range(2, len(argv) - 1) if argv[i] == "--note"]
        if notes:
            result["notes"] = notes
        write_outputs(result, out, result.get("command", ""))
        print(out / "report.md")
        return 0
    if argv and argv[0] in ("worker", "kernel") and len(argv) == 3:
        spec = json.loads(Path(argv[1]).read_text())
        if argv[0] == "worker":
            from vllm_kvq.tools.compare.worker import run_worker as run
        else:
            from vllm_kvq.tools.compare.bench import run_kernel_bench as run
        res = run(spec)
        Path(argv[2]).write_text(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(prog="vllm-kvq compare")
    add_arguments(p)
    return cmd_compare(p.parse_args(argv), argv)
