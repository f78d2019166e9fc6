"""report.md: memory, quality (or passkey), whole-engine speed and kernel-alone tables."""
from __future__ import annotations

from pathlib import Path

from vllm_kvq.tools.compare.inputs import GREEDY_TEXT_PROMPT
from vllm_kvq.tools.compare.scoring import BROKEN_AGREEMENT


def _f(x, fmt="{:.3g}", none="–"):
    return none if x is None else fmt.format(x)


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else (
        f"{n / 1000:g}k" if n >= 1000 else str(n))


def table(head: list[str], body: list[list[str]]) -> list[str]:
    """Markdown table lines: the first column left-aligned, the others right-aligned."""
    return (["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
            + ["| " + " | ".join(row) + " |" for row in body])


def _decodes(r: dict, ctxs: list[int]):
    """(context, decode measurement, that context's ratios to bf16) in table order."""
    sp = {x["context"]: x for x in r["speed"]}
    ratio = {x["context"]: x for x in r.get("speed_ratio", [])}
    return [(c, d, ratio.get(c, {})) for c in ctxs
            for d in sorted(sp[c]["decode"], key=lambda d: d["batch"])]


def _tok_s_cells(r: dict, ctxs: list[int], bs: list[int]) -> list[str]:
    """Prefill tokens/s per context, then decode tokens/s per context and batch, each with
    its ratio to bf16."""
    sp = {x["context"]: x for x in r["speed"]}
    ratio = {x["context"]: x for x in r.get("speed_ratio", [])}
    cells = [f"{sp[c]['prefill_tok_s']:.0f} ({_f(ratio.get(c, {}).get('prefill'), '{:.2f}')})"
             for c in ctxs]
    for c in ctxs:
        dd = {d["batch"]: d for d in sp[c]["decode"]}
        cells += [f"{dd[b]['decode_tok_s']:.1f} "
                  f"({_f(ratio.get(c, {}).get('decode', {}).get(str(b)), '{:.2f}')})" for b in bs]
    return cells


def _vs_vllm(ms: float, vllm_ms: float | None) -> str:
    return f"{ms:.3f}" + (f" ({vllm_ms / ms:.2f})" if vllm_ms else "")


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
             "× smaller than bf16 | window KiB per running seq | capacity (tokens) | "
             "capacity × bf16 |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = "unavailable" if r.get("unavailable") else _f(r.get("capacity_tokens"), "{:,}")
        L.append(f"| `{r['method']}` | {r['format']} | {r['bytes_per_token_head']:g} | "
                 f"{r['bytes_per_token_model'] / 1024:.2f} | {r['bits_per_value']:.2f} | "
                 f"{r['ratio_vs_bf16']:.2f} | {r.get('window_bytes_per_seq', 0) / 1024:,.0f} | "
                 f"{cap} | {_f(r.get('capacity_ratio'), '{:.2f}')} |")
    L.append("\nBytes per token include scales, zero-points and padding (csrc/kvq_layout.h). "
             "The residual window (recent tokens kept in full precision, 16-bit) takes "
             "whole blocks of vLLM's pool per running sequence, only while it runs; capacity "
             "counts all of the pool's blocks.\n")

    pk_lens = plan["passkey_lengths"]
    pk_text = ("Passkey: a 5-digit key at seeded depths ("
               + ", ".join(f"{plan.get('passkey_counts', {}).get(str(n), plan['passkey_positions'])}"
                           f" at {ctx_label(n)}" for n in pk_lens)
               + f") in {plan['passkey_filler']} filler; accuracy of the first number "
               f"generated.")
    has_q = any(r.get("quality") for r in rows)
    if not has_q and any(r.get("passkey") for r in rows):
        L.append("## Passkey\n")
        L += table(["method"] + [f"passkey {ctx_label(n)}" for n in pk_lens],
                   [[f"`{r['method']}`"] + [
                       "unavailable" if r.get("unavailable")
                       else _f((r.get("passkey") or {}).get(str(n)), "{:.2f}") for n in pk_lens]
                    for r in rows])
        L.append("\n" + pk_text + "\n")
    if has_q:
        L.append("## Quality\n")
        L.append("| method | ppl | Δppl | mean KL (nats) | top-1 agree | agree (confident) | "
                 "greedy tokens agree | greedy prompts identical | "
                 + " | ".join(f"passkey {ctx_label(n)}" for n in pk_lens) + " | verdict |")
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
        speed_rows = [r for r in rows if r.get("speed")]
        per_batch = [f"b={b} @ {ctx_label(c)}" for c in ctxs for b in bs]
        L += table(["method"] + [f"prefill {ctx_label(c)}" for c in ctxs]
                   + [f"decode {h}" for h in per_batch],
                   [[f"`{r['method']}`"] + _tok_s_cells(r, ctxs, bs) for r in speed_rows])
        L.append("\nTime per output token (ms), per sequence:\n")
        L += table(["method"] + per_batch,
                   [[f"`{r['method']}`"] + [f"{d['tpot_ms']:.1f}" for _, d, _ in _decodes(r, ctxs)]
                    for r in speed_rows])
        if engine_timing:
            L.append("\nCPU time per decode step (ms, all of the engine's processes; unlike "
                     "wall time it does not grow while other jobs hold the CPU) and, in "
                     "brackets, bf16's CPU time / this method's (> 1: cheaper):\n")
            L += table(["method"] + per_batch,
                       [[f"`{r['method']}`"] + [
                           f"{_f(d.get('cpu_ms_per_step'), '{:.1f}')} "
                           f"({_f(rr.get('decode_cpu', {}).get(str(d['batch'])), '{:.2f}')})"
                           for _, d, rr in _decodes(r, ctxs)] for r in speed_rows])
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
        L += table(["kernel"] + [f"b={b} @ {ctx_label(c)}" for b, c in cols],
                   [["vLLM bf16 op" if n == "vllm" else f"`{n}`"]
                    + [_vs_vllm(r["ms"][n], r["ms"].get("vllm")) for r in k["rows"]]
                    for n in names])
        L.append("")
    if result.get("failures"):
        L.append("## Unavailable\n")
        for m, e in result["failures"].items():
            L.append(f"- `{m}`: {e}")
        L.append("")
    return "\n".join(L)
