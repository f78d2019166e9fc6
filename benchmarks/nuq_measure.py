"""Reference-level measurement of nuq (codebook) and outlier formats on SmolLM2-135M (issue 5).

For each format: bytes per token per kv head (K+V, from the layout at block size 128), the
relative RMSE of keys and values, and the teacher-forced KL(fp32 cache || quantized cache)
and perplexity change of next-token distributions on held-out text, with every layer's K
and V passed through vllm_kvq.reference.fake_quantize -- the exact rules the kernels
implement (fp16 scales, outlier slots, codebooks). A residual window R is modelled exactly:
a query at position p reads positions >= floor((p+1)/R)*R in full precision.

Codebooks are fitted here, per layer and side, on K/V captured from calibration text
(State of the Union speeches 1946-1989, disjoint from the held-out windows): "quantile"
(levels at evenly spaced quantiles of the normalized values, ends at +-1) or "kmeans"
(1-D Lloyd from the quantiles, unweighted), "kmeans_pinned" (ends kept at +-1), or "fisher":
the shipped calibration of `vllm-kvq calibrate` (Fisher-weighted k-means), looked up as the
backend does (vllm_kvq.config).

    python benchmarks/nuq_measure.py [--train 4] [--eval 4] [--window 512]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from vllm_kvq import reference as ref
from vllm_kvq.formats import Codec, KVFormat, parse_format
from vllm_kvq.tools.calibrate.normalize import codec_granularity, normalize

# --- the model with a quantizing attention --------------------------------------------------
STATE: dict = {"mode": None}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Causal attention over the cache's K (post-RoPE) and V, [B, H_kv, T, D]."""
    layer = module.layer_idx
    mode = STATE["mode"]
    if mode == "capture":
        STATE["kv"].setdefault(layer, []).append((key[0].detach().clone(), value[0].detach().clone()))
    T = query.shape[2]
    kq, vq = key, value
    R = 1
    if mode == "quant":
        fmt = STATE["fmt"]
        kl, vl = STATE["levels"][layer]
        kq = _quantize(key, fmt.key, kl)
        vq = _quantize(value, fmt.value, vl)
        R = fmt.residual_chunk
        for side, a, b, c in (("k", key, kq, fmt.key), ("v", value, vq, fmt.value)):
            s = STATE["err"].setdefault(side, [0.0, 0.0])
            s[0] += float((a - b).pow(2).sum())
            s[1] += float(a.pow(2).sum())
            # values above this layer's 1% |x| threshold that found no outlier slot
            thr = STATE["thresholds"][layer][side]
            o = STATE["err"].setdefault("over", [0, 0])
            o[0] += sum(ref.outlier_overflow(a[0, h].float(), c.outliers, thr)
                        for h in range(a.shape[1]))
            o[1] += int((a.abs() > thr).sum())
    g = query.shape[1] // key.shape[1]
    rep = (lambda t: t.repeat_interleave(g, dim=1)) if g > 1 else (lambda t: t)
    q = query * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]
    exact = pos[None, :] >= ((pos + 1) // R * R)[:, None]  # [T(query), T(key)]
    s_q = q @ rep(kq).transpose(-1, -2)
    s = torch.where(exact, q @ rep(key).transpose(-1, -2), s_q) if R > 1 else s_q
    s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s.float(), -1).to(q.dtype)
    out = (p * ~exact) @ rep(vq) + (p * exact) @ rep(value) if R > 1 else p @ rep(vq)
    return out.transpose(1, 2).contiguous(), None


def _quantize(x: torch.Tensor, codec: Codec, levels) -> torch.Tensor:
    """x [1, H, T, D] through the codec per head; per-channel codecs: whole groups only
    (the tail is in the full-precision window anyway)."""
    _, H, T, D = x.shape
    out = x.clone()
    n = T // codec.group * codec.group if codec.granularity == "channel" else T
    for h in range(H):
        out[0, h, :n] = ref.fake_quantize(x[0, h, :n].float(), codec, levels=levels).to(x.dtype)
    return out


def load_model(model_dir):
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register("kvq_measure", _attention)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="kvq_measure").eval()
    return m, AutoTokenizer.from_pretrained(model_dir)


# --- codebooks ---------------------------------------------------------------------------------
def normalized(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Normalized values (x - zero) / scale of x [T, D] in the codec's scale groups,
    outliers left out (as the quantizer computes them, fp16 scale and zero): the
    calibration's normalization (vllm_kvq.tools.calibrate.normalize), flattened."""
    xn, _, _, valid = normalize(x[None, None], codec_granularity(codec), fp16_stats=True)
    return xn[valid]


def fit_levels(xn: torch.Tensor, bits: int, method: str) -> torch.Tensor:
    """quantile | kmeans (Lloyd from the quantiles) | kmeans_pinned (ends kept at +-1,
    where every group's min and max land)."""
    n = 2 ** bits
    xn = xn[torch.randperm(len(xn), generator=torch.Generator().manual_seed(0))[:200_000]]
    xs = torch.sort(xn.double()).values
    q = xs[(torch.linspace(0, 1, n, dtype=torch.float64) * (len(xs) - 1)).long()]
    q[0], q[-1] = -1.0, 1.0
    if method.startswith("kmeans"):
        for _ in range(60):
            mids = (q[1:] + q[:-1]) / 2
            idx = torch.bucketize(xs, mids)
            sums = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, xs)
            cnt = torch.bincount(idx, minlength=n).double()
            q = torch.where(cnt > 0, sums / cnt.clamp(min=1), q)
            if method == "kmeans_pinned":
                q[0], q[-1] = -1.0, 1.0
    return torch.sort(q.clamp(-1, 1).float()).values


def parse_spec(name: str) -> KVFormat:
    """A format name, or KEYFMT+VALUEFMT: keys as in the first, values as in the second."""
    if "+" not in name:
        return parse_format(name)
    a, b = (parse_format(n) for n in name.split("+"))
    return KVFormat(name, a.key, b.value, max(a.residual_tokens, b.residual_tokens))


def fisher_levels(layer: int, side: str, codec: Codec) -> torch.Tensor:
    from vllm_kvq.codebook_file import default_calibration_path, read_calibration
    from vllm_kvq.config import _codebook
    from vllm_kvq.model_prep import default_model_dir
    if "cal" not in STATE:
        path = default_calibration_path(str(default_model_dir()))
        if path is None:
            raise SystemExit("no shipped calibration for the default model")
        STATE["cal"] = read_calibration(path)
    return _codebook(STATE["cal"], layer, side, codec, "none")  # this harness rotates nothing


# --- runs ----------------------------------------------------------------------------------------
def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=4, help="calibration windows")
    ap.add_argument("--eval", type=int, default=4, help="held-out windows")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--formats", default=None, help="comma list (default: the issue-5 set)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from vllm_kvq.model_prep import default_model_dir
    from vllm_kvq.tools.corpus import calibration_windows, held_out_windows

    t0 = time.time()
    model, tok = load_model(default_model_dir())
    train, _ = calibration_windows(tok, args.train, args.window, seed=0)
    evalw = held_out_windows(tok, args.eval, args.window, seed=0)
    STATE.update(mode="capture", kv={})
    for ids in train:
        logprobs(model, ids)
    L = len(STATE["kv"])
    train_kv = {l: (torch.cat([k for k, _ in v], 1), torch.cat([x for _, x in v], 1))
                for l, v in STATE["kv"].items()}  # [H, T, D]
    # |x| exceeded by 1% of a layer's keys (values) on the calibration text
    STATE["thresholds"] = {l: {s: float(torch.quantile(x.float().abs().reshape(-1)[::7], 0.99))
                               for s, x in zip("kv", train_kv[l])} for l in range(L)}
    STATE.update(mode=None)
    base = [logprobs(model, ids) for ids in evalw]
    print(f"# model loaded, {L} layers, captured {args.train}x{args.window} train tokens, "
          f"baseline on {args.eval}x{args.window} held-out tokens ({time.time() - t0:.0f}s)",
          file=sys.stderr)

    runs = []
    names = args.formats.split(",") if args.formats else [
        "int3_group32", "int4_token", "int4_group32", "int3_token_o1", "int4_token_o1",
        "nuq3_token:uniform", "nuq3_token:quantile", "nuq3_token:kmeans",
        "nuq3_token_o1:quantile", "nuq3_token_o1:kmeans", "nuq3_token_o2:kmeans",
        "nuq3_group32:kmeans", "nuq3_group32_o1:kmeans",
        "nuq3_channel32_r32:kmeans", "nuq3_channel32_o1_r32:kmeans",
        "nuq4_token_o1:kmeans", "nuq2_token_o1:kmeans"]
    cache: dict = {}
    for spec in names:
        name, _, method = spec.partition(":")
        fmt = parse_spec(name)
        levels = []
        for l in range(L):
            pair = []
            for c, x in ((fmt.key, train_kv[l][0]), (fmt.value, train_kv[l][1])):
                if c.encoding != "nuq":
                    pair.append(None)
                elif method == "uniform":
                    pair.append(ref.uniform_levels(c.bits))
                elif method == "fisher":
                    pair.append(fisher_levels(l, "k" if x is train_kv[l][0] else "v", c))
                else:
                    key = (l, x is train_kv[l][0], c.bits, c.granularity, c.group, c.outliers,
                           method)
                    if key not in cache:
                        xn = torch.cat([normalized(x[h].float(), c) for h in range(x.shape[0])])
                        cache[key] = fit_levels(xn, c.bits, method)
                    pair.append(cache[key])
            levels.append(tuple(pair))
        STATE.update(mode="quant", fmt=fmt, levels=levels, err={})
        nll = kl = 0.0
        npos = 0
        t1 = time.time()
        for ids, b in zip(evalw, base):
            lp = logprobs(model, ids)
            tgt = torch.tensor(ids[1:])
            nll += float(-lp.gather(1, tgt[:, None]).sum())
            kl += float((b.exp() * (b - lp)).sum())
            npos += len(tgt)
        base_nll = sum(float(-b.gather(1, torch.tensor(ids[1:])[:, None]).sum())
                       for ids, b in zip(evalw, base))
        err = STATE["err"]
        lay = fmt.layout(64, 128)
        over = err["over"][0] / max(1, err["over"][1])
        runs.append(dict(name=spec, bytes=lay.token_bytes, over=over,
                         rk=math.sqrt(err["k"][0] / err["k"][1]),
                         rv=math.sqrt(err["v"][0] / err["v"][1]),
                         kl=kl / npos, ppl=math.exp((nll - base_nll) / npos) - 1))
        r = runs[-1]
        print(f"{spec:34s} {r['bytes']:4d} B  relRMSE K {r['rk']:.4f} V {r['rv']:.4f}  "
              f"KL {r['kl']:.5f}  ppl {100 * r['ppl']:+.2f}%  overflow {100 * over:.0f}%  "
              f"({time.time() - t1:.0f}s)",
              file=sys.stderr)
    STATE.update(mode=None)

    print(f"\nSmolLM2-135M (fp32), {args.eval} x {args.window} held-out tokens; codebooks "
          f"fitted on {args.train} x {args.window} calibration tokens; bytes per token per kv "
          f"head (K+V, head_dim 64, block 128; residual window not counted). Overflow: of "
          f"the values above their layer's 1% |x| threshold, the share that found no outlier "
          f"slot (fell back to the dense path).\n")
    print("| format | levels | bytes | rel RMSE K | rel RMSE V | mean KL | ppl change | "
          "overflow |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        name, _, method = r["name"].partition(":")
        print(f"| {name} | {method or '-'} | {r['bytes']} | {r['rk']:.4f} | {r['rv']:.4f} | "
              f"{r['kl']:.5f} | {100 * r['ppl']:+.2f}% | {100 * r['over']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
