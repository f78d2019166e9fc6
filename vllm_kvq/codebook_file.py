"""The nuq calibration file: what serving reads (the codebooks and outlier thresholds of
`vllm-kvq calibrate`, vllm_kvq/tools/calibrate), and the files shipped for the models that
vllm_kvq.model_prep prepares.

File: safetensors. Tensors `levels.<weighting>.<k|v>.<granularity>.b<bits>` [layers, 2^b]
(ascending, within [-1, 1]) fitted on keys and values as the cache stores them unrotated,
the same with a `.hadamard` suffix fitted on them Hadamard-rotated (vllm_kvq.rotation: what
a `_rot` / `_rotv` format quantizes; files made before these were added lack them),
`outliers.<k|v>` [layers, fractions], `outlier_fractions`; metadata `vllm_kvq_calibration` =
JSON (version, model, dimensions, corpus, ...). Levels are in normalized units of the
serve-time scale groups (vllm_kvq.tools.calibrate.normalize).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

CALIBRATION_VERSION = 1
META_KEY = "vllm_kvq_calibration"
SIDES = ("k", "v")
WEIGHTINGS = ("fisher", "unweighted")
# the data a codebook was fitted on: as stored, or rotated as a rotated format stores it
ROTATIONS = ("none", "hadamard")
SHIPPED_DIR = Path(__file__).with_name("calibrations")
DEFAULT_MODEL_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")


class CalibrationError(ValueError):
    """A calibration file that is missing, malformed, of another version or for another
    model, or a codebook that was not fitted; the message says which and what there is."""


def levels_key(weighting: str, side: str, granularity: str, bits: int,
               rotation: str = "none") -> str:
    """A codebook's tensor name in the file (the module docstring's naming)."""
    key = f"levels.{weighting}.{side}.{granularity}.b{bits}"
    return key if rotation == "none" else f"{key}.{rotation}"


@dataclass
class Calibration:
    meta: dict
    tensors: dict = field(repr=False)

    def available(self, weighting: str = "fisher") -> list[str]:
        return sorted(k.split(".", 2)[2] for k in self.tensors
                      if k.startswith(f"levels.{weighting}."))

    def has_rotation(self, rotation: str) -> bool:
        """Whether the file holds codebooks fitted on data rotated this way."""
        return rotation == "none" or any(k.startswith("levels.") and k.endswith(f".{rotation}")
                                         for k in self.tensors)

    def levels(self, layer: int, side: str, bits: int, granularity: str,
               weighting: str = "fisher", rotation: str = "none") -> torch.Tensor:
        """The 2^bits ascending levels in [-1, 1] (float32) for one layer and side, fitted on
        the data as stored (rotation "none") or Hadamard-rotated ("hadamard")."""
        if side not in SIDES:
            raise CalibrationError(f"side {side!r} is not allowed; allowed: k, v")
        if rotation not in ROTATIONS:
            raise CalibrationError(f"rotation {rotation!r} is not allowed; allowed: "
                                   f"{', '.join(ROTATIONS)}")
        n = self.meta["num_layers"]
        if not 0 <= layer < n:
            raise CalibrationError(f"layer {layer} is out of range: the calibration has {n} layers")
        if granularity == f"group{self.meta.get('head_dim')}":
            granularity = "token"  # one group spanning the head vector is the token's group
        t = self.tensors.get(levels_key(weighting, side, granularity, bits, rotation))
        if t is None:
            raise CalibrationError(
                f"no {weighting} codebook for side={side} bits={bits} granularity="
                f"{granularity!r} rotation={rotation} in this calibration; available "
                f"(side.granularity.bits[.rotation]): "
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


def default_calibration_path(model_path_or_name) -> Path | None:
    """The calibration shipped with the package for a model that model_prep prepares
    (SmolLM2, Gemma 3: its folder, recognized by its name or its completion marker) or for
    the default model's hub name, else None."""
    from vllm_kvq.model_prep import MARKER, MODELS, SMOLLM2

    if model_path_or_name is None:
        return None
    s = str(model_path_or_name).rstrip("/")
    p = Path(s)
    try:
        marker = (p / MARKER).read_text()
    except OSError:
        marker = ""
    for source in MODELS.values():
        shipped = SHIPPED_DIR / f"{source.name}.safetensors"
        hub = DEFAULT_MODEL_NAMES if source is SMOLLM2 else ()
        if shipped.is_file() and (p.name == source.name or s in hub or source.sha256 in marker):
            return shipped
    return None
