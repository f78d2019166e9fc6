"""End-to-end decode and prefill speed through real vLLM: each method vs vLLM's own backend.

Every method runs in its own engine process (the same model, prompts and budget): the
prompts (--prompt-len + 1 tokens: see _prompts) are prefilled (timed: prefill, best of --repeats cold prefills: the prefix cache is
reset between them), then served again from the prefix cache with N new tokens (timed:
decode, minus the time of the same cached request with 1 token), best of --repeats. Wall
time and the process's CPU time are both reported. Ratios are to vLLM's own CPU backend
("vllm") from the same run: the mean of its rows when it runs more than once.

  python benchmarks/bench_e2e_decode.py [--methods vllm,bf16,int4_group32,kivi2]
      [--seqs 4] [--prompt-len 4096] [--new-tokens 32] [--dtype bfloat16] [--rounds 2]
      [--profile kivi2]

--rounds N runs the whole method list N times, interleaved (a VM's speed drifts over
minutes: a row measured once, minutes away from vLLM's, can move 15%); each row is printed
with its round, then every method's mean ratio over the rounds.

--profile METHOD additionally runs that method in-process under torch.profiler for the
decode part and prints the top operators by self CPU time (the step breakdown).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time

DEFAULT_METHODS = "vllm,bf16,int8_token,int4_group32,kivi2,nuq3"


def _prompts(model: str, seqs: int, prompt_len: int) -> list[list[int]]:
    """prompt_len + 1 tokens each: served again from the prefix cache, a prompt then has all
    its full blocks cached and one token recomputed. With a prompt of whole blocks vLLM
    recomputes its last block (it always computes at least one token, in whole cached
    blocks), a 128-token prefill per sequence inside both timed runs of the decode
    difference: 16 x 2048 tokens, ~4.7 s of each run on 2 cores, whose noise the decode
    time inherited."""
    from vllm_kvq.tools.evaluate import default_windows
    return default_windows(model, seqs, prompt_len + 1)


def _engine(method: str, model: str, args):
    from vllm import LLM

    from vllm_kvq.tools.evaluate import engine_kwargs

    max_len = args.prompt_len + 1 + args.new_tokens + 16
    budget = int(args.budget_mib) << 20
    return LLM(**engine_kwargs(method, model, budget, max_len, dtype=args.dtype,
                               enable_prefix_caching=True, max_num_seqs=args.seqs,
                               max_num_batched_tokens=max(2048, args.prompt_len + 1)))


def _measure(llm, prompts, args) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(n):
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return dt, dc

    # Wall and CPU time (all threads of this process: the engine runs in it). On a shared VM
    # the CPU time leaves out what neighbours took (steal), so its ratios are the steadier.
    prefills = [run(1)]  # cold: the whole prompts
    one, full = [], []
    for _ in range(args.repeats):
        one.append(run(1))          # prefix-cached: ~one token recomputed per prompt
        full.append(run(1 + args.new_tokens))
    for _ in range(args.repeats - 1):  # one cold prefill is one sample: best of repeats
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache for a cold prefill")
        prefills.append(run(1))

    def best(xs, i):
        return min(x[i] for x in xs)

    decode_s = max(best(full, 0) - best(one, 0), 1e-9)
    decode_cpu = max(best(full, 1) - best(one, 1), 1e-9)
    prefill = best(prefills, 0)
    return {"prefill_s": prefill, "prefill_tok_s": len(prompts) * args.prompt_len / prefill,
            "prefill_cpu_s": best(prefills, 1),
            "decode_tok_s": len(prompts) * args.new_tokens / decode_s,
            "decode_cpu_s": decode_cpu,
            "decode_ms_per_step": decode_s / args.new_tokens * 1e3}


def _child(method: str, model: str, args, q) -> None:
    # The engine runs in this (spawned) process: with vLLM's engine-core child under a
    # spawned parent, the engine core died silently after startup here and the run hung.
    # Every row (vLLM's own backend too) runs the same way, on all the cores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = _engine(method, model, args)
        q.put({"method": method, **_measure(llm, _prompts(model, args.seqs, args.prompt_len),
                                             args)})
    except BaseException as e:  # noqa: BLE001 -- reported in the table
        q.put({"method": method, "error": f"{type(e).__name__}: {e}"[:300]})


def _profile(method: str, model: str, args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runs in this process
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(method, model, args)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in _prompts(model, args.seqs,
                                                                args.prompt_len)]
    for phase, n in (("prefill", 1), ("warm", 1), ("decode", 1 + args.new_tokens)):
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        if phase == "warm":  # prefix-cached from here on
            llm.generate(reqs, sp, use_tqdm=False)
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            llm.generate(reqs, sp, use_tqdm=False)
        what = (f"{args.new_tokens} decode steps" if phase == "decode"
                else "prefill of the whole prompts")
        print(f"\n## {phase} profile: {method}, {args.seqs} x {args.prompt_len} tokens, "
              f"{what} (self CPU time)\n")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the method list this many times, interleaved")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-mib", type=int, default=2048)
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default=None, metavar="METHOD")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    import vllm_kvq  # the engines' children import this same package: its path is printed
    from vllm_kvq.model_prep import ensure_default_model
    from vllm_kvq.ops import simd_path

    model = args.model or str(ensure_default_model(verbose=False))
    if args.profile:
        _profile(args.profile, model, args)
        return 0
    ctx = mp.get_context("spawn")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} is not allowed; allowed: 1 or more")
    methods = args.methods.split(",")
    rows = []
    for rnd in range(1, args.rounds + 1):
        for m in methods:
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(m, model, args, q))
            p.start()
            rows.append({**q.get(), "round": rnd})
            p.join()
    theirs = [r for r in rows if r["method"] == "vllm" and "error" not in r]
    keys = ("prefill_s", "prefill_cpu_s", "decode_tok_s", "decode_cpu_s")
    base = {k: sum(r[k] for r in theirs) / len(theirs) for k in keys} if theirs else None
    print(f"\n# end to end, {args.seqs} x {args.prompt_len}-token prompts, {args.new_tokens} "
          f"new tokens, model dtype {args.dtype}; machine: {platform.machine()}, "
          f"{os.cpu_count()} cores, kvq SIMD path {simd_path()}; vllm_kvq from "
          f"{os.path.dirname(vllm_kvq.__file__)}; ratios to the mean of {len(theirs)} vLLM "
          f"row(s)\n")
    print("| method | prefill s | prefill × vllm | prefill CPU × vllm | decode tok/s | "
          "decode × vllm | decode CPU × vllm | ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(r, key):  # > 1: faster than vLLM's own backend
        return base[key] / r[key] if base else float("nan")

    def decode_ratio(r):
        return r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")

    for r in rows:
        name = r["method"] if args.rounds == 1 else f"{r['method']} ({r['round']})"
        if "error" in r:
            print(f"| {name} | error: {r['error']} |||||||")
            continue
        print(f"| {name} | {r['prefill_s']:.1f} | {ratio(r, 'prefill_s'):.2f} | "
              f"{ratio(r, 'prefill_cpu_s'):.2f} | {r['decode_tok_s']:.1f} | "
              f"{decode_ratio(r):.2f} | {ratio(r, 'decode_cpu_s'):.2f} | "
              f"{r['decode_ms_per_step']:.0f} |")
    if args.rounds > 1:
        print("\n| method | prefill × vllm, mean of rounds | decode × vllm, mean of rounds |")
        print("|---|---:|---:|")
        for m in dict.fromkeys(methods):
            ok = [r for r in rows if r["method"] == m and "error" not in r]
            if ok:
                pre = sum(ratio(r, "prefill_s") for r in ok) / len(ok)
                dec = sum(decode_ratio(r) for r in ok) / len(ok)
                print(f"| {m} | {pre:.2f} | {dec:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "simd": simd_path(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
