"""`vllm-kvq compare`: every KV-cache method through the real vLLM engine, side by side.

For each method one engine runs in its own process (`python -m vllm_kvq.compare worker
SPEC OUT`, like `python -m vllm_kvq.evaluate`), and measures, on identical inputs made once
by the parent:

- memory: bytes per token (page layout from csrc/kvq_layout.h: codes, scales, zero-points,
  padding), the full-precision residual window per sequence, and the KV capacity in tokens
  that vLLM's own block manager reports at a fixed KV budget (evaluate.capacity);
- quality, teacher-forced (evaluate.prompt_logprobs / compare_runs): perplexity, mean KL over
  the top-20 and top-1 agreement against our bf16 cache on held-out real text; greedy
  decoding agreement; a passkey hidden at seeded depths of 2k-8k token prompts;
- speed: prefill tokens/s and decode tokens/s / time per output token at several context
  lengths and batch sizes (one shared prompt prefix from the prefix cache, so the long
  prefill is paid once per context), each also as a ratio to our bf16 in the same run;
- the attention kernel alone (benchmarks/bench_cpu_attention.py's bench_ours / bench_vllm)
  against vLLM's own CPU attention op, in one more process.

vLLM's own CPU paths run as peers: "vllm" (its cache in the model's dtype) and "vllm-fp8";
a peer that cannot start here (vLLM's fp8 CPU cache needs AVX-512) is reported as
unavailable with vLLM's reason. Output: report.md, results.json, PNG plots, logs/ and
runs/ (each engine's raw measurements) in --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvq.evaluate import (GREEDY_PROMPTS, VLLM_PEERS, capacity, compare_runs,
                               engine_kwargs, greedy, prompt_logprobs)

BASELINE = "bf16"
FAULT_SUFFIX = "+clobber_cache"  # test-only: VLLM_KVQ_FAULT=clobber_cache for this method
ALL_METHODS = ["bf16", "fp8_e4m3", "fp8_e4m3_token", "int8_token", "int8_group32",
               "int4_token", "int4_group32", "int4_group32_r128", "int3_group32",
               "int2_token", "int2_group32", "int2_group32_r128", "kivi4", "kivi2",
               "vllm", "vllm-fp8"]
QUICK_METHODS = ["bf16", "int4_group32", "kivi2", "vllm-fp8"]
KERNEL_SHAPE = (9, 3, 64)  # SmolLM2-135M: query heads, kv heads, head_dim

# Verdicts on the teacher-forced comparison with our bf16 cache. "broken": the model no
# longer predicts its own top-1 token on most positions (a cache that stores garbage lands
# here, see tests/test_compare.py); the other bands are descriptive, by mean KL.
BROKEN_AGREEMENT = 0.5
BANDS = [(0.005, "near-lossless"), (0.05, "small loss"), (0.3, "lossy")]

PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. "
                  "Find it and memorize it. I will quiz you about the important "
                  "information there.\n")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                  "Here we go. There and back again. ")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_NEW_TOKENS = 8
SPEED_TAIL = 16       # distinct tokens after the shared prefix, per sequence of a batch
GREEDY_TEXT_PROMPT = 384  # tokens of held-out text before a greedy continuation
GREEDY_PER_WINDOW = 4     # such prompts per window: consecutive segments of it


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


# --- inputs (made once, in the parent) ----------------------------------------------------
def held_out_windows(tokenizer, n_windows: int, window: int, seed: int = 0) -> list[list[int]]:
    """Windows of real text from speeches the tests' quality windows do not use: the same
    seeded shuffle as corpus.token_windows(seed=0), taken from the other end."""
    from vllm_kvq.corpus import _year, speeches, windows_from

    files = [f for f in speeches() if _year(f) >= 1990]
    random.Random(0).shuffle(files)
    return windows_from(files[::-1], tokenizer, n_windows, window, random.Random(1000 + seed))


def passkey_items(tokenizer, lengths: list[int], positions: int | dict, seed: int = 0,
                  filler: str = "repeat") -> list[dict]:
    """Prompts of exactly `length` tokens: a 5-digit key hidden at a seeded depth of the
    filler, then the question. All prompts share one filler stream, so each reuses the
    previous ones' cached prefix up to its needle (cheap on a 2-core CPU)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head, question = enc(PASSKEY_HEADER), enc(PASSKEY_QUESTION)
    need = max(lengths)
    if filler == "text":
        stream: list[int] = []
        for w in held_out_windows(tokenizer, 1 + need // 2048, 2048, seed=seed + 7):
            stream += w
    else:
        unit = enc(PASSKEY_FILLER)
        stream = unit * (need // len(unit) + 2)
    rng = random.Random(seed)
    items = []
    for length in lengths:
        n = positions.get(length, positions.get(str(length))) if isinstance(positions, dict) \
            else positions
        for i in range(n):
            key = str(rng.randrange(10000, 100000))
            needle = enc(PASSKEY_NEEDLE.format(key=key))
            body = length - len(head) - len(needle) - len(question)
            if body < 16:
                raise ValueError(f"passkey length {length} is too short")
            # seeded depths, spread over the prompt: one per equal slice
            depth = (i + rng.uniform(0.1, 0.9)) / n
            pos = int(depth * body)
            ids = head + stream[:pos] + needle + stream[pos:body] + question
            assert len(ids) == length
            items.append({"length": length, "depth": round(depth, 3),
                          "needle_at": len(head) + pos, "key": key, "ids": ids})
    return items


# --- one engine (runs in the worker process) ----------------------------------------------
def _progress(stage: str) -> None:
    print(f"@@stage {stage}", flush=True)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_passkey(llm, items: list[dict]) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=PASSKEY_NEW_TOKENS, temperature=0.0)
    order = sorted(range(len(items)), key=lambda i: (-items[i]["length"],
                                                     -items[i]["needle_at"]))
    texts, first_s = {}, None
    # the longest, deepest first alone: the others then find their prefix in the cache
    for batch in (order[:1], order[1:]):
        if not batch:
            continue
        t, outs = _timed(lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=items[i]["ids"]) for i in batch], sp,
            use_tqdm=False))
        first_s = t if first_s is None else first_s
        for i, o in zip(batch, outs):
            texts[i] = o.outputs[0].text
    result = []
    for i, it in enumerate(items):
        m = re.search(r"\d+", texts[i])
        result.append({"length": it["length"], "depth": it["depth"], "key": it["key"],
                       "output": texts[i], "correct": bool(m and m.group() == it["key"])})
    if order:  # an uncached prefill of the longest prompt (+ a few new tokens): kept for speed
        result[order[0]]["uncached_s"] = first_s
    return result


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its children (vLLM's engine core and
    worker): unlike wall time, it does not grow while other jobs hold the CPU."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _engine_tpot(outs) -> float | None:
    """Mean decode time per output token from vLLM's own per-request timestamps (engine
    core clock, first to last generated token: no prefill, no request overhead)."""
    vals = []
    for o in outs:
        m = getattr(o, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0) if m is not None else 0
        if n > 1 and m.last_token_ts > m.first_token_ts:
            vals.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return sum(vals) / len(vals) if vals else None


def run_speed(llm, contexts: list[int], batches: list[int], decode_tokens: int,
              repeats: int, vocab: int, seed: int, known: dict | None = None,
              timing: str = "wall") -> list[dict]:
    """Per context: prefill tokens/s of one uncached prompt; then per batch size, the decode
    time per output token over the same prompts (their shared prefix is in the prefix
    cache), the best of `repeats`:
      timing "engine": from vLLM's per-request timestamps (first to last new token), plus
        the CPU seconds of the engine's processes per decode step (robust to other jobs);
      timing "wall": (T(1 + n new tokens) - T(1 new token)) / n in wall-clock time.
    `known`: {context: (prompt ids, seconds)} of a prompt of that length already prefilled
    uncached (the longest passkey prompt): its prefix and timing are reused, which saves
    the longest prefill."""
    known = known or {}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(200, vocab - 200) for _ in range(n)]  # noqa: E731

    def gen(prompts, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)

    gen([rand(64)], 4)  # warm-up
    rows = []
    for ctx in contexts:
        if ctx in known:
            ids, t_prefill = known[ctx]
            prefix = list(ids[:ctx - SPEED_TAIL])
            prompts = [prefix + rand(SPEED_TAIL) for _ in range(max(batches))]
            src = "passkey prompt"
        else:
            prefix = rand(ctx - SPEED_TAIL)
            prompts = [prefix + rand(SPEED_TAIL) for _ in range(max(batches))]
            t_prefill, _ = _timed(lambda: gen(prompts[:1], 1))
            src = "random tokens"
        row = {"context": ctx, "prefill_s": t_prefill, "prefill_tok_s": ctx / t_prefill,
               "prefill_source": src, "decode": []}
        for b in batches:
            if timing == "engine":
                tpots, cpu1, cpun = [], [], []
                for _ in range(repeats):
                    c0 = _tree_cpu_s()
                    gen(prompts[:b], 1)
                    c1 = _tree_cpu_s()
                    outs = gen(prompts[:b], 1 + decode_tokens)
                    c2 = _tree_cpu_s()
                    tpots.append(_engine_tpot(outs))
                    cpu1.append(c1 - c0)
                    cpun.append(c2 - c1)
                if any(t is None for t in tpots):
                    raise RuntimeError("vLLM returned no request metrics (log stats off?)")
                # least disturbed of each, then the difference: the decode steps' CPU time
                tpot = min(tpots)
                cpu = max(min(cpun) - min(cpu1), 0.0) / decode_tokens
                if cpu <= 0:  # too noisy to tell; never report an impossible zero
                    cpu = min(cpun) / (1 + decode_tokens)
                row["decode"].append({"batch": b, "tpot_ms": tpot * 1e3,
                                      "decode_tok_s": b / tpot, "cpu_ms_per_step": cpu * 1e3,
                                      "decode_tok_per_cpu_s": b / cpu})
                continue
            t1 = min(_timed(lambda: gen(prompts[:b], 1))[0] for _ in range(repeats))
            tn = min(_timed(lambda: gen(prompts[:b], 1 + decode_tokens))[0]
                     for _ in range(repeats))
            tpot = max(tn - t1, 1e-9) / decode_tokens
            row["decode"].append({"batch": b, "tpot_ms": tpot * 1e3,
                                  "decode_tok_s": b / tpot})
        rows.append(row)
    return rows


def run_worker(spec: dict) -> dict:
    """One method, one engine: capacity, quality, greedy, passkey, speed."""
    os.environ.update(spec.get("env", {}))  # inherited by the engine's processes
    from vllm import LLM

    method = spec["method"]
    _progress("engine start")
    t0 = time.perf_counter()
    timing = (spec.get("speed") or {}).get("timing", "wall")
    llm = LLM(**engine_kwargs(method, spec["model"], spec["kv_budget"], spec["max_model_len"],
                              dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
                              enable_prefix_caching=True,
                              # per-request timestamps (RequestOutput.metrics) need stats on
                              **({"disable_log_stats": False} if timing == "engine" else {})))
    res = {"method": method, "kv_budget": spec["kv_budget"], **capacity(llm),
           "startup_s": time.perf_counter() - t0}
    t = time.perf_counter()
    if spec.get("windows"):
        _progress("quality (teacher-forced)")
        res["prompt"] = prompt_logprobs(llm, spec["windows"])
        res["greedy"] = greedy(llm, GREEDY_PROMPTS)
        _progress("greedy decoding")
        res["greedy_text"] = greedy(llm, [{"prompt_token_ids": p}
                                          for p in spec["greedy_prompts"]],
                                    max_tokens=spec["greedy_tokens"])
    res["quality_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if spec.get("passkey"):
        _progress("passkey")
        res["passkey"] = run_passkey(llm, spec["passkey"])
    res["passkey_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if spec.get("speed"):
        _progress("speed")
        sp = spec["speed"]
        vocab = llm.llm_engine.model_config.get_vocab_size()
        known = {it["length"]: (spec["passkey"][i]["ids"], it["uncached_s"])
                 for i, it in enumerate(res.get("passkey", [])) if it.get("uncached_s")}
        res["speed"] = run_speed(llm, sp["contexts"], sp["batches"], sp["decode_tokens"],
                                 sp["repeats"], vocab, spec["seed"], known, timing)
    res["speed_s"] = time.perf_counter() - t
    return res


# --- the attention kernel alone (its own process) ------------------------------------------
def _load_bench():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_attention.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} (the kernel benchmark needs a source checkout)")
    mod_spec = importlib.util.spec_from_file_location("bench_cpu_attention", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def run_kernel_bench(spec: dict) -> dict:
    """Decode attention alone on SmolLM2's shape: each format through our kernel and vLLM's
    bf16 CPU attention op on the same queries, K/V and block tables (seeded, as in
    benchmarks/bench_cpu_attention.py)."""
    import torch

    bench = _load_bench()
    Hq, H, D = spec["shape"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    have_vllm = bench.vllm_available()
    rows = []
    for batch in spec["batches"]:
        for ctx in spec["contexts"]:
            _progress(f"kernel batch {batch} ctx {ctx}")
            gen = torch.Generator().manual_seed(1000 * batch + ctx + D)
            q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16)
            k = torch.randn(bench.BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
            v = torch.randn(bench.BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
            row = {"batch": batch, "context": ctx, "ms": {}}
            if have_vllm:
                ms, _, _ = bench.bench_vllm(Hq, H, D, batch, ctx,
                                            torch.Generator().manual_seed(7), q, k, v)
                row["ms"]["vllm"] = ms
            for name in spec["formats"]:
                ms, _, _ = bench.bench_ours(name, Hq, H, D, batch, ctx,
                                            torch.Generator().manual_seed(7), q, k, v)
                row["ms"][name] = ms
            rows.append(row)
    from vllm_kvq import ops
    return {"shape": list(spec["shape"]), "threads": torch.get_num_threads(),
            "simd_path": ops.simd_path(), "vllm_op": have_vllm, "rows": rows}


# --- scoring -------------------------------------------------------------------------------
def verdict(cmp: dict) -> str:
    if cmp["agreement"] < BROKEN_AGREEMENT:
        return "broken"
    for limit, name in BANDS:
        if cmp["mean_kl"] < limit:
            return name
    return "severe loss"


def greedy_token_agreement(base: list[list[int]], other: list[list[int]]) -> float:
    """Mean fraction of greedy tokens generated before the first one that differs."""
    fracs = []
    for a, b in zip(base, other, strict=True):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        fracs.append(n / max(len(a), 1))
    return sum(fracs) / max(len(fracs), 1)


def score_quality(base: dict, other: dict) -> dict:
    """compare_runs (teacher-forced ppl, KL, agreement) plus greedy-decoding agreement and a
    verdict; `base` and `other` are run dicts as evaluate.run_method returns them."""
    cmp = compare_runs(base, other)
    if base.get("greedy_text") and other.get("greedy_text"):
        cmp["greedy_token_agreement"] = greedy_token_agreement(base["greedy_text"],
                                                               other["greedy_text"])
    cmp["verdict"] = verdict(cmp)
    return cmp


def passkey_summary(items: list[dict]) -> dict:
    by_len: dict[int, list[bool]] = {}
    for it in items:
        by_len.setdefault(it["length"], []).append(it["correct"])
    out = {str(k): sum(v) / len(v) for k, v in sorted(by_len.items())}
    out["all"] = sum(it["correct"] for it in items) / max(len(items), 1)
    return out


def model_dims(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads", heads),
            "q_heads": heads, "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "vocab": cfg["vocab_size"], "max_position_embeddings":
            cfg.get("max_position_embeddings")}


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def base_method(method: str) -> str:
    return method.removesuffix(FAULT_SUFFIX)


def memory_row(method: str, dims: dict, dtype: str, block_size: int = 128) -> dict:
    """Bytes per token per kv head (K+V, scales/zero-points/padding included), for the whole
    model, the residual window per sequence, and the ratio to a bf16 cache."""
    D, L, H = dims["head_dim"], dims["layers"], dims["kv_heads"]
    elem = DTYPE_BYTES.get(dtype, 2)
    m = base_method(method)
    if m in VLLM_PEERS:
        per_head = 2 * D * (1 if m == "vllm-fp8" else elem)
        desc = "fp8 (vLLM)" if m == "vllm-fp8" else f"{dtype} (vLLM)"
        residual = 0
        fields = {}
    else:
        from vllm_kvq.config import config_from_dict

        fmt = config_from_dict({"method": m}).fmt
        lay = fmt.layout(D, block_size)
        per_head = lay.token_bytes
        desc = f"K {fmt.key.describe()}, V {fmt.value.describe()}" + (
            f", {fmt.residual_tokens} recent fp" if fmt.residual_tokens else "")
        residual = fmt.residual_bytes_per_seq(L, H, D, elem)
        fields = {k: v / block_size for k, v in lay.fields().items() if v}
    return {"format": desc, "bytes_per_token_head": per_head,
            "bytes_per_token_model": per_head * L * H, "bits_per_value": per_head * 8 / (2 * D),
            "ratio_vs_bf16": 4 * D / per_head, "residual_bytes_per_seq": residual,
            "fields_per_token_head": fields}


# --- the parent: runs every engine, then writes the report ---------------------------------
def _run_child(args: list[str], log: Path, timeout: int, bar=None) -> tuple[int, str]:
    """Runs `python -m vllm_kvq.compare ...`; stage lines go to the progress bar, the rest
    (vLLM's logs) to `log`. Returns (returncode, last error line)."""
    import threading

    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_kvq.compare", *args],
                                stdout=subprocess.PIPE, stderr=logf, text=True,
                                start_new_session=True)
        fired = []

        def kill():  # a hung engine must not hang the run (nor leave its engine core)
            fired.append(True)
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("@@stage ") and bar is not None:
                    bar.set_postfix_str(line[8:].strip()[:40])
                else:
                    logf.write(line)
                    logf.flush()
            rc = proc.wait()
        except BaseException:  # interrupted: take the engine down with us
            kill()
            raise
        finally:
            timer.cancel()
    if fired:
        return rc, f"timed out after {timeout} s"
    return rc, _error_line(log.read_text(errors="replace")) if rc else ""


GENERIC_ERRORS = ("Engine core initialization failed", "please check the stack trace",
                  "died unexpectedly")


def _error_line(text: str) -> str:
    """The root cause in an engine's log: vLLM wraps a worker's exception in generic ones
    ("Engine core initialization failed"); prefer the innermost specific message."""
    m = re.findall(r"Worker failed with error '(.+?)', please check", text)
    if m:
        return m[0][:400]
    causes = []
    for ln in text.splitlines():
        c = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", ln)
        if c and not any(g in ln for g in GENERIC_ERRORS):
            causes.append(f"{c.group(1)}: {c.group(2).strip()}")
    if causes:
        return causes[0][:400]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "no output"


def engine_cores(log: Path) -> str | None:
    """The cores vLLM's CPU worker bound its OpenMP threads to (from its log)."""
    m = re.search(r"core ids=\[([^\]]*)\]", log.read_text(errors="replace"))
    return m.group(1) if m else None


def worker_spec(plan: Plan, method: str, inputs: dict) -> dict:
    env = {"VLLM_KVQ_FAULT": "clobber_cache"} if method.endswith(FAULT_SUFFIX) else {}
    if plan.cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = plan.cpu_bind
    return {"method": base_method(method), "label": method, "model": plan.model,
            "dtype": plan.dtype, "kv_budget": plan.kv_budget,
            "max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len,
            "seed": plan.seed, "env": env, "windows": inputs["windows"],
            "greedy_prompts": inputs["greedy_prompts"], "greedy_tokens": plan.greedy_tokens,
            "passkey": inputs["passkey"],
            "speed": {"contexts": plan.contexts, "batches": plan.batches,
                      "decode_tokens": plan.decode_tokens, "repeats": plan.speed_repeats,
                      "timing": plan.speed_timing}
            if plan.contexts else None}


def greedy_prompts(windows: list[list[int]]) -> list[list[int]]:
    """Up to GREEDY_PER_WINDOW consecutive segments of GREEDY_TEXT_PROMPT tokens per window:
    greedy decoding diverges at the first near-tie, so one prompt per window says little."""
    n = GREEDY_TEXT_PROMPT
    return [w[j * n:(j + 1) * n] for w in windows
            for j in range(min(GREEDY_PER_WINDOW, len(w) // n))]


def make_inputs(plan: Plan) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(plan.model)
    windows = (held_out_windows(tok, plan.quality_windows, plan.quality_window, plan.seed)
               if plan.quality_windows else [])
    return {"windows": windows,
            "greedy_prompts": greedy_prompts(windows),
            "passkey": passkey_items(tok, plan.passkey_lengths,
                                     {n: plan.passkey_counts.get(str(n), plan.passkey_positions)
                                      for n in plan.passkey_lengths},
                                     plan.seed, plan.passkey_filler)
            if plan.passkey_lengths else []}


def run_compare(plan: Plan, out: Path) -> dict:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    methods = list(plan.methods)
    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # every ratio is to our bf16 in the same run
    else:
        methods.remove(BASELINE)
        methods.insert(0, BASELINE)
    dims = model_dims(plan.model)
    if dims["max_position_embeddings"] and plan.max_model_len > dims["max_position_embeddings"]:
        raise SystemExit(f"contexts/passkey lengths need max_model_len={plan.max_model_len} > "
                         f"the model's {dims['max_position_embeddings']}; use shorter ones")
    t_start = time.perf_counter()
    inputs = make_inputs(plan)
    runs, failures, wall = {}, {}, {}
    bar = tqdm(methods, desc="engines", unit="engine", dynamic_ncols=True)
    for method in bar:
        bar.set_description(f"{method:>18}")
        if plan.skip_unsupported and method == "vllm-fp8" and not cpu_has_fp8_kv():
            failures[method] = ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX (not "
                                "started: this CPU has neither; a full run starts it anyway)")
            continue
        spec_path = out / "runs" / f"{method}.spec.json"
        run_path = out / "runs" / f"{method}.json"
        spec_path.write_text(json.dumps(worker_spec(plan, method, inputs)))
        t0 = time.perf_counter()
        rc, err = _run_child(["worker", str(spec_path), str(run_path)],
                             out / "logs" / f"{method}.log", plan.timeout_s, bar)
        wall[method] = time.perf_counter() - t0
        spec_path.unlink()
        if rc == 0:
            runs[method] = json.loads(run_path.read_text())
            runs[method]["engine_cores"] = engine_cores(out / "logs" / f"{method}.log")
        else:
            failures[method] = err
            tqdm.write(f"{method}: unavailable: {err}")
    kernel = None
    if plan.kernel:
        kbar = tqdm(total=1, desc="attention kernel alone", dynamic_ncols=True)
        kspec = out / "runs" / "kernel.spec.json"
        kformats = [m for m in methods if m not in VLLM_PEERS and FAULT_SUFFIX not in m]
        kspec.write_text(json.dumps({"shape": list(KERNEL_SHAPE)
                                     if (dims["q_heads"], dims["kv_heads"], dims["head_dim"])
                                     == KERNEL_SHAPE else
                                     [dims["q_heads"], dims["kv_heads"], dims["head_dim"]],
                                     "contexts": plan.kernel_contexts,
                                     "batches": plan.kernel_batches, "formats": kformats,
                                     "threads": plan.kernel_threads}))
        t0 = time.perf_counter()
        rc, err = _run_child(["kernel", str(kspec), str(out / "runs" / "kernel.json")],
                             out / "logs" / "kernel.log", plan.timeout_s, kbar)
        wall["kernel"] = time.perf_counter() - t0
        kspec.unlink()
        kbar.update(1)
        kbar.close()
        if rc == 0:
            kernel = json.loads((out / "runs" / "kernel.json").read_text())
        else:
            failures["kernel"] = err
    result = assemble(plan, dims, methods, runs, failures, kernel, wall)
    result["total_s"] = time.perf_counter() - t_start
    return result


def assemble(plan: Plan, dims: dict, methods: list[str], runs: dict, failures: dict,
             kernel: dict | None, wall: dict) -> dict:
    """Everything the report shows, from the raw runs (pure: tested without engines)."""
    base = runs.get(BASELINE)
    rows = []
    for method in methods:
        row = {"method": method, **memory_row(method, dims, plan.dtype)}
        row["wall_s"] = wall.get(method)
        if method in failures:
            row["unavailable"] = failures[method]
            rows.append(row)
            continue
        run = runs[method]
        row.update(num_blocks=run["num_blocks"], block_size=run["block_size"],
                   capacity_tokens=run["capacity_tokens"],
                   startup_s=run.get("startup_s"), engine_cores=run.get("engine_cores"),
                   stage_s={k: run.get(k) for k in ("startup_s", "quality_s", "passkey_s",
                                                     "speed_s")})
        if base:
            row["capacity_ratio"] = run["capacity_tokens"] / base["capacity_tokens"]
            if run.get("prompt") and base.get("prompt"):
                row["quality"] = score_quality(base, run)
        if run.get("passkey"):
            row["passkey"] = passkey_summary(run["passkey"])
            row["passkey_items"] = run["passkey"]
        if run.get("speed"):
            row["speed"] = run["speed"]
            if base and base.get("speed"):
                row["speed_ratio"] = speed_ratios(base["speed"], run["speed"])
        rows.append(row)
    return {"plan": dataclasses.asdict(plan), "model_dims": dims, "rows": rows,
            "kernel": kernel, "failures": failures,
            "greedy_prompts": len(base.get("greedy_text") or []) if base else 0}


def rebuild(out: Path) -> dict:
    """results.json re-assembled from the raw per-engine runs in out/runs (as the run left
    them), so scoring and report changes need no new engine runs."""
    result = json.loads((out / "results.json").read_text())
    methods = [r["method"] for r in result["rows"]]
    if not all((out / "runs" / f"{m}.json").exists() for m in methods
               if m not in result["failures"]):
        return result
    runs = {}
    for m in methods:
        if m not in result["failures"]:
            runs[m] = json.loads((out / "runs" / f"{m}.json").read_text())
            runs[m].setdefault("engine_cores", next(
                (r.get("engine_cores") for r in result["rows"] if r["method"] == m), None))
    plan = Plan(**{"speed_timing": "wall", **result["plan"]})  # older runs: wall timing
    wall = {r["method"]: r.get("wall_s") for r in result["rows"]}
    new = assemble(plan, result["model_dims"], methods, runs, result["failures"],
                   result.get("kernel"), wall)
    for key in ("total_s", "machine", "command", "notes"):
        if key in result:
            new[key] = result[key]
    return new


def speed_ratios(base: list[dict], other: list[dict]) -> list[dict]:
    """Per context: prefill and per-batch decode tokens/s as a ratio to the baseline's."""
    b_by = {r["context"]: r for r in base}
    out = []
    for r in other:
        b = b_by.get(r["context"])
        if not b:
            continue
        bd = {d["batch"]: d for d in b["decode"]}
        out.append({"context": r["context"],
                    "prefill": r["prefill_tok_s"] / b["prefill_tok_s"],
                    "decode": {str(d["batch"]): d["decode_tok_s"] / bd[d["batch"]]["decode_tok_s"]
                               for d in r["decode"] if d["batch"] in bd},
                    "decode_cpu": {str(d["batch"]): bd[d["batch"]]["cpu_ms_per_step"]
                                   / d["cpu_ms_per_step"] for d in r["decode"]
                                   if d["batch"] in bd and "cpu_ms_per_step" in d
                                   and "cpu_ms_per_step" in bd[d["batch"]]}})
    return out


# --- report --------------------------------------------------------------------------------
def _f(x, fmt="{:.3g}", none="–"):
    return none if x is None else fmt.format(x)


def _ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else (
        f"{n / 1000:g}k" if n >= 1000 else str(n))


def markdown(result: dict, command: str = "", machine: str = "") -> str:
    plan, rows, dims = result["plan"], result["rows"], result["model_dims"]
    L = []
    L.append(f"# KV-cache methods compared on {Path(plan['model']).name}\n")
    if command:
        L.append(f"Command: `{command}`  ")
    if result.get("total_s") is not None:
        L.append(f"Run time: {result['total_s'] / 60:.1f} min"
                 + (f" on {machine}" if machine else "") + "  ")
    L.append(f"Model: {dims['layers']} layers, {dims['q_heads']} query / {dims['kv_heads']} kv "
             f"heads, head_dim {dims['head_dim']}; computed in {plan['dtype']}; KV budget "
             f"{plan['kv_budget'] / 2**20:.0f} MiB, max_num_seqs {plan['max_num_seqs']}, "
             f"block size 128, prefix caching on"
             + (f"; vLLM's CPU worker bound its OpenMP threads to core(s) {cores}"
                if (cores := next((r.get("engine_cores") for r in rows
                                   if r.get("engine_cores")), None)) else "") + ".\n")
    for note in result.get("notes", []):
        L.append(f"> **Note:** {note}\n")
    L.append("Every method ran in its own vLLM engine process on identical inputs. Quality is "
             "against our `bf16` cache (same kernels), teacher-forced with vLLM's prompt "
             f"log-probs on {plan['quality_windows']} held-out windows of "
             f"{plan['quality_window']} tokens of real text (State of the Union speeches the "
             "tests do not use); with our backend a prefill query reads exactly the K/V a "
             "decode step would. Speed ratios are to our `bf16` measured in the same run "
             "(> 1: faster).\n")

    L.append("## Memory\n")
    L.append("| method | stored as | B/token/kv-head | KiB/token (model) | bits/value | "
             "× smaller than bf16 | residual window KiB/seq | capacity (tokens) | "
             "capacity × bf16 |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = "unavailable" if r.get("unavailable") else _f(r.get("capacity_tokens"), "{:,}")
        L.append(f"| `{r['method']}` | {r['format']} | {r['bytes_per_token_head']:g} | "
                 f"{r['bytes_per_token_model'] / 1024:.2f} | {r['bits_per_value']:.2f} | "
                 f"{r['ratio_vs_bf16']:.2f} | {r['residual_bytes_per_seq'] / 1024:,.0f} | "
                 f"{cap} | {_f(r.get('capacity_ratio'), '{:.2f}')} |")
    L.append("\nBytes per token include scales, zero-points and padding (csrc/kvq_layout.h). "
             "The residual window (recent tokens kept in full precision, in the model's "
             f"dtype) is taken out of the KV budget for all {plan['max_num_seqs']} sequence "
             "slots before vLLM sizes its pages, so it lowers capacity.\n")

    pk_lens = plan["passkey_lengths"]
    pk_text = (f"Passkey: a 5-digit key at seeded depths ("
               + ", ".join(f"{plan.get('passkey_counts', {}).get(str(n), plan['passkey_positions'])}"
                           f" at {_ctx_label(n)}" for n in pk_lens)
               + f") in {plan['passkey_filler']} filler; accuracy of the first number "
               f"generated.")
    has_q = any(r.get("quality") for r in rows)
    if not has_q and any(r.get("passkey") for r in rows):
        L.append("## Passkey\n")
        L.append("| method | " + " | ".join(f"passkey {_ctx_label(n)}" for n in pk_lens) + " |")
        L.append("|---|" + "---:|" * len(pk_lens))
        for r in rows:
            pk = r.get("passkey") or {}
            L.append(f"| `{r['method']}` | " + " | ".join(
                ("unavailable" if r.get("unavailable") else _f(pk.get(str(n)), "{:.2f}"))
                for n in pk_lens) + " |")
        L.append("\n" + pk_text + "\n")
    if has_q:
        L.append("## Quality\n")
        L.append("| method | ppl | Δppl | mean KL (nats) | top-1 agree | agree (confident) | "
                 "greedy tokens agree | greedy prompts identical | "
                 + " | ".join(f"passkey {_ctx_label(n)}" for n in pk_lens) + " | verdict |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(pk_lens) + "---|")
        for r in rows:
            if r.get("unavailable"):
                L.append(f"| `{r['method']}` | unavailable: {r['unavailable']} |" + " |" *
                         (7 + len(pk_lens)) + " |")
                continue
            q = r.get("quality") or {}
            pk = r.get("passkey") or {}
            L.append(f"| `{r['method']}` | {_f(q.get('ppl'), '{:.3f}')} | "
                     f"{_f(q.get('ppl_change'), '{:+.2%}')} | {_f(q.get('mean_kl'), '{:.4f}')} | "
                     f"{_f(q.get('agreement'), '{:.3f}')} | "
                     f"{_f(q.get('agreement_confident'), '{:.3f}')} | "
                     f"{_f(q.get('greedy_token_agreement'), '{:.2f}')} | "
                     f"{_f(q.get('greedy_identical'), '{:.2f}')} | "
                     + " | ".join(_f(pk.get(str(n)), "{:.2f}") for n in pk_lens)
                     + f" | {q.get('verdict', '–')} |")
        L.append(f"\nKL: KL(bf16 ‖ method) over bf16's top-20 tokens plus one bucket for the rest, "
                 f"per position, averaged. Confident: positions where bf16's top-1 beats its top-2 "
                 f"by ≥ 0.5 nats. Greedy tokens agree: fraction of {plan['greedy_tokens']} greedy "
                 f"tokens after {GREEDY_TEXT_PROMPT} tokens of held-out text "
                 f"({result.get('greedy_prompts', '?')} prompts) produced before the first "
                 f"difference from bf16, averaged; coarse, as greedy decoding flips at the first "
                 f"near-tie (the teacher-forced columns are the robust measure). Prompts identical: "
                 f"4 short prompts × 24 tokens. " + pk_text + " "
                 f"Verdict: broken if top-1 agreement < {BROKEN_AGREEMENT}; "
                 f"else by KL: < 0.005 near-lossless, < 0.05 small loss, < 0.3 lossy, "
                 f"else severe loss.\n")

    if any(r.get("speed") for r in rows):
        L.append("## Speed (whole engine)\n")
        ctxs = plan["contexts"]
        bs = plan["batches"]
        engine_timing = plan.get("speed_timing", "wall") == "engine"
        how = ("from vLLM's own per-request timestamps (first to last generated token, so no "
               "prefill)" if engine_timing else "as the wall-clock difference between "
               f"generating 1 and 1 + {plan['decode_tokens']} tokens for the same prompts")
        L.append("Decode tokens/s (all sequences of the batch together) and, in brackets, the "
                 f"ratio to bf16; time per output token = batch / tokens/s, {how}. "
                 f"{plan['decode_tokens']} decode steps over prompts that share the context's "
                 f"prefix (prefix cache), best of {plan['speed_repeats']}. Prefill: one "
                 "uncached prompt of the context's length (at the longest passkey length: the "
                 "passkey prompt's own uncached prefill, 8 new tokens included).\n")
        head = ["method"] + [f"prefill {_ctx_label(c)}" for c in ctxs] + [
            f"decode b={b} @ {_ctx_label(c)}" for c in ctxs for b in bs]
        L.append("| " + " | ".join(head) + " |")
        L.append("|---|" + "---:|" * (len(head) - 1))
        for r in rows:
            if not r.get("speed"):
                continue
            sp = {x["context"]: x for x in r["speed"]}
            ratio = {x["context"]: x for x in r.get("speed_ratio", [])}
            cells = []
            for c in ctxs:
                rr = ratio.get(c, {}).get("prefill")
                cells.append(f"{sp[c]['prefill_tok_s']:.0f} ({_f(rr, '{:.2f}')})")
            for c in ctxs:
                dd = {d["batch"]: d for d in sp[c]["decode"]}
                for b in bs:
                    rr = ratio.get(c, {}).get("decode", {}).get(str(b))
                    cells.append(f"{dd[b]['decode_tok_s']:.1f} ({_f(rr, '{:.2f}')})")
            L.append(f"| `{r['method']}` | " + " | ".join(cells) + " |")
        L.append("\nTime per output token (ms), per sequence:\n")
        head = ["method"] + [f"b={b} @ {_ctx_label(c)}" for c in ctxs for b in bs]
        L.append("| " + " | ".join(head) + " |")
        L.append("|---|" + "---:|" * (len(head) - 1))
        for r in rows:
            if not r.get("speed"):
                continue
            sp = {x["context"]: x for x in r["speed"]}
            cells = [f"{d['tpot_ms']:.1f}" for c in ctxs
                     for d in sorted(sp[c]["decode"], key=lambda d: d["batch"])]
            L.append(f"| `{r['method']}` | " + " | ".join(cells) + " |")
        if engine_timing:
            L.append("\nCPU time per decode step (ms, all of the engine's processes; unlike "
                     "wall time it does not grow while other jobs hold the CPU) and, in "
                     "brackets, bf16's CPU time / this method's (> 1: cheaper):\n")
            L.append("| " + " | ".join(head) + " |")
            L.append("|---|" + "---:|" * (len(head) - 1))
            for r in rows:
                if not r.get("speed"):
                    continue
                sp = {x["context"]: x for x in r["speed"]}
                ratio = {x["context"]: x for x in r.get("speed_ratio", [])}
                cells = []
                for c in ctxs:
                    for d in sorted(sp[c]["decode"], key=lambda d: d["batch"]):
                        rr = ratio.get(c, {}).get("decode_cpu", {}).get(str(d["batch"]))
                        cells.append(f"{_f(d.get('cpu_ms_per_step'), '{:.1f}')} "
                                     f"({_f(rr, '{:.2f}')})")
                L.append(f"| `{r['method']}` | " + " | ".join(cells) + " |")
        L.append("")

    k = result.get("kernel")
    if k:
        L.append("## Attention kernel alone\n")
        Hq, H, D = k["shape"]
        L.append(f"Decode attention, one query token per sequence, shape {Hq}/{H}/{D} "
                 f"(query heads / kv heads / head_dim), {k['threads']} threads, our SIMD path "
                 f"{k['simd_path']}; ms per call (min over repeats) and, in brackets, speed "
                 "relative to vLLM's own CPU attention op (`cpu_attention_with_kv_cache`, bf16 "
                 "cache) on the same data (> 1: faster than vLLM)."
                 + ("" if k["vllm_op"] else " vLLM's op was not available here.") + "\n")
        cols = [(r["batch"], r["context"]) for r in k["rows"]]
        names = list(k["rows"][0]["ms"]) if k["rows"] else []
        L.append("| kernel | " + " | ".join(f"b={b} @ {_ctx_label(c)}" for b, c in cols) + " |")
        L.append("|---|" + "---:|" * len(cols))
        for n in names:
            cells = []
            for r in k["rows"]:
                ms = r["ms"][n]
                rel = r["ms"].get("vllm")
                cells.append(f"{ms:.3f}" + (f" ({rel / ms:.2f})" if rel else ""))
            label = "vLLM bf16 op" if n == "vllm" else f"`{n}`"
            L.append(f"| {label} | " + " | ".join(cells) + " |")
        L.append("")
    if result.get("failures"):
        L.append("## Unavailable\n")
        for m, e in result["failures"].items():
            L.append(f"- `{m}`: {e}")
        L.append("")
    return "\n".join(L)


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    files = []
    rows = [r for r in result["rows"] if not r.get("unavailable")]
    cmap = plt.get_cmap("tab20")
    color = {r["method"]: cmap(i % 20) for i, r in enumerate(result["rows"])}

    def ctx_axis(ax, ctxs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctxs, [_ctx_label(c) for c in ctxs])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3, which="both")

    q_rows = [r for r in rows if r.get("quality") and r["method"] != BASELINE]
    if q_rows:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        for ax, key, label in ((axes[0], "mean_kl", "mean KL vs bf16 (nats, log)"),
                               (axes[1], "ppl_change", "perplexity change vs bf16 (log)")):
            for r in q_rows:
                y = abs(r["quality"][key]) if key == "ppl_change" else r["quality"][key]
                y = max(y, 1e-5)
                x = r["bytes_per_token_head"]
                c = "tab:red" if r["quality"]["verdict"] == "broken" else (
                    "tab:gray" if r["method"] in VLLM_PEERS else "tab:blue")
                ax.scatter([x], [y], color=c)
                ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            bf16 = next(r for r in result["rows"] if r["method"] == BASELINE)
            ax.axvline(bf16["bytes_per_token_head"], color="k", lw=0.5, ls=":")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_yscale("log")
            ax.set_xlabel("bytes per token per kv head (scales included)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
        fig.suptitle(f"Quality vs memory, {Path(result['plan']['model']).name} "
                     f"(dotted line: bf16; |Δppl| shown)")
        fig.tight_layout()
        files.append(out / "quality_vs_bytes.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    s_rows = [r for r in rows if r.get("speed")]
    if s_rows:
        batches = result["plan"]["batches"]
        fig, axes = plt.subplots(1, len(batches) + 1, figsize=(4.2 * (len(batches) + 1), 4.4),
                                 squeeze=False)
        axes = axes[0]
        for r in s_rows:
            ctxs = [x["context"] for x in r["speed"]]
            ls = "--" if r["method"] in VLLM_PEERS else "-"
            for i, b in enumerate(batches):
                ys = [next(d["decode_tok_s"] for d in x["decode"] if d["batch"] == b)
                      for x in r["speed"]]
                axes[i].plot(ctxs, ys, ls, marker="o", ms=3, color=color[r["method"]],
                             label=r["method"])
            axes[-1].plot(ctxs, [x["prefill_tok_s"] for x in r["speed"]], ls, marker="o",
                          ms=3, color=color[r["method"]], label=r["method"])
        for i, b in enumerate(batches):
            axes[i].set_title(f"decode, batch {b}")
            axes[i].set_ylabel("tokens/s (all sequences)")
        axes[-1].set_title("prefill (one prompt)")
        axes[-1].set_ylabel("tokens/s")
        for ax in axes:
            ctx_axis(ax, result["plan"]["contexts"])
            ax.set_ylim(bottom=0)
        axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle("Whole-engine speed vs context (dashed: vLLM's own attention)")
        fig.tight_layout()
        files.append(out / "speed_vs_context.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    k = result.get("kernel")
    if k and k["rows"]:
        batches = sorted({r["batch"] for r in k["rows"]})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.2),
                                 squeeze=False)
        for i, b in enumerate(batches):
            sub = [r for r in k["rows"] if r["batch"] == b]
            for name in sub[0]["ms"]:
                axes[0][i].plot([r["context"] for r in sub], [r["ms"][name] for r in sub],
                                "--" if name == "vllm" else "-", marker="o", ms=3,
                                color="k" if name == "vllm" else color.get(name),
                                label="vLLM bf16 op" if name == "vllm" else name)
            axes[0][i].set_title(f"attention kernel alone, batch {b}")
            ctx_axis(axes[0][i], sorted({r["context"] for r in sub}))
            axes[0][i].set_yscale("log")
            axes[0][i].set_ylabel("ms per decode call (log)")
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        files.append(out / "kernel_vs_context.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def cpu_has_fp8_kv() -> bool:
    """vLLM 0.32's FP8 CPU cache needs AVX-512 or AMX (checked by its worker at start)."""
    try:
        flags = re.search(r"flags\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        return True
    f = set(flags.group(1).split()) if flags else set()
    return "avx512f" in f or "amx_tile" in f


def machine_description() -> str:
    cpu, flags = platform.processor() or "cpu", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.+)", info)
        cpu = m.group(1).strip() if m else cpu
        f = re.search(r"flags\s*:\s*(.+)", info)
        flags = f.group(1).split() if f else []
        simd = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
        flags = f", {simd}" + (", AVX512-BF16" if "avx512_bf16" in flags else "")
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}{flags})"


def write_outputs(result: dict, out: Path, command: str) -> dict:
    light = json.loads(json.dumps(result))
    machine = result.get("machine") or machine_description()
    light["machine"] = machine
    light["command"] = command
    (out / "results.json").write_text(json.dumps(light, indent=1))
    files = plots(result, out)
    md = markdown(result, command, machine)
    if files:
        md += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in files) + "\n"
    (out / "report.md").write_text(md)
    return {"report": out / "report.md", "json": out / "results.json", "plots": files}


# --- command line ---------------------------------------------------------------------------
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
                   help="greedy tokens generated after held-out text, compared with bf16")
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
        res = run_worker(spec) if argv[0] == "worker" else run_kernel_bench(spec)
        Path(argv[2]).write_text(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(prog="vllm-kvq compare")
    add_arguments(p)
    return cmd_compare(p.parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
