"""Normalization exactly as the nuq quantizer does it at serve time: the one definition of
"(x - zero) / scale in the codec's scale groups, outliers left out" for calibration and
benchmarks/nuq_measure.py.

Per scale group of a granularity -- "token": one head vector (head_dim values of one token
and kv head); "group<g>": g consecutive channels of one token; "channel<G>": one channel
over G consecutive tokens of one kv head, groups aligned to multiples of G from position 0
-- lo = min, hi = max, zero = (hi+lo)/2, scale = (hi-lo)/2, x_norm = (x-zero)/scale in
[-1, 1]; groups with hi == lo store no levels (left out). With outliers (`_o<c>`), the c
largest-|x| finite values of each head vector (the kernels' rule,
reference.select_outliers) are left out of min/max and come back as they were here (the
served slots hold an fp16 correction: within 2^-10 |x|). Non-finite values are left out
too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from vllm_kvq.codebook_file import CalibrationError

_GRAN_RE = re.compile(r"^(token|group(\d+)|channel(\d+))(?:_o(\d+))?$")


@dataclass(frozen=True)
class Granularity:
    name: str
    kind: str          # token | group | channel
    size: int          # channels (group) or tokens (channel) per scale group; 0 for token
    outliers: int = 0  # largest-|x| values per head vector kept out of the levels


def parse_granularity(name: str) -> Granularity:
    """A calibration file's granularity name (outliers are fitted for token groups only)."""
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


def codec_granularity(codec) -> Granularity:
    """The scale groups of a nuq/int formats.Codec (any granularity may have outliers)."""
    name = codec.gran_name + (f"_o{codec.outliers}" if codec.outliers else "")
    return Granularity(name, codec.granularity, codec.group, codec.outliers)


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


def outlier_mask(x: torch.Tensor, n: int) -> torch.Tensor:
    """True at the n largest-|x| finite values of each head vector of x [..., D]."""
    from vllm_kvq.reference import select_outliers

    D = x.shape[-1]
    chans = select_outliers(x.reshape(-1, D), n)
    mask = torch.zeros(chans.shape[0], D + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(chans >= 0, chans, D), True)  # empty slots: column D
    return mask[:, :D].reshape(x.shape)


def normalize(x: torch.Tensor, g: Granularity, fp16_stats: bool = False):
    """x [B, H, T, D] -> (x_norm, zero, scale, valid), grouped as to_groups(x, g). `valid`
    is False for values left out: outliers, non-finite values and groups with hi == lo.
    fp16_stats: scale and zero rounded through fp16 first, as the cache stores them."""
    valid = torch.isfinite(x)
    if g.outliers:
        valid &= ~outlier_mask(x, g.outliers)
    xg, valid = to_groups(x, g), to_groups(valid, g)
    lo = torch.where(valid, xg, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(valid, xg, -torch.inf).amax(-1, keepdim=True)
    zero = (hi + lo) / 2
    scale = (hi - lo) / 2
    if fp16_stats:
        from vllm_kvq.reference import _fp16_round
        zero, scale = _fp16_round(zero).to(x.dtype), _fp16_round(scale).to(x.dtype)
    ok = scale > 0
    valid = valid & ok
    xn = torch.where(valid, (xg - zero) / torch.where(ok, scale, 1.0), 0.0).clamp(-1, 1)
    return xn, zero, scale, valid


def quantize_dequantize(x: torch.Tensor, levels: torch.Tensor, granularity: str) -> torch.Tensor:
    """x [B, H, T, D] through the nuq quantizer with `levels` (nearest level per value);
    constant groups, outliers and a partial channel tail come back exact."""
    g = parse_granularity(granularity)
    xn, zero, scale, valid = normalize(x, g)
    lv = levels.to(x.dtype)
    mids = (lv[1:] + lv[:-1]) / 2
    q = lv[torch.bucketize(xn.contiguous(), mids)]
    out = torch.where(valid, q * scale + zero, to_groups(x, g))
    return from_groups(out, g, x)


class one_thread:
    """Elementwise work on ~10^5 values: one thread. With two OpenMP threads on a busy
    machine every small op waits milliseconds for the other thread."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
