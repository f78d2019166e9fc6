"""Experiment (session 32, not a format): keys with static per-channel ranges measured on
calibration text (min/max, or --pct quantiles; KVQuant's per-channel keys without a window),
int<kbits> codes + --kslots exact (fp16) slots per token at the largest errors; values
through --vfmt's fake_quantize (bf16: exact). transformers, SmolLM2 fp32, 8 x 1024 held-out
tokens; prints Δppl and KL like ../session25-sink/harness.py.

    python reports/rotation/values-only/static_keys.py --kbits 4 --kslots 1 --vfmt bf16"""
import argparse, math, time, torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from vllm_kvq import reference as ref, rotation
from vllm_kvq.formats import parse_format
from vllm_kvq.model_prep import default_model_dir
from vllm_kvq.tools.corpus import held_out_windows, calibration_windows

ap = argparse.ArgumentParser()
ap.add_argument("--kbits", type=int, default=4)
ap.add_argument("--kslots", type=int, default=1)
ap.add_argument("--pct", type=float, default=0.0)
ap.add_argument("--vfmt", default="int4_token_rot")
ap.add_argument("--krot", action="store_true")
ap.add_argument("--windows", type=int, default=8)
ap.add_argument("--cal", type=int, default=4)
a = ap.parse_args()
torch.set_num_threads(2)
vfmt = parse_format(a.vfmt)
state = {"mode": "exact", "keys": {}, "lo": {}, "hi": {}}

def kq(layer, x):  # x [1,H,T,D]
    if a.krot: x = rotation.rotate(x.float())
    lo, hi = state["lo"][layer], state["hi"][layer]  # [H, D]
    n = 2 ** a.kbits - 1
    s = ((hi - lo) / n).clamp(min=1e-8)
    c = ((x - lo[None, :, None]) / s[None, :, None]).round().clamp(0, n)
    d = lo[None, :, None] + c * s[None, :, None]
    if a.kslots:
        err = (x - d).abs()
        idx = err.topk(a.kslots, -1).indices
        d = d.scatter(-1, idx, x.gather(-1, idx).half().float())
    return rotation.unrotate(d) if a.krot else d

def vq(x):
    if vfmt.rotation != "none": x = rotation.rotate(x.float())
    y = torch.stack([ref.fake_quantize(x[0, h], vfmt.value) for h in range(x.shape[1])])[None]
    return rotation.unrotate(y) if vfmt.rotation != "none" else y

def attention(module, query, key, value, attention_mask, scaling=None, **kw):
    layer = module.layer_idx
    if state["mode"] == "stats":
        k = rotation.rotate(key.float()) if a.krot else key.float()
        state["keys"].setdefault(layer, []).append(k[0].transpose(0, 1).reshape(-1, k.shape[1], k.shape[3]))
    if state["mode"] == "quant":
        key, value = kq(layer, key), vq(value)
    g = query.shape[1] // key.shape[1]
    T = query.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ke, ve = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    p = torch.softmax((query @ ke.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf")), -1)
    return (p @ ve).transpose(1, 2).contiguous(), None

AttentionInterface.register("kvq_static", attention)
md = default_model_dir()
tok = AutoTokenizer.from_pretrained(md)
model = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32, attn_implementation="kvq_static").eval()
state["mode"] = "stats"
with torch.no_grad():
    for ids in calibration_windows(tok, a.cal, 1024)[0]:
        model(input_ids=torch.tensor([ids]))
for layer, ks in state["keys"].items():
    k = torch.cat(ks)  # [N, H, D]
    if a.pct > 0:
        state["lo"][layer] = torch.quantile(k, a.pct, dim=0)
        state["hi"][layer] = torch.quantile(k, 1 - a.pct, dim=0)
    else:
        state["lo"][layer], state["hi"][layer] = k.amin(0), k.amax(0)
state["keys"] = {}
t0 = time.time(); nll = base_nll = kl = 0.0; n = 0
for ids in held_out_windows(tok, a.windows, 1024):
    x = torch.tensor([ids]); tgt = x[0, 1:, None]
    with torch.no_grad():
        state["mode"] = "exact"
        base = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        state["mode"] = "quant"
        lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    nll -= float(lp.gather(1, tgt).sum()); base_nll -= float(base.gather(1, tgt).sum())
    kl += float((base.exp() * (base - lp)).sum()); n += len(tgt)
print(f"static K int{a.kbits} slots={a.kslots} pct={a.pct} krot={a.krot} V={a.vfmt}: dppl {100*(math.exp((nll-base_nll)/n)-1):+6.2f}%  KL {kl/n:.4f} ({time.time()-t0:.0f} s)", flush=True)
