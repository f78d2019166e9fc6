"""The user's KV-cache configuration: `--additional-config '{"kvq": {...}}'`, validated once.

Keys (all optional but `method`):
  method             a format name (see formats.py: "int4_group32", "kivi2", "nuq3", ...) or
                     a family: "bf16", "fp16", "fp8" (e4m3), "fp8_e5m2", "int", "kivi", "nuq"
  bits               int 2/3/4/8 (int), 2/4 (kivi), 2/3/4 (nuq)
  group_size         channels per scale (group granularity) / tokens per scale (channel)
  key_granularity    tensor | head | token | group | channel
  value_granularity  tensor | head | token | group | channel
  residual_tokens    recent tokens kept in full precision (0 = none)
  symmetric          bool
  k_scale, v_scale   static scales (float) for tensor/head granularity
  outlier_fraction   p in (0, 0.1]: ceil(p * head_dim) values of every token (per kv head,
                     keys and values) kept to fp16 precision in sparse outlier slots (int, nuq)
  rotation           "none" | "hadamard" | "hadamard_values": rotate keys and values (or
                     values only) of each head by a seeded randomized Hadamard transform
                     before quantizing (vllm_kvq.rotation; the same as the format name's
                     _rot / _rotv suffix)
  window_bits        16 | 8: how the residual window stores recent tokens (8: int8 with a
                     float32 scale per token, K/V and kv head, half the window's memory;
                     the same as the format name's _w8 suffix)
  sink_tokens        0 | 1: keep the sequence's first token (the attention sink) as an int8
                     row beside the quantized pages (the format name's _sink suffix;
                     int and nuq formats)
  calibration        path of a calibration file (`vllm-kvq calibrate`): the nuq codebooks
                     (not read by _lm formats, whose codebooks need no data).
                     nuq formats need one; without this key the model's shipped default
                     (vllm_kvq.codebook_file.default_calibration_path) is used if there is one.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_kvq.formats import (KIVI_DEFAULT_GROUP, SINK_TOKENS, Codec, FormatError,
                              KVFormat, parse_format)
from vllm_kvq.residual import WINDOW_BITS
from vllm_kvq.rotation import ROTATIONS

logger = logging.getLogger("vllm." + __name__)  # vLLM's handlers print it

CONFIG_KEY = "kvq"
ALLOWED_KEYS = ("method", "bits", "group_size", "key_granularity", "value_granularity",
                "residual_tokens", "symmetric", "k_scale", "v_scale", "calibration",
                "outlier_fraction", "rotation", "window_bits", "sink_tokens")
FAMILIES = ("bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2", "int", "kivi", "nuq")
DEFAULT_INT_GROUP = 32
DEFAULT_NUQ_BITS = 3
MAX_OUTLIER_FRACTION = 0.1


@dataclass(frozen=True)
class KVQConfig:
    fmt: KVFormat          # with outlier_fraction: its slots only once head_dim is known
    k_scale: float = 1.0
    v_scale: float = 1.0
    calibration: str | None = None
    outlier_fraction: float | None = None

    @property
    def name(self) -> str:
        return self.fmt.name

    def for_head_dim(self, head_dim: int) -> "KVQConfig":
        """fmt with outlier_fraction turned into ceil(p * head_dim) slots per token."""
        if not self.outlier_fraction:
            return self
        return dataclasses.replace(
            self, fmt=self.fmt.with_outliers(outlier_slots(self.outlier_fraction, head_dim)))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.fmt.name, "residual_tokens": self.fmt.residual_tokens,
                "k_scale": self.k_scale, "v_scale": self.v_scale,
                "calibration": self.calibration, "outlier_fraction": self.outlier_fraction,
                "rotation": self.fmt.rotation, "window_bits": self.fmt.window_bits,
                "sink_tokens": self.fmt.sink}


def outlier_slots(fraction: float, head_dim: int) -> int:
    """Outlier slots per token per kv head for a fraction of head_dim (rounded up)."""
    return max(1, math.ceil(fraction * head_dim - 1e-9))


def _int_key(d: dict, key: str, default=None) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
        raise FormatError(f"kvq.{key}={v!r} must be an integer")
    return int(v)


def _int_choice(d: dict, key: str, allowed: tuple, meaning: str) -> int | None:
    """d[key] when given: one of `allowed` (ints; true/false are not), else FormatError."""
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or v not in allowed):
        raise FormatError(f"kvq.{key}={v!r} is not allowed; allowed: "
                          f"{', '.join(map(str, allowed))} ({meaning})")
    return v


def _bool_key(d: dict, key: str) -> bool | None:
    v = d.get(key)
    if v is None or isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "1", "yes"):
        return True
    if str(v).lower() in ("false", "0", "no"):
        return False
    raise FormatError(f"kvq.{key}={v!r} must be true or false")


def _family_format(method: str, d: dict) -> KVFormat:
    bits = _int_key(d, "bits")
    group = _int_key(d, "group_size")
    if method in ("bf16", "fp16"):
        return parse_format(method)
    if method.startswith("fp8"):
        enc = "fp8_e5m2" if method == "fp8_e5m2" else "fp8_e4m3"
        return parse_format(enc)
    if method == "kivi":
        bits = 2 if bits is None else bits
        g = group or KIVI_DEFAULT_GROUP
        return parse_format(f"kivi{bits}" if g == KIVI_DEFAULT_GROUP else f"kivi{bits}_k{g}_g{g}")
    if method == "nuq":  # the default nuq format of that width (formats.NUQ_DEFAULTS)
        return parse_format(f"nuq{DEFAULT_NUQ_BITS if bits is None else bits}")
    # int: per-group of 32 channels unless told otherwise
    bits = 8 if bits is None else bits
    return parse_format(f"int{bits}_group{group or DEFAULT_INT_GROUP}")


def _with_overrides(fmt: KVFormat, d: dict) -> KVFormat:
    bits = _int_key(d, "bits")
    group = _int_key(d, "group_size")
    sym = _bool_key(d, "symmetric")

    def codec(c: Codec, gran_key: str) -> Codec:
        changes: dict[str, Any] = {}
        gran = d.get(gran_key)
        if gran is not None:
            changes["granularity"] = gran
            if gran in ("group", "channel"):
                changes["group"] = group or c.group or DEFAULT_INT_GROUP
            else:
                changes["group"] = 0
        elif group is not None and c.granularity in ("group", "channel"):
            changes["group"] = group
        if bits is not None and not c.is_float and not c.encoding.startswith("fp8"):
            changes["bits"] = bits
        if sym is not None:
            changes["symmetric"] = sym
        return dataclasses.replace(c, **changes) if changes else c

    k, v = codec(fmt.key, "key_granularity"), codec(fmt.value, "value_granularity")
    residual = _int_key(d, "residual_tokens")
    r = fmt.residual_tokens if residual is None else residual
    if (k, v, r) == (fmt.key, fmt.value, fmt.residual_tokens):
        return fmt
    given = ",".join(f"{key}={d[key]}" for key in ALLOWED_KEYS[1:7] if key in d)
    return dataclasses.replace(fmt, name=f"{fmt.name}[{given}]", key=k, value=v,
                               residual_tokens=r)


def config_from_dict(d: dict | None, head_dim: int | None = None) -> KVQConfig:
    """Validate the `kvq` dict; FormatError names the key, the value and what is allowed.
    With head_dim, outlier_fraction becomes outlier slots in fmt (else see for_head_dim)."""
    if d is None:
        raise FormatError(f'no "{CONFIG_KEY}" configuration: pass --additional-config '
                          f'\'{{"{CONFIG_KEY}": {{"method": "kivi2"}}}}\'')
    if not isinstance(d, dict):
        raise FormatError(f"kvq configuration must be a mapping, got {d!r}")
    unknown = sorted(set(d) - set(ALLOWED_KEYS))
    if unknown:
        raise FormatError(f"unknown kvq key(s) {unknown}; allowed: {', '.join(ALLOWED_KEYS)}")
    method = d.get("method")
    if not method or not isinstance(method, str):
        raise FormatError(f"kvq.method={method!r} is required; allowed: a format name such "
                          f"as int4_group32 or kivi2, or a family: {', '.join(FAMILIES)}")
    try:
        fmt = _family_format(method, d) if method in FAMILIES else parse_format(method)
        fmt = _with_overrides(fmt, d)
        rot = d.get("rotation")
        if rot is not None:
            if rot not in ROTATIONS:
                raise FormatError(f"kvq.rotation={rot!r} is not allowed; allowed: "
                                  f"{', '.join(ROTATIONS)}")
            if rot != fmt.rotation:
                fmt = fmt.with_rotation(rot)
        wb = _int_choice(d, "window_bits", WINDOW_BITS,
                         "bits per stored value of the residual window")
        if wb is not None and wb != fmt.window_bits:
            fmt = fmt.with_window_bits(wb)
        sink = _int_choice(d, "sink_tokens", SINK_TOKENS,
                           "first tokens kept as int8 rows beside the pages")
        if sink is not None and sink != fmt.sink:
            fmt = fmt.with_sink(sink)
    except (FormatError, TypeError, ValueError) as e:
        raise FormatError(f"kvq.method={method!r}: {e}") from None
    p = d.get("outlier_fraction")
    if p is not None:
        try:
            p = float(p)
        except (TypeError, ValueError):
            p = None
        if p is None or isinstance(d["outlier_fraction"], bool) or \
                not 0 < p <= MAX_OUTLIER_FRACTION:
            raise FormatError(f"kvq.outlier_fraction={d['outlier_fraction']!r} is not allowed; "
                              f"allowed: a number in (0, {MAX_OUTLIER_FRACTION}] (e.g. 0.01: "
                              f"1% of each token's values kept to fp16 precision)")
        if not any(c.encoding in ("int", "nuq") for c in (fmt.key, fmt.value)):
            raise FormatError(f"kvq.outlier_fraction={d['outlier_fraction']!r} is not allowed "
                              f"with kvq.method={method!r}; allowed with int and nuq formats")
    scales = {}
    for key in ("k_scale", "v_scale"):
        v = d.get(key, 1.0)
        try:
            scales[key] = float(v)
        except (TypeError, ValueError):
            raise FormatError(f"kvq.{key}={v!r} must be a positive number") from None
        if not scales[key] > 0:
            raise FormatError(f"kvq.{key}={v!r} must be a positive number")
    cal = d.get("calibration")
    if cal is not None and (not isinstance(cal, (str, Path)) or not str(cal)):
        raise FormatError(f"kvq.calibration={cal!r} must be the path of a calibration file")
    cfg = KVQConfig(fmt=fmt, calibration=None if cal is None else str(cal),
                    outlier_fraction=p, **scales)
    return cfg.for_head_dim(head_dim) if head_dim else cfg


def config_from_vllm(vllm_config) -> KVQConfig:
    """The validated config of an engine: outlier slots for the model's head_dim, and for
    nuq formats the calibration file resolved (kvq.calibration, else the model's default).
    Parsed once per process: the plugin hook, the builder, every layer's impl and the
    server all ask for it, and get the same object back."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    model = getattr(vllm_config, "model_config", None)
    head_dim = model.get_head_size() if model is not None else None
    d = extra.get(CONFIG_KEY)
    key = (json.dumps(d, sort_keys=True, default=repr), head_dim,
           None if model is None else str(model.model))
    cfg = _PARSED.get(key)
    if cfg is None:
        cfg = config_from_dict(d, head_dim=head_dim)
        if cfg.fmt.needs_levels and model is not None:
            cfg = resolve_calibration(cfg, model.model)
        _PARSED[key] = cfg
    return cfg


_PARSED: dict[tuple, KVQConfig] = {}


def speculative_tokens(vllm_config) -> int:
    """Draft tokens a speculative-decoding step may write and then roll back (vLLM's
    num_speculative_tokens; 0 without speculative decoding): the residual window keeps
    that many rows more (vllm_kvq.residual)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def resolve_calibration(cfg: KVQConfig, model: str | None) -> KVQConfig:
    """cfg with `calibration` set to an existing file: the given one, else the model's
    shipped default; FormatError (before any engine starts) when there is none."""
    if not cfg.fmt.needs_levels or cfg.fmt.codebook == "gaussian":
        return cfg  # _lm formats compute their codebooks (vllm_kvq.gaussian_codebook)
    path = cfg.calibration
    if path is None:
        from vllm_kvq.codebook_file import default_calibration_path
        found = default_calibration_path(model) if model else None
        if found is None:
            raise FormatError(
                f"kvq.method={cfg.fmt.name!r} is a nuq (codebook) format and needs a "
                f"calibration file for model {model!r}: none was given (kvq.calibration) and "
                f"none ships for this model. Run `vllm-kvq calibrate` for it and pass "
                f"--additional-config '{{\"kvq\": {{\"method\": \"{cfg.fmt.name}\", "
                f"\"calibration\": \"PATH\"}}}}'")
        path = str(found)
    if not Path(path).is_file():
        raise FormatError(f"kvq.calibration={path!r} does not exist or is not a file; "
                          f"create one with `vllm-kvq calibrate`")
    return dataclasses.replace(cfg, calibration=str(path))


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM attention layer name
    (model.layers.12.self_attn.attn -> 12)."""
    nums = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"vllm-kvq: cannot tell the layer index of attention layer "
                         f"{layer_name!r} (nuq codebooks are per layer)")
    return nums[0]


def load_levels(cfg: KVQConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                model_type: str | None = None) -> list[tuple]:
    """Per layer, (k_levels, v_levels): the float32 codebooks of the format's nuq codecs
    (None for a side that is not nuq), from cfg.calibration. Raises FormatError naming the
    file and what does not match the model (or which codebooks it lacks)."""
    if not cfg.fmt.needs_levels:
        return [(None, None)] * num_layers
    if cfg.fmt.codebook == "gaussian":
        return _gaussian_levels(cfg.fmt.key, cfg.fmt.value, num_layers, head_dim)
    if cfg.calibration is None:
        raise FormatError(f"kvq.method={cfg.fmt.name!r} needs kvq.calibration")
    return _load_levels(cfg.calibration, cfg.fmt.key, cfg.fmt.value, cfg.fmt.rotation,
                        num_layers, num_kv_heads, head_dim, model_type)


def _codebook(cal, layer: int, side: str, c, rotation: str):
    """The levels fitted for this codec's scale groups on the data as this side stores it
    (rotated or not): with outlier slots, those fitted with outliers left out (granularity
    "token_o1", ...) when the file has them."""
    from vllm_kvq.codebook_file import CalibrationError
    names = [c.gran_name]
    if c.outliers:
        names = [f"{c.gran_name}_o{c.outliers}", f"{c.gran_name}_o1", c.gran_name]
        names = list(dict.fromkeys(names))
    for i, name in enumerate(names):
        try:
            return cal.levels(layer, side, c.bits, name, rotation=rotation)
        except CalibrationError:
            if i == len(names) - 1:
                raise


@lru_cache(maxsize=8)
def _gaussian_levels(kc, vc, num_layers, head_dim):
    """_lm formats: the same Lloyd-Max levels for every layer (built once per process, like
    a calibration file's: every layer's impl asks)."""
    from vllm_kvq.gaussian_codebook import codec_levels
    return [(codec_levels(kc, head_dim), codec_levels(vc, head_dim))] * num_layers


@lru_cache(maxsize=8)
def _load_levels(path, kc, vc, rotation, num_layers, num_kv_heads, head_dim, model_type):
    from vllm_kvq.codebook_file import CalibrationError, load_calibration
    from vllm_kvq.reference import check_levels
    from vllm_kvq.rotation import rotates_keys
    try:
        cal = load_calibration(path, num_layers=num_layers, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, model_type=model_type)
        # the data each side quantizes: values rotated by either rotation, keys by "hadamard"
        rotated = {"k": rotates_keys(rotation), "v": rotation != "none"}
        fitted = "hadamard" if cal.has_rotation("hadamard") else "none"
        if fitted == "none" and any(rotated[s] and c.encoding == "nuq"
                                    for s, c in (("k", kc), ("v", vc))):
            logger.warning("vllm-kvq: calibration %s has no codebooks fitted on rotated keys "
                           "and values (made before they were added); the rotated format "
                           "uses those fitted unrotated. Rerun `vllm-kvq calibrate` for them.",
                           path)
        out = []
        for layer in range(num_layers):
            pair = []
            for side, c in (("k", kc), ("v", vc)):
                if c.encoding != "nuq":
                    pair.append(None)
                    continue
                lv = _codebook(cal, layer, side, c, fitted if rotated[side] else "none")
                pair.append(check_levels(lv, c, f"calibration {path}: layer {layer} {side} "
                                                f"levels"))
            out.append(tuple(pair))
    except (CalibrationError, ValueError) as e:
        raise FormatError(f"kvq.calibration={str(path)!r}: {e}") from None
    return out


def model_levels(config: KVQConfig, vllm_config) -> list[tuple]:
    """Per layer (k_levels, v_levels) of a nuq format, from its calibration file (loaded
    once per process and checked against the model); [] for other formats."""
    if not config.fmt.needs_levels:
        return []
    model = vllm_config.model_config
    # all layers (layer names carry global indices, also under pipeline parallelism)
    return load_levels(config, num_layers=model.get_total_num_hidden_layers(),
                       num_kv_heads=model.get_total_num_kv_heads(),
                       head_dim=model.get_head_size(),
                       model_type=getattr(model.hf_config, "model_type", None))
