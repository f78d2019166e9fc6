"""Weighted 1-D k-means (Lloyd, started from the globally optimal partition of a coarse
version of the points): the codebook fit of `vllm-kvq calibrate`."""
from __future__ import annotations

import math

import numpy as np
import torch


def _nearest(x, levels):
    """Index of the nearest level for each x (levels ascending; ties go up)."""
    return np.searchsorted((levels[1:] + levels[:-1]) / 2, x, side="right")


def _lloyd(x, cw, cwx, levels, iters: int, tol: float):
    """Lloyd's iterations on sorted x: each cluster is a run of x, so its weight and weighted
    sum are differences of the prefix sums cw, cwx (length len(x)+1)."""
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

