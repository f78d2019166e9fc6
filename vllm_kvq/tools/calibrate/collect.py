"""Calibration data: weighted histograms of normalized keys and values per (layer, side,
granularity, weighting) and the |x| tails per (layer, side), collected by forward and
backward passes of a hooked model (hooks.py); `Accumulator.fit` turns them into the
codebooks and outlier thresholds of a calibration file (vllm_kvq/codebook_file.py).

Sensitivity: the weight of an element is the squared gradient of the next-token LM loss
with respect to it (the Fisher diagonal, summed over the calibration sequences) times
scale^2, which turns it into normalized units. Codebooks are weighted 1-D k-means on a fine
histogram of the normalized values (4097 grid points on [-1, 1], both ends exact).
Unweighted codebooks are fitted and stored too, so the benefit of the weighting can be
measured (evaluate.py).

Rotated formats (`_rot`, `_rotv`) quantize x R, not x (vllm_kvq.rotation), whose normalized
values are distributed otherwise (a large channel spread over all of them), so each
codebook is fitted a second time on the rotated keys and values, weighted by the rotated
gradients (x R's gradient is g R: R is orthogonal), and stored with a `.hadamard` suffix.
"""
from __future__ import annotations

import datetime as _dt
import math
import sys

import torch

from vllm_kvq import rotation
from vllm_kvq.codebook_file import (CALIBRATION_VERSION, ROTATIONS, SIDES, WEIGHTINGS,
                                    Calibration, CalibrationError, levels_key)
from vllm_kvq.tools.calibrate.hooks import check_window, set_hook
from vllm_kvq.tools.calibrate.kmeans import weighted_kmeans_1d
from vllm_kvq.tools.calibrate.normalize import (normalize, one_thread, parse_granularity,
                                                to_groups)

BITS = (2, 3, 4)
GRANULARITIES = ("token", "group32", "channel32", "token_o1")
OUTLIER_FRACTIONS = (0.005, 0.01, 0.02, 0.05)
GRID = 4096  # histogram intervals on [-1, 1]
SENSITIVITY = ("fisher: squared gradient of the mean next-token cross-entropy of each "
               "sequence w.r.t. each post-RoPE key / value element, summed over sequences; "
               "weight in normalized units = grad^2 * scale^2")


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
    """Weighted histograms of normalized values per (layer, side, granularity, weighting,
    rotation) and the |x| tails per (layer, side). rotations: ("none", "hadamard") where the
    head size has a Hadamard rotation (rotation.HEAD_SIZES), else ("none",)."""

    def __init__(self, num_layers: int, granularities=GRANULARITIES,
                 fractions=OUTLIER_FRACTIONS, grid: int = GRID, rotations=ROTATIONS):
        self.num_layers, self.grid = num_layers, grid
        self.grans = [parse_granularity(g) for g in granularities]
        self.rotations = tuple(rotations)
        self.fractions = tuple(fractions)
        self.hist = {}
        self.tails = {(l, s): _TopAbs(max(fractions)) for l in range(num_layers) for s in SIDES}
        self.values = 0

    def add(self, layer: int, side: str, x: torch.Tensor, grad: torch.Tensor | None) -> None:
        """x, grad: [B, H, T, D] (grad None: unweighted only)."""
        with one_thread():
            self._add(layer, side, x, grad)

    def _add(self, layer, side, x, grad) -> None:
        x = x.detach().float()
        self.tails[(layer, side)].add(x)
        if side == "k" and layer == 0:
            self.values += x.numel()
        grad = None if grad is None else grad.detach().float()
        for rot in self.rotations:
            xr, gr = x, grad
            if rot == "hadamard":
                xr = rotation.rotate(x)
                gr = None if grad is None else rotation.rotate(grad)
            self._add_histograms(layer, side, rot, xr, None if gr is None else gr.square())

    def _add_histograms(self, layer, side, rot, x, g2) -> None:
        for g in self.grans:
            xn, _, scale, valid = normalize(x, g)
            idx = ((xn + 1) * (self.grid / 2)).round_().long().clamp_(0, self.grid)
            weights = {"unweighted": None}
            if g2 is not None:
                weights["fisher"] = to_groups(g2, g) * scale.square()
            if not bool(valid.all()):
                idx = idx[valid]
                weights = {k: (None if w is None else w[valid]) for k, w in weights.items()}
            idx = idx.flatten()
            for wname, w in weights.items():
                key = (layer, side, g.name, wname, rot)
                h = torch.bincount(idx, weights=None if w is None else w.flatten().double(),
                                   minlength=self.grid + 1).double()
                self.hist[key] = self.hist[key] + h if key in self.hist else h

    def fit(self, bits=BITS, meta: dict | None = None) -> Calibration:
        xs = torch.linspace(-1, 1, self.grid + 1, dtype=torch.float64)
        tensors = {}
        weightings = sorted({k[3] for k in self.hist}, key=WEIGHTINGS.index)
        for wname in weightings:
            for side in SIDES:
                for g in self.grans:
                    for b in bits:
                        for rot in self.rotations:
                            rows = []
                            for layer in range(self.num_layers):
                                h = self.hist.get((layer, side, g.name, wname, rot))
                                if h is None or not (h > 0).any():
                                    raise CalibrationError(
                                        f"layer {layer} {side} {g.name}: no data to fit")
                                rows.append(weighted_kmeans_1d(xs, h, 2 ** b))
                            key = levels_key(wname, side, g.name, b, rot)
                            tensors[key] = torch.stack(rows).float()
        for side in SIDES:
            tensors[f"outliers.{side}"] = torch.tensor(
                [[self.tails[(l, side)].threshold(f) for f in self.fractions]
                 for l in range(self.num_layers)], dtype=torch.float32)
        tensors["outlier_fractions"] = torch.tensor(self.fractions, dtype=torch.float64)
        meta = dict(meta or {})
        meta.update(version=CALIBRATION_VERSION, bits=list(bits),
                    granularities=[g.name for g in self.grans], weightings=weightings,
                    rotations=list(self.rotations),
                    outlier_fractions=list(self.fractions), histogram_grid=self.grid + 1,
                    values_per_layer_side=self.values)
        meta.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        return Calibration(meta, tensors)


def collect(model, windows: list[list[int]], acc: Accumulator, progress: bool = True) -> float:
    """Forward + backward each window, adding post-RoPE K, V and their squared gradients
    to `acc`. Returns the mean next-token loss."""
    from tqdm import tqdm

    losses = []
    bar = tqdm(windows, desc="calibrate", unit="seq", disable=not progress, file=sys.stderr)
    for ids in bar:
        check_window(model, len(ids))
        captured = {}

        def hook(layer, k, v):
            zk = torch.zeros_like(k, requires_grad=True)
            zv = torch.zeros_like(v, requires_grad=True)
            captured[layer] = (k.detach(), v.detach(), zk, zv)
            return k + zk, v + zv

        x = torch.tensor([ids])
        with set_hook(hook):
            out = model(input_ids=x, labels=x)  # mean next-token cross-entropy
        out.loss.backward()
        losses.append(out.loss.item())
        for layer, (k, v, zk, zv) in captured.items():
            acc.add(layer, "k", k, zk.grad)
            acc.add(layer, "v", v, zv.grad)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return sum(losses) / len(losses)

