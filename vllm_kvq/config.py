"""The user's KV-cache configuration: `--additional-config '{"kvq": {...}}'`, validated once.

Keys (all optional but `method`):
  method             a format name (see formats.py: "int4_group32", "kivi2", ...) or a family:
                     "bf16", "fp16", "fp8" (e4m3), "fp8_e5m2", "int", "kivi"
  bits               int 2/3/4/8 (int), 2/4 (kivi)
  group_size         channels per scale (group granularity) / tokens per scale (channel)
  key_granularity    tensor | head | token | group | channel
  value_granularity  tensor | head | token | group | channel
  residual_tokens    recent tokens kept in full precision (0 = none)
  symmetric          bool
  k_scale, v_scale   static scales (float) for tensor/head granularity
  calibration        path of a calibration file (used by nuq formats, issue 5)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_kvq.formats import (KIVI_DEFAULT_GROUP, Codec, FormatError,
                              KVFormat, parse_format)

CONFIG_KEY = "kvq"
ALLOWED_KEYS = ("method", "bits", "group_size", "key_granularity", "value_granularity",
                "residual_tokens", "symmetric", "k_scale", "v_scale", "calibration")
FAMILIES = ("bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2", "int", "kivi")
DEFAULT_INT_GROUP = 32


@dataclass(frozen=True)
class KVQConfig:
    fmt: KVFormat
    k_scale: float = 1.0
    v_scale: float = 1.0
    calibration: str | None = None

    @property
    def name(self) -> str:
        return self.fmt.name

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.fmt.name, "residual_tokens": self.fmt.residual_tokens,
                "k_scale": self.k_scale, "v_scale": self.v_scale,
                "calibration": self.calibration}


def _int_key(d: dict, key: str, default=None) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
        raise FormatError(f"kvq.{key}={v!r} must be an integer")
    return int(v)


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
    return KVFormat(f"{fmt.name}[{given}]", k, v, r)


def config_from_dict(d: dict | None) -> KVQConfig:
    """Validate the `kvq` dict; FormatError names the key, the value and what is allowed."""
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
    except (FormatError, TypeError, ValueError) as e:
        raise FormatError(f"kvq.method={method!r}: {e}") from None
    scales = {}
    for key in ("k_scale", "v_scale"):
        v = d.get(key, 1.0)
        try:
            scales[key] = float(v)
        except (TypeError, ValueError):
            raise FormatError(f"kvq.{key}={v!r} must be a positive number") from None
        if not scales[key] > 0:
            raise FormatError(f"kvq.{key}={v!r} must be a positive number")
    return KVQConfig(fmt=fmt, calibration=d.get("calibration"), **scales)


def config_from_vllm(vllm_config) -> KVQConfig:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return config_from_dict(extra.get(CONFIG_KEY))
