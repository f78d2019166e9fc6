"""Run one KV-cache method through the real vLLM engine and measure it; compare two runs.

Quality is measured teacher-forced with vLLM's prompt log-probs: every window of real text
is one prompt, and with our backend a prefill query at position p reads exactly the K/V a
decode step at p would read (see vllm_kvq/reference.py), so this is what decode sees.

`python -m vllm_kvq.tools.evaluate --method kivi2 --out run.json` runs one method in its own
process (one engine per process keeps teardown clean); `compare_runs` scores it against a
baseline run. Methods: any kvq method name, or vLLM's own CPU attention as peers: "vllm"
(its cache in the model's dtype) and "vllm-fp8" (needs AVX-512 or AMX).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

TOP_K = 20             # log-probs kept per position (vLLM's default max_logprobs)
CONFIDENT_NATS = 0.5   # "confident" positions: baseline top-1 beats top-2 by this much
VLLM_PEERS = {"vllm": {}, "vllm-fp8": {"kv_cache_dtype": "fp8"}}
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                  "Water boils at a temperature of", "The three primary colors are"]


def engine_kwargs(method: str | dict, model: str, kv_budget: int, max_model_len: int,
                  **extra) -> dict:
    # vLLM's default max_num_seqs: the residual window takes memory only for the sequences
    # that run (vllm_kvq.window_cache)
    kw = dict(model=model, enforce_eager=True, max_model_len=max_model_len,
              kv_cache_memory_bytes=kv_budget, seed=0, max_logprobs=TOP_K)
    kw.update(extra)
    if isinstance(method, str) and method in VLLM_PEERS:
        kw.update(VLLM_PEERS[method])
    else:
        cfg = method if isinstance(method, dict) else {"method": method}
        kw.update(attention_backend="CUSTOM", additional_config={"kvq": cfg})
    return kw


def capacity(llm) -> dict:
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return {"num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "capacity_tokens": cache.num_gpu_blocks * cache.block_size,
            "max_num_seqs": config.scheduler_config.max_num_seqs}


def prompt_logprobs(llm, windows: list[list[int]]) -> list[list[dict]]:
    """Per window, per position 1..n-1: the true token's log-prob and the top-k."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], sp,
                        use_tqdm=False)
    result = []
    for w, o in zip(windows, outs):
        rows = []
        for pos, lp in enumerate(o.prompt_logprobs):
            if lp is None:
                continue
            top = sorted(((t, x.logprob) for t, x in lp.items()), key=lambda a: -a[1])[:TOP_K]
            rows.append({"token_lp": lp[w[pos]].logprob, "top": top})
        result.append(rows)
    return result


def greedy(llm, prompts: list, max_tokens: int = 24) -> list[list[int]]:
    """Greedy tokens of prompts (text, or token-id prompts as default_inputs gives them)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def greedy_with_margins(llm, prompts: list, max_tokens: int = 24, ignore_eos: bool = False,
                        spans: list | None = None, margins: bool = True):
    """Greedy tokens and, per step, the top-1 minus top-2 log-prob (how close a tie was;
    empty lists with margins=False). spans: filled with each request's (first, last)
    generated-token engine timestamps (the engine must log stats)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2 if margins else None,
                        ignore_eos=ignore_eos, detokenize=False)
    tokens, tie_margins = [], []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        tokens.append(list(o.outputs[0].token_ids))
        top2 = [sorted((x.logprob for x in step.values()), reverse=True)[:2]
                for step in o.outputs[0].logprobs or []]
        tie_margins.append([a - b for a, b in top2])
        if spans is not None:
            spans.append((o.metrics.first_token_ts, o.metrics.last_token_ts))
    return tokens, tie_margins


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def run_method(method, model: str, windows: list[list[int]], kv_budget: int = 256 << 20,
               greedy_prompts: list | None = None, **extra) -> dict:
    """greedy_prompts: GREEDY_PROMPTS as token ids (default_inputs); with them the engine runs
    without a tokenizer of its own (vLLM loads Gemma 3's ~3 times, ~20 s a start); [] runs
    no greedy generation (its "greedy" is then [])."""
    from vllm import LLM

    max_len = max(len(w) for w in windows) + 64
    if greedy_prompts is not None:
        extra.setdefault("skip_tokenizer_init", True)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(method, model, kv_budget, max_len, **extra))
    t1 = time.perf_counter()
    run = {"method": method, "kv_budget": kv_budget, **capacity(llm),
           "startup_s": t1 - t0}
    run["prompt"] = prompt_logprobs(llm, windows)
    t2 = time.perf_counter()
    prompts = GREEDY_PROMPTS if greedy_prompts is None else greedy_prompts
    run["greedy"] = greedy(llm, prompts) if prompts else []
    run["prefill_s"] = t2 - t1
    run["anon_huge_kib"] = anon_huge_kib()  # the engine (in this process) still alive
    return run


def anon_huge_kib() -> int:
    """KiB of this process's memory on transparent huge pages (Linux; 0 elsewhere): with an
    in-process engine served by vllm-kvq, its KV cache's written part (vllm_kvq.hugepages)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f
                         if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


# --- scoring ------------------------------------------------------------------------------
def _kl_topk(p_top, q_top) -> float:
    """KL(P||Q) over P's top-k tokens plus one bucket for the rest of the vocabulary; a
    token missing from Q's top-k gets Q's smallest listed probability (an upper bound).
    Coarse-graining can only lower KL, so this never overstates the divergence much."""
    q = dict(q_top)
    q_floor = min(q.values())
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for tok, lp in p_top:
        lq = q.get(tok, q_floor)
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_mass += p
        q_mass += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_mass, 1e-12), max(1.0 - q_mass, 1e-12)
    return max(kl + p_rest * math.log(p_rest / q_rest), 0.0)


def compare_runs(base: dict, other: dict) -> dict:
    n = confident = agree = agree_confident = 0
    lp_base = lp_other = kl = 0.0
    for wb, wo in zip(base["prompt"], other["prompt"], strict=True):
        for rb, ro in zip(wb, wo, strict=True):
            n += 1
            lp_base += rb["token_lp"]
            lp_other += ro["token_lp"]
            same = rb["top"][0][0] == ro["top"][0][0]
            agree += same
            if rb["top"][0][1] - rb["top"][1][1] >= CONFIDENT_NATS:
                confident += 1
                agree_confident += same
            kl += _kl_topk(rb["top"], ro["top"])
    ppl_base, ppl_other = math.exp(-lp_base / n), math.exp(-lp_other / n)
    # None where either run generated no greedy tokens
    greedy_same = (sum(a == b for a, b in zip(base["greedy"], other["greedy"]))
                   if base["greedy"] and other["greedy"] else None)
    return {
        "positions": n,
        "ppl_base": ppl_base,
        "ppl": ppl_other,
        "ppl_change": ppl_other / ppl_base - 1.0,
        "agreement": agree / n,
        "confident_positions": confident,
        "agreement_confident": agree_confident / max(confident, 1),
        "mean_kl": kl / n,
        "greedy_identical": None if greedy_same is None else greedy_same / len(base["greedy"]),
        "capacity_ratio": other["capacity_tokens"] / base["capacity_tokens"],
    }


def default_windows(model: str, n_windows: int = 4, window: int = 1024, seed: int = 0):
    return default_inputs(model, n_windows, window, seed)["windows"]


def default_inputs(model: str, n_windows: int = 4, window: int = 1024, seed: int = 0) -> dict:
    """The quality windows and GREEDY_PROMPTS as token ids ({"windows", "greedy"}), with one
    tokenizer load; prompt dicts of ids, as vLLM takes them without a tokenizer."""
    from transformers import AutoTokenizer

    from vllm_kvq.tools.corpus import token_windows

    tok = AutoTokenizer.from_pretrained(model)
    # vLLM's own encoding of a text prompt: special tokens added (Gemma 3's <bos>)
    greedy_ids = [{"prompt_token_ids": tok.encode(p, add_special_tokens=True)}
                  for p in GREEDY_PROMPTS]
    return {"windows": token_windows(tok, n_windows, window, seed), "greedy": greedy_ids}


def main(argv=None) -> int:
    from vllm_kvq.model_prep import ensure_default_model

    p = argparse.ArgumentParser(description="measure one KV-cache method through vLLM")
    p.add_argument("--method", required=True,
                   help="kvq method name, a JSON kvq config, or vllm / vllm-fp8")
    p.add_argument("--model", default=None)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--kv-budget", type=int, default=256 << 20)
    p.add_argument("--extra", default="{}", help="JSON of extra vllm.LLM arguments")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model = args.model or str(ensure_default_model(verbose=False))
    method = json.loads(args.method) if args.method.startswith("{") else args.method
    inputs = default_inputs(model, args.windows, args.window)
    run = run_method(method, model, inputs["windows"], args.kv_budget,
                     greedy_prompts=inputs["greedy"], **json.loads(args.extra))
    Path(args.out).write_text(json.dumps(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
