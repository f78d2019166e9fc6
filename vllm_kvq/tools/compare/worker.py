"""One method, one engine (`python -m vllm_kvq.tools.compare worker SPEC OUT`): capacity,
teacher-forced quality, greedy decoding, passkey and speed, measured in this process."""
from __future__ import annotations

import os
import random
import re
import time

from vllm_kvq.tools.compare.children import progress
from vllm_kvq.tools.compare.inputs import PASSKEY_NEW_TOKENS
from vllm_kvq.tools.evaluate import (GREEDY_PROMPTS, capacity, engine_kwargs, greedy,
                                     prompt_logprobs)
from vllm_kvq.tools.faults import install_from_env as install_fault_from_env


SPEED_TAIL = 16       # distinct tokens after the shared prefix, per sequence of a batch


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
    os.environ.update(spec.get("env", {}))
    # The engine runs in this process (one per method already): no engine-core and worker
    # children importing torch and vLLM again (~20 s per engine on 2 cores), and its OpenMP
    # threads get every core (vLLM's worker child leaves one to the frontend). Every row,
    # vLLM's own backends too, runs the same way.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    install_fault_from_env()  # test-only (VLLM_KVQ_FAULT): patched into this process
    from vllm import LLM

    method = spec["method"]
    progress("engine start")
    t0 = time.perf_counter()
    timing = (spec.get("speed") or {}).get("timing", "wall")
    llm = LLM(**engine_kwargs(method, spec["model"], spec["kv_budget"], spec["max_model_len"],
                              dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
                              enable_prefix_caching=True,
                              # per-request timestamps (RequestOutput.metrics) need stats on
                              **({"disable_log_stats": False} if timing == "engine" else {})))
    res = {"method": method, "kv_budget": spec["kv_budget"], **capacity(llm),
           "startup_s": time.perf_counter() - t0}
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        # in this process, vLLM's CPU worker bound this thread's OpenMP team to these cores
        # (an engine in child processes logs them instead: run.py reads the log)
        res["engine_cores"] = ", ".join(map(str, sorted(os.sched_getaffinity(0))))
    t = time.perf_counter()
    if spec.get("windows"):
        progress("quality (teacher-forced)")
        res["prompt"] = prompt_logprobs(llm, spec["windows"])
        res["greedy"] = greedy(llm, GREEDY_PROMPTS)
        if spec["greedy_tokens"] > 0:  # --greedy-tokens 0: teacher-forced quality only
            progress("greedy decoding")
            res["greedy_text"] = greedy(llm, [{"prompt_token_ids": p}
                                              for p in spec["greedy_prompts"]],
                                        max_tokens=spec["greedy_tokens"])
    res["quality_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if spec.get("passkey"):
        progress("passkey")
        res["passkey"] = run_passkey(llm, spec["passkey"])
    res["passkey_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if spec.get("speed"):
        progress("speed")
        sp = spec["speed"]
        vocab = llm.llm_engine.model_config.get_vocab_size()
        known = {it["length"]: (spec["passkey"][i]["ids"], it["uncached_s"])
                 for i, it in enumerate(res.get("passkey", [])) if it.get("uncached_s")}
        res["speed"] = run_speed(llm, sp["contexts"], sp["batches"], sp["decode_tokens"],
                                 sp["repeats"], vocab, spec["seed"], known, timing)
    res["speed_s"] = time.perf_counter() - t
    return res
