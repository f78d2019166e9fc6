"""Scores of one method's run against the baseline's: teacher-forced quality
(evaluate.compare_runs) plus greedy agreement and a verdict, passkey accuracy, speed
ratios."""
from __future__ import annotations

from vllm_kvq.tools.evaluate import compare_runs


# Verdicts on the teacher-forced comparison with our bf16 cache. "broken": the model no
# longer predicts its own top-1 token on most positions (a cache that stores garbage lands
# here, see tests/test_compare_engines.py); the other bands are descriptive, by mean KL.
BROKEN_AGREEMENT = 0.5
BANDS = [(0.005, "near-lossless"), (0.05, "small loss"), (0.3, "lossy")]


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
