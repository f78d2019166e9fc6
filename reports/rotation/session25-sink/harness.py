"""Teacher-forced quality of a format's quantize-dequantize outside the engine, with the
residual window and an optional attention sink emulated (session 25's measurements).

transformers, SmolLM2 in float32, held-out windows (vllm_kvq.tools.corpus), every layer's
K and V through vllm_kvq.reference.fake_quantize (the kernels' rules; nuq: the shipped
calibration, or Lloyd-Max levels for _lm; rotated formats (_rot, _rotv) quantize x R and
attend with its dequantization rotated back, which equals rotating the query and the output). Query p sees position j exactly when j >= floor((p+1)/R)*R (the residual
window, as the kernels read staging) or j < sink (the first tokens kept in full precision,
or in sink_dtype); every other key and value is the quantized one. Per-channel groups are
aligned to position 0, as in the pages.

    python reports/rotation/session25-sink/harness.py nuq2 --residual 32 --sink 1
    python reports/rotation/session25-sink/harness.py nuq2 --side k   # keys only

Prints Δppl and mean KL(bf16 cache || quantized) over the windows' next-token
distributions, both against the same model with the exact cache.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_kvq import reference as ref
from vllm_kvq import rotation
from vllm_kvq.codebook_file import SHIPPED_DIR, load_calibration
from vllm_kvq.formats import Codec, parse_format
from vllm_kvq.model_prep import default_model_dir
from vllm_kvq.tools.corpus import held_out_windows

SINK_CODECS = {"bf16": None, "int8": Codec("int", 8, "token")}


class Emulation:
    def __init__(self, fmt, cal, residual: int, sink: int, sink_dtype: str, side: str,
                 exclude_sink: bool):
        self.fmt, self.cal, self.R, self.sink = fmt, cal, residual, sink  # cal: set once loaded
        self.sink_codec = SINK_CODECS[sink_dtype]
        self.sides = {"k", "v"} if side == "kv" else {side}
        self.exclude_sink = exclude_sink
        self.exact = False  # True: the unquantized reference run

    def levels(self, layer, side, codec):
        if codec.encoding != "nuq":
            return None
        gran = {"channel": f"channel{codec.group}", "group": f"group{codec.group}"}.get(
            codec.granularity, codec.granularity)
        return self.cal.levels(layer, side, codec.bits, gran)

    def quantize(self, layer, x, side):  # x [1, H, T, D]
        codec = self.fmt.key if side == "k" else self.fmt.value
        if side not in self.sides:
            return x
        if self.sink and self.exclude_sink:  # the sink rows left out of their groups' scales
            x = x.clone()
            x[:, :, :self.sink] = x[:, :, self.sink:self.sink + 1]
        lv = self.levels(layer, side, codec)
        if self.fmt.codebook == "gaussian" and codec.encoding == "nuq":
            from vllm_kvq.gaussian_codebook import codec_levels
            lv = codec_levels(codec, x.shape[-1])
        # rotated formats: quantize x R, attend with (x R)^ R^T (as rotating q and the output)
        rot = self.fmt.rotation != "none" and (side == "v" or
                                               rotation.rotates_keys(self.fmt.rotation))
        if rot:
            x = rotation.rotate(x.float())
        y = torch.stack([ref.fake_quantize(x[0, h], codec, levels=lv)
                         for h in range(x.shape[1])])[None]
        return rotation.unrotate(y) if rot else y

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        T = query.shape[2]
        g = query.shape[1] // key.shape[1]
        pos = torch.arange(T)
        causal = pos[None, :] <= pos[:, None]
        if self.exact:
            kq, vq, exact = key, value, torch.ones(T, T, dtype=torch.bool)
        else:
            layer = module.layer_idx
            kq, vq = self.quantize(layer, key, "k"), self.quantize(layer, value, "v")
            exact = (pos[None, :] >= ((pos + 1) // self.R * self.R)[:, None]) | \
                    (pos[None, :] < self.sink)
            if self.sink and self.sink_codec is not None:
                key, value = key.clone(), value.clone()
                for x in (key, value):
                    for h in range(x.shape[1]):
                        x[0, h, :self.sink] = ref.fake_quantize(x[0, h, :self.sink],
                                                                self.sink_codec)
        ke, ve, kq, vq = (t.repeat_interleave(g, 1) for t in (key, value, kq, vq))
        s = torch.where(exact, query @ ke.transpose(-1, -2), query @ kq.transpose(-1, -2))
        p = torch.softmax((s * scaling).masked_fill(~causal, float("-inf")), -1)
        pe = p * exact
        return (pe @ ve + (p - pe) @ vq).transpose(1, 2).contiguous(), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("format")
    ap.add_argument("--residual", type=int, default=None,
                    help="window chunk R (default: the format's; 1 = no window)")
    ap.add_argument("--sink", type=int, default=0, help="first tokens kept exact")
    ap.add_argument("--sink-dtype", choices=sorted(SINK_CODECS), default="bf16")
    ap.add_argument("--exclude-sink", action="store_true",
                    help="leave the sink tokens out of their groups' scales")
    ap.add_argument("--side", choices=("kv", "k", "v"), default="kv")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    a = ap.parse_args()
    torch.set_num_threads(2)
    fmt = parse_format(a.format)
    R = a.residual if a.residual is not None else max(fmt.residual_chunk, 1)
    md = default_model_dir()
    tok = AutoTokenizer.from_pretrained(md)
    emu = Emulation(fmt, None, R, a.sink, a.sink_dtype, a.side, a.exclude_sink)
    AttentionInterface.register("kvq_emulation", emu.attention)
    model = AutoModelForCausalLM.from_pretrained(
        md, dtype=torch.float32, attn_implementation="kvq_emulation").eval()
    c = model.config
    emu.cal = load_calibration(next(SHIPPED_DIR.glob("SmolLM2*")),
                               num_layers=c.num_hidden_layers,
                               num_kv_heads=c.num_key_value_heads,
                               head_dim=c.hidden_size // c.num_attention_heads)
    t0 = time.time()
    nll = base_nll = kl = 0.0
    n = 0
    for ids in held_out_windows(tok, a.windows, a.window):
        x = torch.tensor([ids])
        tgt = x[0, 1:, None]
        with torch.no_grad():
            emu.exact = True
            base = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
            emu.exact = False
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        nll -= float(lp.gather(1, tgt).sum())
        base_nll -= float(base.gather(1, tgt).sum())
        kl += float((base.exp() * (base - lp)).sum())
        n += len(tgt)
    label = (f"{a.format} side={a.side} R={R} sink={a.sink}"
             + (f" {a.sink_dtype}" if a.sink else "") + (" excl" if a.exclude_sink else ""))
    print(f"{label:48s} dppl {100 * (math.exp((nll - base_nll) / n) - 1):+6.2f}%  "
          f"KL {kl / n:.4f}  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
