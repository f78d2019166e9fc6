"""Codebooks measured on held-out text (`vllm-kvq calibrate --eval-windows N`): teacher-
forced loss and KL against the unquantized cache with every layer's K and V replaced by
their quantize-dequantize, for Fisher-weighted, unweighted and uniform levels."""
from __future__ import annotations

import math
import sys

import torch

from vllm_kvq.codebook_file import Calibration
from vllm_kvq.reference import uniform_levels
from vllm_kvq.tools.calibrate.hooks import set_hook
from vllm_kvq.tools.calibrate.normalize import one_thread, quantize_dequantize


@torch.no_grad()
def evaluate(model, windows: list[list[int]], cal: Calibration, configs: list[dict],
             progress: bool = True) -> list[dict]:
    """Teacher-forced LM loss and KL(fp || quantized) of next-token distributions with
    every layer's K and V replaced by their quantize-dequantize. configs: dicts with bits,
    k (granularity), v (granularity), levels ("fisher", "unweighted" or "uniform")."""
    from tqdm import tqdm

    def levels_for(c, layer, side):
        if c["levels"] == "uniform":
            return uniform_levels(c["bits"])
        return cal.levels(layer, side, c["bits"], c[side], weighting=c["levels"])

    sums = [{"nll": 0.0, "kl": 0.0} for _ in configs]
    base_nll, n_pos = 0.0, 0
    bar = tqdm(total=len(windows) * (len(configs) + 1), desc="evaluate", unit="run",
               disable=not progress, file=sys.stderr)
    for ids in windows:
        x = torch.tensor([ids])
        tgt = x[0, 1:]
        with set_hook(None):
            base = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        bar.update()
        base_nll += float(-base.gather(1, tgt[:, None]).sum())
        n_pos += len(tgt)
        for c, s in zip(configs, sums):
            def hook(layer, k, v, c=c):
                with one_thread():
                    return (quantize_dequantize(k, levels_for(c, layer, "k"), c["k"]),
                            quantize_dequantize(v, levels_for(c, layer, "v"), c["v"]))

            with set_hook(hook):
                lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
            s["nll"] += float(-lp.gather(1, tgt[:, None]).sum())
            s["kl"] += float((base.exp() * (base - lp)).sum())
            bar.update()
    bar.close()
    ppl0 = math.exp(base_nll / n_pos)
    rows = [{"bits": None, "k": "-", "v": "-", "levels": "none (fp32 cache)", "ppl": ppl0,
             "ppl_change": 0.0, "mean_kl": 0.0}]
    for c, s in zip(configs, sums):
        ppl = math.exp(s["nll"] / n_pos)
        rows.append(dict(c, ppl=ppl, ppl_change=ppl / ppl0 - 1, mean_kl=s["kl"] / n_pos))
    return rows


EVAL_CONFIGS = [dict(bits=b, k=k, v=v, levels=lv)
                for b, k, v in [(3, "token", "token"), (3, "channel32", "token"),
                                (3, "group32", "group32"), (3, "token_o1", "token_o1"),
                                (2, "channel32", "token"), (4, "channel32", "token")]
                for lv in ("uniform", "unweighted", "fisher")]


def evaluation_markdown(rows: list[dict], windows: int, window: int) -> str:
    lines = [f"Held-out text: {windows} x {window} tokens (corpus.held_out_windows, speeches "
             f"from 1990 on; the calibration used earlier speeches). Teacher-forced, every "
             f"layer's K and V replaced by their quantize-dequantize (no full-precision window); "
             f"KL(fp32 cache || quantized) per position.", "",
             "| bits | keys | values | levels | ppl | ppl change | mean KL |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bits'] or '-'} | {r['k']} | {r['v']} | {r['levels']} | "
                     f"{r['ppl']:.4f} | {100 * r['ppl_change']:+.2f}% | {r['mean_kl']:.5f} |")
    return "\n".join(lines) + "\n"

