"""Calibration-free nuq codebooks: Lloyd-Max levels for rotated (near-Gaussian) values.

After a Hadamard rotation (vllm_kvq.rotation) the coordinates of a key or value are close
to Gaussian whatever the model, so the codebook that minimizes the squared error of a
Gaussian, as the nuq quantizer sees it, needs no data: a scale group of n values is
normalized by its own range, y = (x - (max + min) / 2) / ((max - min) / 2) in [-1, 1]
(reference.quantize_groups), and each y goes to the nearest level. The levels here are the
Lloyd-Max (1-D k-means) fixed point of that y for n iid standard normal values, computed
once per (bits, n) from a fixed seed, so every process and machine gets the same
codebook. n is the codec's group: head_dim for per-token, g for per-group, G tokens for
per-channel scales. Outlier slots are not modelled (they take the largest |x| of a token
out of its range; the levels are then slightly too wide).

Chosen per format with the `_lm` suffix (e.g. nuq3_lm_rot): no `vllm-kvq calibrate` run and
no calibration file.
"""
from __future__ import annotations

from functools import lru_cache

import torch

SEED = 0x11D4A
SAMPLES = 1 << 21   # normal values drawn per (bits, n)
BINS = 1 << 14      # Lloyd iterates on a histogram of y (symmetrized: y and -y)
ITERATIONS = 200


@lru_cache(maxsize=None)
def _levels(bits: int, n: int) -> tuple[float, ...]:
    gen = torch.Generator().manual_seed(SEED + 1000 * bits + n)
    x = torch.randn(max(1, SAMPLES // n), n, generator=gen, dtype=torch.float64)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    y = ((x - (hi + lo) / 2) / ((hi - lo) / 2)).flatten()
    y = torch.cat([y, -y])  # the distribution is symmetric: so are its levels
    w = torch.histc(y, bins=BINS, min=-1.0, max=1.0)
    c = torch.linspace(-1 + 1 / BINS, 1 - 1 / BINS, BINS, dtype=torch.float64)
    k = 2 ** bits
    cdf = torch.cumsum(w, 0) / w.sum()
    lv = c[torch.searchsorted(cdf, (torch.arange(k, dtype=torch.float64) + 0.5) / k)]
    for _ in range(ITERATIONS):
        idx = torch.bucketize(c, (lv[1:] + lv[:-1]) / 2)
        cnt = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, w)
        sums = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, w * c)
        lv = torch.where(cnt > 0, sums / cnt.clamp(min=1e-300), lv)
    return tuple(lv.clamp(-1, 1).tolist())


def lloyd_max_levels(bits: int, n: int) -> torch.Tensor:
    """float32 [2^bits], ascending in [-1, 1]: the codebook of a range-normalized group of n
    standard normal values."""
    if bits not in (2, 3, 4) or n < 2:
        raise ValueError(f"Lloyd-Max levels need bits in (2, 3, 4) and a group of >= 2 "
                         f"values, got bits={bits}, n={n}")
    return torch.tensor(_levels(bits, n), dtype=torch.float32)


def codec_levels(codec, head_dim: int) -> torch.Tensor | None:
    """The levels of a nuq codec (None for other codecs): its group is head_dim values for
    per-token scales, else the codec's group (channels, or tokens for per-channel)."""
    if codec.encoding != "nuq":
        return None
    n = head_dim if codec.granularity == "token" else codec.group
    return lloyd_max_levels(codec.bits, n)
