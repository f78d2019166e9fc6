"""Cache formats: what a user names, validated, and its byte accounting.

A format is a codec for keys, a codec for values and a residual window of recent tokens
(16 bits, or int8 with _w8).
The byte layout of a page is NOT computed here: it comes from csrc/kvq_layout.h through
the compiled extension (`layout()`), the one definition shared with the kernels.

Names (`parse_format`):
  bf16, fp16                         unquantized baseline
  fp8_e4m3, fp8_e5m2                 static per-tensor scale (1.0 unless given)
  fp8_e4m3_head                      static scale per kv head
  fp8_e4m3_token                     dynamic scale per token-head
  int{8,4,3,2}_token                 scale+zero per token-head
  int{8,4,3,2}_group{g}              scale+zero per g channels of a token
  int{8,4,3,2}_channel{G}            scale+zero per channel over G tokens (keys and values)
  int{8,4,3,2}_tensor                static symmetric scale (k_scale/v_scale required)
  kivi{2,4}                          keys per channel over 32 tokens, values per 32 channels
  nuq{2,3,4}_token|_group{g}|_channel{G}
                                     non-uniform: a b-bit index into a per-layer codebook
                                     (from the calibration file) with scale+zero like int
  nuq{2,3,4}                         the default nuq format of that width (NUQ_DEFAULTS
                                     below, with the measurement behind the choice): keys
                                     per channel over 32 tokens, values per token, 1 outlier
                                     slot each, 32 recent tokens in full precision
  suffixes: _sym (symmetric int), _o{N} (N outlier slots per token per kv head, int and
            nuq: the N largest |x| of a token are kept to fp16 precision and left out of the
            dense scale), _r{R} (R recent tokens in full precision), _rot (keys and values
            rotated by a seeded randomized Hadamard transform before quantizing, see
            vllm_kvq.rotation; head_dim 64/128/256) or _rotv (values only), in that
            order; nuq formats also take
            _lm before _rot/_rotv (calibration-free Lloyd-Max codebooks for Gaussian values,
            vllm_kvq.gaussian_codebook: meant with _rot, e.g. nuq3_lm_rot);
            kivi also takes _k{G} (key token group) and _g{g} (value channel group);
            _sink right after the format's own name (int and nuq formats): the first token
            of a sequence also kept as an int8 row in every block's page and read for
            position 0 (the attention sink; kvq_layout.h Region.sink_*), e.g. kivi2_sink,
            nuq2_sink_rotv;
            _w8 last (formats with a residual window): the window stored as int8 with a
            float32 scale per token, K/V and kv head instead of 16 bits (half its memory;
            vllm_kvq.residual.window_dtype has the measurement), e.g. kivi4_w8
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch  # noqa: F401  -- loads libc10 before the extension vllm_kvq._C

from vllm_kvq.rotation import HEAD_SIZES as ROTATION_HEAD_SIZES
from vllm_kvq.residual import WINDOW_BITS
from vllm_kvq.rotation import ROTATIONS

CODEBOOKS = ("calibrated", "gaussian")

ENCODINGS = {"fp16": 0, "bf16": 1, "fp8_e4m3": 2, "fp8_e5m2": 3, "int": 4, "nuq": 5}
GRANULARITIES = {"none": 0, "tensor": 1, "head": 2, "token": 3, "group": 4, "channel": 5}
INT_BITS = (2, 3, 4, 8)
NUQ_BITS = (2, 3, 4)
CHANNEL_GROUPS = (16, 32, 64, 128)
MAX_OUTLIERS = 64
# Attention-sink tokens a format may keep (first tokens of a sequence, as int8 rows in
# every block's page: csrc/kvq_layout.h Region.sink_*): 0 or 1, as four sink tokens
# measured no better than one (reports/rotation/session25-sink)
SINK_TOKENS = (0, 1)
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
KIVI_DEFAULT_GROUP = 32
KIVI_DEFAULT_RESIDUAL = 128


class FormatError(ValueError):
    """A format name or parameter that is not allowed; the message says what is."""


def _allowed(what: str, value, allowed) -> FormatError:
    return FormatError(f"{what}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class Codec:
    """How one tensor (keys or values) is stored. Mirrors kvq::Codec."""

    encoding: str
    bits: int
    granularity: str = "none"
    group: int = 0
    symmetric: bool = False
    outliers: int = 0
    sink: int = 0  # SINK_TOKENS: the block's first token also kept as an int8 row

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise _allowed("encoding", self.encoding, ENCODINGS)
        if self.granularity not in GRANULARITIES:
            raise _allowed("granularity", self.granularity, GRANULARITIES)
        if self.encoding in ("fp16", "bf16"):
            if self.bits != 16 or self.granularity != "none":
                raise FormatError(f"{self.encoding} stores 16 bits with no scale")
        elif self.encoding.startswith("fp8"):
            if self.bits != 8:
                raise FormatError(f"{self.encoding} stores 8 bits, not {self.bits}")
            if self.granularity not in ("tensor", "head", "token"):
                raise _allowed(f"{self.encoding} granularity", self.granularity,
                               ("tensor", "head", "token"))
        elif self.encoding == "int":
            if self.bits not in INT_BITS:
                raise _allowed("bits", self.bits, INT_BITS)
            if self.granularity == "none":
                raise FormatError("int needs a granularity: tensor, head, token, group or channel")
        elif self.encoding == "nuq":
            if self.bits not in NUQ_BITS:
                raise _allowed("nuq bits", self.bits, NUQ_BITS)
            if self.granularity not in ("token", "group", "channel"):
                raise _allowed("nuq granularity", self.granularity,
                               ("token", "group", "channel"))
            if self.symmetric:
                raise FormatError("nuq scales are asymmetric (scale and zero-point); "
                                  "_sym is not allowed")
        if self.granularity in ("group", "channel"):
            if self.group not in CHANNEL_GROUPS:
                raise _allowed(f"{self.granularity} size", self.group, CHANNEL_GROUPS)
        elif self.group:
            raise FormatError(f"group={self.group} only applies to group/channel granularity")
        if self.granularity in ("tensor", "head") and self.encoding == "int" and not self.symmetric:
            raise FormatError("static (tensor/head) integer scales are symmetric: add _sym")
        if self.outliers < 0 or self.outliers > MAX_OUTLIERS:
            raise FormatError(f"outliers={self.outliers} per token is not allowed; "
                              f"allowed: 0..{MAX_OUTLIERS}")
        if self.outliers and self.encoding not in ("int", "nuq"):
            raise FormatError(f"outlier slots apply to int and nuq codecs, not "
                              f"{self.encoding}")
        if self.sink not in SINK_TOKENS:
            raise _allowed("sink", self.sink, SINK_TOKENS)
        if self.sink and self.encoding not in ("int", "nuq"):
            raise FormatError(f"an attention sink applies to int and nuq codecs, not "
                              f"{self.encoding}")

    def check_shape(self, head_dim: int, block_size: int) -> None:
        if self.granularity == "group" and head_dim % self.group:
            raise FormatError(
                f"group size {self.group} does not divide head_dim {head_dim}; "
                f"allowed: {[g for g in CHANNEL_GROUPS if head_dim % g == 0]}")
        if self.granularity == "channel" and block_size % self.group:
            raise FormatError(
                f"token group {self.group} does not divide block_size {block_size}; "
                f"allowed: {[g for g in CHANNEL_GROUPS if block_size % g == 0]}")

    @property
    def is_float(self) -> bool:
        return self.encoding in ("fp16", "bf16")

    @property
    def static_scale(self) -> bool:
        return self.granularity in ("tensor", "head")

    @property
    def gran_name(self) -> str:
        """"token", "group32", "channel32", ...: how calibration files name granularities."""
        return self.granularity + (str(self.group) if self.group else "")

    def as_ints(self) -> list[int]:
        """The int[7] every op takes (kvq::Codec field order)."""
        return [ENCODINGS[self.encoding], self.bits, GRANULARITIES[self.granularity],
                self.group, int(self.symmetric), self.outliers, self.sink]

    def describe(self) -> str:
        if self.is_float:
            return self.encoding
        s = f"{self.encoding}{self.bits}" if self.encoding in ("int", "nuq") else self.encoding
        s += f"/{self.granularity}" + (str(self.group) if self.group else "")
        if self.symmetric:
            s += "/sym"
        if self.outliers:
            s += f"/+{self.outliers}outl"
        if self.sink:
            s += "/+sink"
        return s


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one (block, kv_head) plane, as computed by kvq_layout.h."""

    head_dim: int
    block_size: int
    token_bytes: int       # C: bytes per token per kv head, K+V, incl. scales and padding
    plane_bytes: int       # block_size * token_bytes
    used_bytes: int
    padding: int
    k: dict
    v: dict

    def fields(self) -> dict[str, int]:
        """Every field's size in bytes; they plus `padding` add up to `plane_bytes`."""
        out = {}
        for side in ("k", "v"):
            r = getattr(self, side)
            for f in ("data", "scale", "zero", "outlier", "sink"):
                out[f"{side}_{f}"] = r[f"{f}_bytes"]
        return out


@dataclass(frozen=True)
class KVFormat:
    name: str
    key: Codec
    value: Codec
    residual_tokens: int = 0
    rotation: str = "none"  # vllm_kvq.rotation.ROTATIONS
    codebook: str = "calibrated"  # CODEBOOKS: nuq levels from a calibration file or Lloyd-Max
    window_bits: int = 16  # how the residual window stores a value: 16, or 8 (int8, _w8)

    def __post_init__(self):
        if self.residual_tokens < 0:
            raise FormatError(f"residual_tokens={self.residual_tokens} must be >= 0")
        if self.window_bits not in WINDOW_BITS:
            raise _allowed("window_bits", self.window_bits, WINDOW_BITS)
        if self.window_bits != 16 and not self.residual_tokens:
            raise FormatError(f"format {self.name!r}: window_bits={self.window_bits} needs a "
                              f"residual window (residual_tokens > 0, e.g. kivi4_w8, "
                              f"nuq3_w8, int4_group32_r32_w8)")
        if self.rotation not in ROTATIONS:
            raise _allowed("rotation", self.rotation, ROTATIONS)
        if self.codebook not in CODEBOOKS:
            raise _allowed("codebook", self.codebook, CODEBOOKS)
        if self.codebook == "gaussian" and "nuq" not in (self.key.encoding, self.value.encoding):
            raise FormatError(f"format {self.name!r}: _lm (Lloyd-Max codebooks) applies to nuq "
                              f"formats only (e.g. nuq3_lm_rot, nuq4_token_lm_rot)")
        if self.key.sink != self.value.sink:
            raise FormatError(f"format {self.name!r}: an attention sink keeps both the key and "
                              f"the value of the first token, so both codecs are int or nuq "
                              f"with sink={self.sink}")
        for c in (self.key, self.value):
            if c.granularity == "channel" and (self.residual_tokens == 0
                                               or self.residual_tokens % c.group):
                raise FormatError(
                    f"per-channel groups of {c.group} tokens need residual_tokens to be a "
                    f"positive multiple of {c.group} (the group is incomplete until then); "
                    f"got residual_tokens={self.residual_tokens}")

    @property
    def residual_chunk(self) -> int:
        """Tokens are quantized in aligned chunks of this many (1 = on write)."""
        return max(self.residual_tokens, 1)

    @property
    def is_baseline(self) -> bool:
        return self.key.is_float and self.value.is_float and self.residual_tokens == 0

    @property
    def needs_levels(self) -> bool:
        """Whether the kernels need codebooks (a calibration file) for this format."""
        return self.key.encoding == "nuq" or self.value.encoding == "nuq"

    @property
    def outliers(self) -> int:
        return max(self.key.outliers, self.value.outliers)

    @property
    def sink(self) -> int:
        """Attention-sink tokens kept as int8 rows in the pages (0 or 1; _sink)."""
        return max(self.key.sink, self.value.sink)

    @property
    def _name_flags(self) -> str:
        """The name's trailing flags (_sink, _lm, _rot / _rotv, _w8) that with_* keep at the
        end."""
        suffix = ""
        for flag, on in (("_w8", self.window_bits == 8),
                         ("_rot", self.rotation == "hadamard"),
                         ("_rotv", self.rotation == "hadamard_values"),
                         ("_lm", self.codebook == "gaussian"),
                         ("_sink", self.sink > 0)):
            if on and self.name[:len(self.name) - len(suffix)].endswith(flag):
                suffix = flag + suffix
        return suffix

    def with_outliers(self, n: int) -> "KVFormat":
        """The same format with n outlier slots per token for every int/nuq codec."""
        suffix = self._name_flags
        name = re.sub(r"_o\d+(?=(_r\d+)?$)", "", self.name[:len(self.name) - len(suffix)])
        if n:
            m = re.search(r"_r\d+$", name)
            name = name[:m.start()] + f"_o{n}" + m.group() if m else f"{name}_o{n}"
        def c(codec):
            return dataclasses.replace(codec, outliers=n) \
                if codec.encoding in ("int", "nuq") else codec
        return dataclasses.replace(self, name=name + suffix, key=c(self.key),
                                   value=c(self.value))

    def with_rotation(self, rotation: str) -> "KVFormat":
        """The same format with keys and values (or values only, or neither) rotated before
        quantizing."""
        base = self.name[:len(self.name) - len(self._name_flags)]
        flags = ("_sink" if self.sink else "") + ("_lm" if self.codebook == "gaussian" else "") + \
            {"hadamard": "_rot", "hadamard_values": "_rotv"}.get(rotation, "") + \
            ("_w8" if self.window_bits == 8 else "")
        return dataclasses.replace(self, name=base + flags, rotation=rotation)

    def with_sink(self, sink: int) -> "KVFormat":
        """The same format with (1) or without (0) the attention sink."""
        if sink not in SINK_TOKENS:
            raise _allowed("sink_tokens", sink, SINK_TOKENS)
        if sink and not any(c.encoding in ("int", "nuq") for c in (self.key, self.value)):
            raise FormatError(f"format {self.name!r}: an attention sink applies to int and nuq "
                              f"formats (e.g. kivi2_sink, nuq2_sink)")
        flags = self._name_flags
        base = self.name[:len(self.name) - len(flags)]
        flags = flags.removeprefix("_sink")

        def c(codec):
            return dataclasses.replace(codec, sink=sink) \
                if codec.encoding in ("int", "nuq") else codec
        return dataclasses.replace(self, name=base + ("_sink" if sink else "") + flags,
                                   key=c(self.key), value=c(self.value))

    def with_window_bits(self, window_bits: int) -> "KVFormat":
        """The same format with its residual window stored in `window_bits` (16 or 8)."""
        name = self.name.removesuffix("_w8") + ("_w8" if window_bits == 8 else "")
        return dataclasses.replace(self, name=name, window_bits=window_bits)

    def check(self, head_dim: int, block_size: int) -> None:
        if head_dim not in SUPPORTED_HEAD_SIZES:
            raise _allowed("head_dim", head_dim, SUPPORTED_HEAD_SIZES)
        if block_size < 1 or block_size % 16:
            raise FormatError(f"block_size={block_size} is not allowed; allowed: multiples of 16")
        self.key.check_shape(head_dim, block_size)
        self.value.check_shape(head_dim, block_size)
        if self.rotation != "none" and head_dim not in ROTATION_HEAD_SIZES:
            raise FormatError(f"format {self.name!r}: rotation={self.rotation} needs head_dim "
                              f"in {ROTATION_HEAD_SIZES} (a power-of-two Hadamard transform), "
                              f"got head_dim={head_dim}; use the format without rotation")
        if block_size % self.residual_chunk:
            raise FormatError(
                f"residual_tokens={self.residual_tokens} must divide block_size={block_size} "
                f"(the window is quantized in block-aligned chunks); use --block-size a "
                f"multiple of {self.residual_tokens}")

    def layout(self, head_dim: int, block_size: int) -> Layout:
        self.check(head_dim, block_size)
        from vllm_kvq import _C
        d = _C.make_layout(self.key.as_ints(), self.value.as_ints(), head_dim, block_size)
        return Layout(head_dim=head_dim, block_size=block_size, token_bytes=d["token_bytes"],
                      plane_bytes=d["plane_bytes"], used_bytes=d["used_bytes"],
                      padding=d["padding"], k=d["k"], v=d["v"])

    # --- accounting -------------------------------------------------------------------
    def bytes_per_token(self, head_dim: int, block_size: int) -> dict[str, float]:
        """Per token per kv head; K and V each with their scales, zeros, outliers."""
        lay = self.layout(head_dim, block_size)
        per = {}
        for side in ("k", "v"):
            r = getattr(lay, side)
            per[side] = sum(r[f"{f}_bytes"]
                            for f in ("data", "scale", "zero", "outlier", "sink")) / block_size
        per["padding"] = lay.padding / block_size
        per["total"] = lay.token_bytes
        return per

    def bits_per_value(self, head_dim: int, block_size: int) -> float:
        """Page bits per cached K or V value, scales and padding included."""
        return self.layout(head_dim, block_size).token_bytes * 8 / (2 * head_dim)

    def ratio_vs_bf16(self, head_dim: int, block_size: int) -> float:
        return 4 * head_dim / self.layout(head_dim, block_size).token_bytes

    def residual_bytes_per_seq(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Window bytes per running sequence (the rows it needs, in window_bits; the pool
        blocks holding them are window_blocks_per_seq)."""
        from vllm_kvq import _C
        return num_layers * _C.residual_bytes_per_seq_layer(
            num_kv_heads, head_dim, self.residual_tokens, self.window_bits)

    def window_rows_per_block(self, head_dim: int, block_size: int) -> int:
        """Window rows (one token's K and V) one pool block holds (vllm_kvq.window_cache)."""
        from vllm_kvq import _C
        return _C.window_rows_per_block(self.layout(head_dim, block_size).token_bytes,
                                        block_size, head_dim, self.window_bits)

    def window_value_row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, K or V, kv head) row of the window: head_dim values in 16
        bits, or head_dim int8 codes and a float32 scale."""
        from vllm_kvq import _C
        return _C.window_value_row_bytes(head_dim, self.window_bits)

    def window_blocks_per_seq(self, head_dim: int, block_size: int, lookback: int = 0) -> int:
        """Pool blocks a running sequence's window takes (0 without a window); lookback:
        speculative draft tokens per step, which the window's ring also holds
        (vllm_kvq.residual.window_rows)."""
        from vllm_kvq import _C
        from vllm_kvq.residual import window_rows

        rows = window_rows(self.residual_tokens, lookback) if self.residual_tokens else 0
        return _C.window_blocks_per_seq(self.layout(head_dim, block_size).token_bytes,
                                        block_size, head_dim, rows, self.window_bits)

    def with_residual(self, residual_tokens: int) -> "KVFormat":
        """The same format with `residual_tokens` recent tokens in the window (0: none, and
        then no _w8 either)."""
        fmt = self if residual_tokens or self.window_bits == 16 else self.with_window_bits(16)
        suffix = fmt._name_flags
        name = re.sub(r"_r\d+$", "", fmt.name[:len(fmt.name) - len(suffix)])
        name = f"{name}_r{residual_tokens}" if residual_tokens else name
        return dataclasses.replace(fmt, name=name + suffix, residual_tokens=residual_tokens)


# --- names ------------------------------------------------------------------------------
_INT_RE = re.compile(r"^int(?P<bits>\d+)_(?P<gran>tensor|head|token|group(?P<g>\d+)|"
                     r"channel(?P<G>\d+))(?P<sym>_sym)?(?:_o(?P<o>\d+))?(?:_r(?P<r>\d+))?$")
_NUQ_RE = re.compile(r"^nuq(?P<bits>\d+)_(?P<gran>token|group(?P<g>\d+)|channel(?P<G>\d+))"
                     r"(?:_o(?P<o>\d+))?(?:_r(?P<r>\d+))?$")
_NUQ_ALIAS_RE = re.compile(r"^nuq(?P<bits>\d+)(?:_o(?P<o>\d+))?(?:_r(?P<r>\d+))?$")
_FP8_RE = re.compile(r"^(?P<enc>fp8_e4m3|fp8_e5m2)(?:_(?P<gran>tensor|head|token))?"
                     r"(?:_r(?P<r>\d+))?$")
_KIVI_RE = re.compile(r"^kivi(?P<bits>\d+)(?:_k(?P<G>\d+))?(?:_g(?P<g>\d+))?(?:_r(?P<r>\d+))?$")
_FLOAT_RE = re.compile(r"^(?P<enc>bf16|fp16)(?:_r(?P<r>\d+))?$")

# The KVQuant-style default of each nuq width: (key codec, value codec, residual tokens):
# keys per channel over 32 tokens, values per token, one outlier slot per token on both
# sides ("dense-and-sparse"), the last 32 tokens in full precision. Chosen by measurement
# (benchmarks/nuq_measure.py: SmolLM2-135M, fp32, 4 x 512 held-out tokens, codebooks =
# 1-D k-means per layer and side on 4 x 512 calibration tokens, exact kernel rules):
#
#   format (bytes per token per kv head, head_dim 64)   no window         R = 32
#                                                       KL     ppl        KL      ppl
#   int3_group32 (64)                                  0.225  +24.3%     0.0525  +4.6%
#   int4_token (72)                                    0.087  +10.5%     0.0207  +1.6%
#   nuq3 per token + 1 slot, K and V (64)              0.148  +14.5%     0.0372  +2.5%
#   nuq3 K channel32 / V token + 1 slot (64)             -      -        0.0213  +0.9%
#   nuq3 K channel32 + 1 slot / V token + 1 slot (68)    -      -        0.0158  +0.9%  <- nuq3
#
# With the shipped Fisher-weighted codebooks nuq3 measures KL 0.0142 here, and through the
# real engine (evaluate.py, 2 x 512 tokens, fp32 model vs our bf16 cache) KL 0.0090 / ppl
# +0.65%, against int4_token 0.064 / +10.7% and int3_group32 0.148 / +23.4%;
# i.e. nuq3 has a lower KL than uniform int3 and than per-token int4, with or without
# their own 32-token window, at fewer bytes than int4_token. The window costs
# 2 * 32 * head_dim * 2 bytes per kv head per layer per running sequence (counted in the
# KV budget by vllm_kvq.plugin), like KIVI's; per-token variants need none
# (nuq3_token_o1: KL 0.148 with no window).
NUQ_DEFAULTS = {b: (Codec("nuq", b, "channel", 32, outliers=1),
                    Codec("nuq", b, "token", outliers=1), 32) for b in NUQ_BITS}

EXAMPLE_NAMES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token", "int8_token",
                 "int8_group32", "int4_token", "int4_group32", "int4_group32_r128",
                 "int2_group32", "int2_group32_r128", "int8_channel32_r128", "kivi4", "kivi2")


def _int(m, key, default=0):
    v = m.group(key)
    return int(v) if v is not None else default


def parse_format(name: str) -> KVFormat:
    """A format from its name; raises FormatError naming what is allowed."""
    if not isinstance(name, str):
        raise FormatError(f"format name must be a string, got {name!r}")
    if name.endswith("_w8"):
        base = parse_format(name[:-len("_w8")])
        if base.window_bits != 16:
            raise FormatError(f"format {name!r}: _w8 once, at the end")
        if not base.residual_tokens:
            raise FormatError(f"format {name!r}: _w8 stores the residual window in 8 bits, and "
                              f"{base.name!r} has none; e.g. kivi4_w8, nuq3_w8, "
                              f"int4_group32_r32_w8")
        return dataclasses.replace(base, name=name, window_bits=8)
    for suffix, rot in (("_rot", "hadamard"), ("_rotv", "hadamard_values")):
        if name.endswith(suffix):
            base = parse_format(name[:-len(suffix)])
            if base.window_bits != 16:
                raise FormatError(f"format {name!r}: _w8 goes last (e.g. kivi2_rot_w8)")
            if base.rotation != "none":
                raise FormatError(f"format {name!r}: one rotation suffix (_rot or _rotv), once")
            return dataclasses.replace(base, name=name, rotation=rot)
    if name.endswith("_sink"):
        base = parse_format(name[:-len("_sink")])
        if base.name != name[:-len("_sink")] or base.window_bits != 16 or \
                base.rotation != "none" or base.codebook != "calibrated" or base.sink:
            raise FormatError(f"format {name!r}: _sink goes right after the format's own name, "
                              f"once (e.g. kivi2_sink, nuq2_sink_rotv, kivi4_sink_w8)")
        if "int" not in (base.key.encoding, base.value.encoding) and \
                "nuq" not in (base.key.encoding, base.value.encoding):
            raise FormatError(f"format {name!r}: an attention sink applies to int and nuq "
                              f"formats (e.g. kivi2_sink, nuq2_sink), not {base.name!r}")
        def c(codec):
            return dataclasses.replace(codec, sink=1) \
                if codec.encoding in ("int", "nuq") else codec
        return dataclasses.replace(base, name=name, key=c(base.key), value=c(base.value))
    if name.endswith("_lm"):
        base = parse_format(name[:-len("_lm")])
        if base.window_bits != 16:
            raise FormatError(f"format {name!r}: _w8 goes last (e.g. nuq3_lm_rot_w8)")
        if base.codebook != "calibrated" or base.rotation != "none":
            raise FormatError(f"format {name!r}: the suffixes go _lm then _rot, once each")
        return KVFormat(name, base.key, base.value, base.residual_tokens, codebook="gaussian")
    if m := _FLOAT_RE.match(name):
        c = Codec(m["enc"], 16)
        return KVFormat(name, c, c, _int(m, "r"))
    if m := _FP8_RE.match(name):
        c = Codec(m["enc"], 8, m["gran"] or "tensor")
        return KVFormat(name, c, c, _int(m, "r"))
    if m := _INT_RE.match(name):
        gran = re.sub(r"\d+$", "", m["gran"])
        c = Codec("int", int(m["bits"]), gran, _int(m, "g") or _int(m, "G"), bool(m["sym"]),
                  _int(m, "o"))
        return KVFormat(name, c, c, _int(m, "r"))
    if m := _NUQ_RE.match(name):
        gran = re.sub(r"\d+$", "", m["gran"])
        c = Codec("nuq", int(m["bits"]), gran, _int(m, "g") or _int(m, "G"),
                  outliers=_int(m, "o"))
        return KVFormat(name, c, c, _int(m, "r"))
    if m := _NUQ_ALIAS_RE.match(name):
        bits = int(m["bits"])
        if bits not in NUQ_DEFAULTS:
            raise _allowed("nuq bits", bits, NUQ_BITS)
        k, v, r = NUQ_DEFAULTS[bits]
        if m["o"] is not None:
            k, v = (dataclasses.replace(c, outliers=int(m["o"])) for c in (k, v))
        return KVFormat(name, k, v, _int(m, "r", r))
    if m := _KIVI_RE.match(name):
        bits = int(m["bits"])
        if bits not in (2, 4):
            raise _allowed("kivi bits", bits, (2, 4))
        k = Codec("int", bits, "channel", _int(m, "G", KIVI_DEFAULT_GROUP))
        v = Codec("int", bits, "group", _int(m, "g", KIVI_DEFAULT_GROUP))
        return KVFormat(name, k, v, _int(m, "r", KIVI_DEFAULT_RESIDUAL))
    raise FormatError(
        f"unknown format {name!r}; allowed: bf16, fp16, fp8_e4m3[_tensor|_head|_token], "
        f"fp8_e5m2[...], int{{8,4,3,2}}_{{tensor_sym|head_sym|token|group<g>|channel<G>}}"
        f"[_sym][_o<N>][_r<R>], nuq{{2,3,4}}[_{{token|group<g>|channel<G>}}][_o<N>][_r<R>], "
        f"kivi{{2,4}}[_k<G>][_g<g>][_r<R>], each optionally ending in _rot (Hadamard "
        f"rotation of keys and values) or _rotv (of values only); nuq: _lm_rot for "
        f"calibration-free codebooks; int and nuq: _sink first keeps the first token as int8; "
        f"with a residual window, _w8 last stores it in 8 bits — "
        f"e.g. "
        f"{', '.join(EXAMPLE_NAMES)}, nuq3, int4_token_o1, nuq3_group32_o1, int4_group32_rot, "
        f"nuq3_lm_rot, kivi2_sink, kivi4_w8")
