"""Python entry points of the kernels (torch.ops.vllm_kvq.*), with argument checks.

Every check that needs only shapes, dtypes and the format runs here first and raises
ValueError naming the value and what is allowed, before any kernel runs. Checks that need
tensor contents (block ids in range, whole per-channel groups in slot_mapping, staging rows
present) are done again by the C++ ops, also before they write anything.

Semantics are those of vllm_kvq/reference.py (write_cache, paged_attention).

The serving path does not call these per layer: `LayerOps` resolves and checks a layer's
format, static scales and codebooks once, and its `write` / `attend` are the extension ops
and nothing else (the C++ TORCH_CHECKs stay the guard of every call).

nuq codecs need their layer's codebooks: k_levels / v_levels, float32 [2^bits] ascending in
[-1, 1] (vllm_kvq.codebook_file.Calibration.levels); other codecs take none.

Rotated formats (fmt.rotation = "hadamard", vllm_kvq.rotation): writes quantize K R and
V R (rotated in float32 here), attention reads the query rotated and rotates the output
back ("hadamard_values": V R only, the value staging rows, the output back). On the CPU the
paged kernel does both itself, in fp32 as it loads each query row and before it rounds each
output row (`fused_rotation`); on CUDA, and for the flash-prefill split, they are rotated
here around the kernels (the query rounded to its dtype once rotated). With a residual
window the serving path rotates each step's new rows once instead (LayerOps.rotate_rows)
and keeps the window rotated, so its staging rows and the chunks quantized from them are
not rotated again (in the model's dtype: bf16 rows are rounded once after rotating). On
the CPU each rotation is one pass of torch.ops.vllm_kvq.hadamard (bit-identical to
rotation.rotate / unrotate); on CUDA one fp32 product with rotation.matrix.
"""
from __future__ import annotations

import math

import torch

from vllm_kvq import rotation
from vllm_kvq.formats import SUPPORTED_HEAD_SIZES, Codec, KVFormat, Layout
from vllm_kvq.reference import check_levels

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

_loaded = False


def _ops():
    global _loaded
    if not _loaded:
        import vllm_kvq._C  # noqa: F401  -- registers torch.ops.vllm_kvq
        _loaded = True
    return torch.ops.vllm_kvq


def simd_path() -> str:
    """The CPU SIMD path the kernels use now ("avx512", "avx2" or "scalar"); the env var
    KVQ_SIMD=scalar|avx2|avx512 lowers it (read on every call)."""
    _ops()
    from vllm_kvq import _C
    return _C.simd_path()


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None, inverse: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """rotation.rotate(x, dtype) (inverse: unrotate) into `out` (default: a new tensor):
    the C++ op on the CPU, one pass, bit-identical; elsewhere x R (R^T) as one fp32 product.
    x and out [N, D] or [N, M, D], last dim contiguous."""
    if x.device.type != "cpu":
        R = rotation.matrix(x.shape[-1], x.device)
        y = (x.to(torch.float32) @ (R.T if inverse else R)).to(dtype or x.dtype)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype or x.dtype)
    _ops().hadamard(x, out, rotation.signed_scale(x.shape[-1]), inverse)
    return out


def _fail(msg: str):
    raise ValueError(msg)


def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        _fail(f"{name}.dtype={t.dtype} is not allowed; allowed: float32, float16, bfloat16")


def _check_index(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        _fail(f"{name}.dtype={t.dtype} is not allowed; allowed: int32, int64")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def _check_codec(fmt: KVFormat) -> None:
    for side, c in (("key", fmt.key), ("value", fmt.value)):
        if c.granularity == "channel" and fmt.residual_chunk % c.group:
            _fail(f"format {fmt.name!r}: per-channel {side} groups of {c.group} tokens need "
                  f"residual_tokens a positive multiple of {c.group}, got "
                  f"{fmt.residual_tokens}")


def _check_cache(cache, fmt: KVFormat, head_dim: int, num_kv_heads: int | None) -> Layout:
    if not isinstance(cache, torch.Tensor):
        _fail(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8 or cache.dim() != 4:
        _fail(f"cache must be uint8 [num_blocks, num_kv_heads, block_size, C], got "
              f"{cache.dtype} {tuple(cache.shape)}")
    if head_dim not in SUPPORTED_HEAD_SIZES:
        _fail(f"head_dim={head_dim} is not allowed; allowed: "
              f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}")
    _check_codec(fmt)
    block_size = cache.shape[2]
    layout = fmt.layout(head_dim, block_size)  # FormatError (a ValueError) if not allowed
    if cache.shape[3] != layout.token_bytes:
        _fail(f"cache last dim is {cache.shape[3]} bytes, but format {fmt.name!r} with "
              f"head_dim {head_dim} and block_size {block_size} needs "
              f"C={layout.token_bytes}")
    if num_kv_heads is not None and cache.shape[1] != num_kv_heads:
        _fail(f"cache has {cache.shape[1]} kv heads, the tensors have {num_kv_heads}")
    if cache.stride(3) != 1 or cache.stride(2) != cache.shape[3] or \
            cache.stride(1) < block_size * cache.shape[3]:
        _fail("each (block, kv_head) plane of the cache must be contiguous "
              f"(strides {cache.stride()})")
    return layout


def _static_scales(s, codec: Codec, H: int, name: str, device) -> torch.Tensor:
    """fp32 [H]: the static per-tensor/per-head scale of a tensor/head codec, else ones."""
    if not codec.static_scale:
        return torch.ones(H, dtype=torch.float32, device=device)
    if s is None:
        if codec.encoding == "int":
            _fail(f"{name} is required for the static symmetric int codec "
                  f"{codec.describe()} (a float or H={H} floats)")
        return torch.ones(H, dtype=torch.float32, device=device)
    t = torch.as_tensor(s, dtype=torch.float32).reshape(-1)
    if t.numel() not in (1, H):
        _fail(f"{name} has {t.numel()} values; allowed: 1 or H={H}")
    if codec.granularity == "head" and t.numel() != H and H != 1:
        _fail(f"{name}: codec {codec.describe()} needs one scale per kv head (H={H}), got 1")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        _fail(f"{name} must be finite and > 0, got {t.tolist()}")
    return t.expand(H).contiguous().to(device)


_NO_LEVELS: dict = {}


def _levels(levels, codec: Codec, name: str, fmt: KVFormat, device) -> torch.Tensor:
    """float32 [2^bits] on the cache's device for a nuq codec (checked by the reference's
    rule, reference.check_levels); an empty tensor otherwise."""
    t = check_levels(levels, codec, f"format {fmt.name!r}: {name}")
    if t is None:
        if device not in _NO_LEVELS:
            _NO_LEVELS[device] = torch.empty(0, dtype=torch.float32, device=device)
        return _NO_LEVELS[device]
    return t.to(device=device).contiguous()


def _check_channel_groups(slot_mapping: torch.Tensor, codec: Codec, side: str) -> None:
    """Per-channel codecs: every entry with a slot must be in a whole aligned group of G
    consecutive slots (the same rule as the reference)."""
    G = codec.group
    slots = slot_mapping.tolist()
    i, n = 0, len(slots)
    while i < n:
        s = slots[i]
        if s < 0:
            i += 1
            continue
        if s % G or slots[i:i + G] != list(range(s, s + G)):
            _fail(f"per-channel {side} codec needs whole aligned groups of {G} slots; "
                  f"entry {i} (slot {s}) starts none")
        i += G


def write_cache(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                slot_mapping: torch.Tensor, fmt: KVFormat, k_scale=None, v_scale=None,
                k_levels=None, v_levels=None) -> None:
    """Quantize key/value [N, H, D] into their slots of cache (slot -1 = padding).

    Rows of key/value beyond len(slot_mapping) are ignored (vLLM pads them).
    k_scale/v_scale: static scales of tensor/head codecs (float or [H]); fp8 defaults to 1.0,
    static int codecs require them. k_levels/v_levels: codebooks of nuq codecs.
    """
    _check_float("key", key)
    _check_float("value", value)
    if key.dim() != 3:
        _fail(f"key must be [N, H, D], got shape {tuple(key.shape)}")
    _check_index("slot_mapping", slot_mapping, 1)
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        _fail(f"slot_mapping has {n} entries but key/value have {key.shape[0]}/"
              f"{value.shape[0]} rows")
    key, value = key[:n], value[:n]
    if value.shape != key.shape:
        _fail(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        _fail("key/value last dim must be contiguous")
    H, D = key.shape[1], key.shape[2]
    _check_cache(cache, fmt, D, H)
    if not (key.device == value.device == cache.device == slot_mapping.device):
        _fail(f"key, value, cache and slot_mapping must be on one device, got {key.device}, "
              f"{value.device}, {cache.device}, {slot_mapping.device}")
    ks = _static_scales(k_scale, fmt.key, H, "k_scale", cache.device)
    vs = _static_scales(v_scale, fmt.value, H, "v_scale", cache.device)
    kl = _levels(k_levels, fmt.key, "k_levels", fmt, cache.device)
    vl = _levels(v_levels, fmt.value, "v_levels", fmt, cache.device)
    if slot_mapping.device.type == "cpu":
        for side, c in (("key", fmt.key), ("value", fmt.value)):
            if c.granularity == "channel":
                _check_channel_groups(slot_mapping, c, side)
    if fmt.rotation != "none":
        key, value = rotation.for_cache(key, value, rotation.rotates_keys(fmt.rotation),
                                        rot=rotate)
    _ops().write_cache(key, value, cache, slot_mapping, fmt.key.as_ints(),
                       fmt.value.as_ints(), ks, vs, kl, vl)


def paged_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, fmt: KVFormat,
                    softmax_scale: float, k_scale=None, v_scale=None,
                    staging_k: torch.Tensor | None = None,
                    staging_v: torch.Tensor | None = None,
                    staging_start_loc: torch.Tensor | None = None,
                    staging_pos0: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, k_levels=None,
                    v_levels=None, sliding_window: int = 0,
                    logits_soft_cap: float = 0.0) -> torch.Tensor:
    """Causal attention of a mixed batch over the quantized paged cache (see reference.py).

    query [T, Hq, D]; block_table int32 [S, max_blocks]; seq_lens int32 [S] (incl. this
    step's tokens); query_start_loc int32 [S+1]. Only the first query_start_loc[-1] rows of
    out are written. With fmt.residual_chunk R > 1, a query at position p reads positions
    >= floor((p+1)/R)*R from staging_k/v [Ns, H, D] rows staging_start_loc[s] +
    (pos - staging_pos0[s]); with R == 1 staging is not used (may be None).
    k_levels/v_levels: codebooks of nuq codecs (as write_cache). sliding_window W > 0: a
    query at position p sees keys (p - W, p] only; earlier blocks are never read.
    logits_soft_cap c > 0: each logit x becomes c * tanh(x / c) (Gemma 2).
    """
    _check_float("query", query)
    if query.dim() != 3:
        _fail(f"query must be [T, Hq, D], got shape {tuple(query.shape)}")
    T, Hq, D = query.shape
    _check_cache(cache, fmt, D, None)
    H = cache.shape[1]
    if Hq % H:
        _fail(f"query heads Hq={Hq} must be a multiple of the cache's kv heads H={H}")
    if query.stride(-1) != 1:
        _fail("query last dim must be contiguous")
    _check_index("block_table", block_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    _check_index("query_start_loc", query_start_loc, 1)
    S = seq_lens.shape[0]
    if query_start_loc.shape[0] != S + 1:
        _fail(f"query_start_loc must have S+1={S + 1} entries, got {query_start_loc.shape[0]}")
    if block_table.shape[0] < S:
        _fail(f"block_table has {block_table.shape[0]} rows, need S={S}")
    softmax_scale = float(softmax_scale)
    if not softmax_scale > 0 or softmax_scale == float("inf"):
        _fail(f"softmax_scale={softmax_scale} must be finite and > 0")
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    if query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)

    R = fmt.residual_chunk
    dev = query.device
    if R == 1:
        staging_k = torch.empty(0, H, D, dtype=query.dtype, device=dev)
        staging_v = staging_k
        staging_start_loc = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        staging_pos0 = torch.zeros(S, dtype=torch.int32, device=dev)
    else:
        if staging_k is None or staging_v is None or staging_start_loc is None or \
                staging_pos0 is None:
            _fail(f"format {fmt.name!r} keeps the last <{R} tokens in full precision: "
                  f"staging_k, staging_v, staging_start_loc and staging_pos0 are required")
        for name, t in (("staging_k", staging_k), ("staging_v", staging_v)):
            _check_float(name, t)
            if t.dim() != 3 or t.shape[1] != H or t.shape[2] != D:
                _fail(f"{name} must be [Ns, H={H}, D={D}], got {tuple(t.shape)}")
            if t.stride(-1) != 1:
                _fail(f"{name} last dim must be contiguous")
        if staging_v.shape != staging_k.shape or staging_v.dtype != staging_k.dtype:
            _fail("staging_k and staging_v must have the same shape and dtype")
        _check_index("staging_start_loc", staging_start_loc, 1)
        _check_index("staging_pos0", staging_pos0, 1)
        if staging_start_loc.shape[0] < S or staging_pos0.shape[0] < S:
            _fail(f"staging_start_loc / staging_pos0 need S={S} entries")
        staging_start_loc = staging_start_loc.to(torch.int32)
        staging_pos0 = staging_pos0.to(torch.int32)
    ks = _static_scales(k_scale, fmt.key, H, "k_scale", cache.device)
    vs = _static_scales(v_scale, fmt.value, H, "v_scale", cache.device)
    kl = _levels(k_levels, fmt.key, "k_levels", fmt, cache.device)
    vl = _levels(v_levels, fmt.value, "v_levels", fmt, cache.device)
    if out is None:
        out = torch.zeros_like(query)
    else:
        if out.shape != query.shape or out.dtype != query.dtype:
            _fail(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} "
                  f"{out.dtype}")
        if out.stride(-1) != 1:
            _fail("out last dim must be contiguous")
    rotated = fmt.rotation != "none"
    keys = rotation.rotates_keys(fmt.rotation)
    fused = rotated and dev.type == "cpu"  # the CPU kernel rotates the query and the output
    dst = out
    if rotated:
        if R > 1:  # the kernel reads staging rows as given
            staging_k, staging_v = rotation.for_staging(staging_k, staging_v, keys, rot=rotate)
        if not fused:
            query, dst = (rotate(query) if keys else query), torch.zeros_like(query)
    _ops().paged_attention(dst, query, cache, block_table, seq_lens, query_start_loc,
                           staging_k, staging_v, staging_start_loc, staging_pos0, R,
                           sliding_window_for(fmt, sliding_window), softmax_scale,
                           soft_cap_for(logits_soft_cap), fmt.key.as_ints(),
                           fmt.value.as_ints(), ks, vs, kl, vl, *fused_rotation(fmt, D, fused))
    if rotated and not fused:
        n = int(query_start_loc[-1])  # only the rows the kernel wrote
        rotate(dst[:n], inverse=True, out=out[:n])
    return out


def fused_rotation(fmt: KVFormat, D: int, fused: bool = True) -> tuple:
    """The paged_attention op's trailing (rotation, rotation_sc) arguments: the CPU kernel
    rotates each query row as it loads it (a format rotating keys) and each output row back
    before rounding it (csrc/cpu/cpu_ops.h); () when the format is not rotated or not fused."""
    if fmt.rotation == "none" or not fused:
        return ()
    return (2 if rotation.rotates_keys(fmt.rotation) else 1), rotation.signed_scale(D)


def sliding_window_for(fmt: KVFormat, sliding_window: int | None) -> int:
    """The layer's sliding window W (0: none), checked against the format once: a query
    reads its last < R positions from the residual window's staging rows, so the window
    of full-precision tokens must fit in W. The backend calls this at engine start, the
    ops when they are bound."""
    W = int(sliding_window or 0)
    R = fmt.residual_tokens
    if W < 0:
        _fail(f"sliding_window={sliding_window} is not allowed; allowed: 0 (none) or a "
              f"window of at least {max(R, 1)} positions")
    if W and R > W:
        _fail(f"sliding_window={sliding_window}: kvq.method={fmt.name!r} keeps the last {R} "
              f"tokens in full precision, more than the model's sliding window of {W}; "
              f"choose kvq.residual_tokens <= {W}")
    return W


def soft_cap_for(logits_soft_cap: float | None) -> float:
    """The layer's logit soft-cap c (0.0: none), checked once: each logit x becomes
    c * tanh(x / c) (Gemma 2's attn_logit_softcapping)."""
    c = float(logits_soft_cap or 0.0)
    if not (c >= 0.0 and math.isfinite(c)):
        _fail(f"logits_soft_cap={logits_soft_cap} is not allowed; allowed: a finite value > 0, "
              f"or 0 / None for none")
    return c


class LayerOps:
    """One attention layer's kernels with everything but the step's tensors resolved once.

    Built once per layer (the backend's Impl, on its first step, when the device is known):
    the format is checked for this head size, the codec ints, static scales and nuq
    codebooks are prepared on the device. Per call nothing is validated or converted in
    Python (no host syncs, no lists): `write` and `attend` are the extension ops, whose
    C++ checks still reject what does not fit (block ids, slot groups, staging rows).
    """

    def __init__(self, fmt: KVFormat, num_kv_heads: int, head_dim: int, device,
                 k_scale=None, v_scale=None, k_levels=None, v_levels=None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        if head_dim not in SUPPORTED_HEAD_SIZES:
            _fail(f"head_dim={head_dim} is not allowed; allowed: "
                  f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}")
        _check_codec(fmt)
        self.fmt = fmt
        self.residual_chunk = fmt.residual_chunk
        self.sliding_window = sliding_window_for(fmt, sliding_window)
        self.logits_soft_cap = soft_cap_for(logits_soft_cap)
        self.k_codec, self.v_codec = fmt.key.as_ints(), fmt.value.as_ints()
        H = num_kv_heads
        self.k_scale = _static_scales(k_scale, fmt.key, H, "k_scale", device)
        self.v_scale = _static_scales(v_scale, fmt.value, H, "v_scale", device)
        self.k_levels = _levels(k_levels, fmt.key, "k_levels", fmt, device)
        self.v_levels = _levels(v_levels, fmt.value, "v_levels", fmt, device)
        # R == 1 reads no staging: the kernel only looks at these when staging_k has rows.
        self._no_rows = torch.empty(0, dtype=torch.int32, device=device)
        self._no_staging: dict = {}
        self._ops = _ops()
        # the op's one overload, bound once (the packet's __call__ is a Python frame per call)
        self._paged_attention = self._ops.paged_attention.default
        # rotated formats: K/V rotated before quantizing, the query and staging rows read
        # rotated and the output rotated back (vllm_kvq.rotation)
        self.rotated = fmt.rotation != "none"
        self.rotate_keys = rotation.rotates_keys(fmt.rotation)
        # on the CPU the paged kernel itself rotates the query and the output (one op call
        # per layer, as for other formats): attend's steps without a flash-prefill split
        self._fused_rot = fused_rotation(fmt, head_dim, torch.device(device).type == "cpu")

    def rotate_rows(self, key: torch.Tensor, value: torch.Tensor):
        """A rotated format's new key/value rows [N, H, D] as it stores them, in their dtype
        (keys as given for a values-only rotation); the rows as given for other formats.
        The backend rotates a step's tokens once with this when the format has a residual
        window: the window keeps its rows rotated, so neither the staging rows read every
        step nor the chunks quantized from them are rotated again (`rotated=True` below)."""
        if not self.rotated:
            return key, value
        return (rotate(key) if self.rotate_keys else key), rotate(value)

    def write(self, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
              slot_mapping: torch.Tensor, rotated: bool = False) -> None:
        """Quantize key/value [N, H, D] into their slots (N = len(slot_mapping)); rotated:
        the rows come from rotate_rows (a rotated format then quantizes them as they are)."""
        if self.rotated and not rotated:
            key, value = rotation.for_cache(key, value, self.rotate_keys, rot=rotate)
        self._ops.write_cache(key, value, cache, slot_mapping, self.k_codec, self.v_codec,
                              self.k_scale, self.v_scale, self.k_levels, self.v_levels)

    def attend(self, query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, softmax_scale: float,
               out: torch.Tensor, staging_k: torch.Tensor | None = None,
               staging_v: torch.Tensor | None = None,
               staging_start_loc: torch.Tensor | None = None,
               staging_pos0: torch.Tensor | None = None, split=None,
               staging_rotated: bool = False) -> torch.Tensor:
        """paged_attention's semantics; out [T, Hq, D] is written in place.
        staging_rotated: the staging rows come from rotate_rows (not rotated again).

        split (vllm_kvq.prefill.Split, CPU only): sequences [0, split.num_decodes) go to the
        paged kernel, the long prefills after them to the flash path (vllm_kvq.prefill);
        None: the paged kernel for the whole batch. A rotated format writes every row of
        out (the caller passes the step's rows, as the backend does)."""
        if self.rotated and not staging_rotated:
            staging_k, staging_v = rotation.for_staging(staging_k, staging_v, self.rotate_keys,
                                                        rot=rotate)
        if self._fused_rot or not self.rotated:  # the kernel rotates (CPU) or nothing to
            if split is None:  # a step of decodes / short chunks: one frame less per layer
                return self._kernel(query, cache, block_table, seq_lens, query_start_loc,
                                    softmax_scale, out, staging_k, staging_v,
                                    staging_start_loc, staging_pos0, self._fused_rot)
            return self._attend(query, cache, block_table, seq_lens, query_start_loc,
                                softmax_scale, out, staging_k, staging_v, staging_start_loc,
                                staging_pos0, split, self._fused_rot)
        query = rotate(query) if self.rotate_keys else query
        o = self._attend(query, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                         torch.empty_like(query), staging_k, staging_v, staging_start_loc,
                         staging_pos0, split)
        return rotate(o, inverse=True, out=out)

    def _attend(self, query, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                out, staging_k, staging_v, staging_start_loc, staging_pos0, split,
                fused_rot: tuple = ()):
        """fused_rot (a rotated format on the CPU, `fused_rotation`): the paged kernel
        rotates its query and output rows itself; the flash path's prefill rows are rotated
        around it here."""
        # sliding-window and soft-capped layers: the paged kernel for prefills too (it masks
        # per row and caps the logits; torch's flash attention does neither)
        if (split is None or query.device.type != "cpu" or self.sliding_window
                or self.logits_soft_cap):
            return self._kernel(query, cache, block_table, seq_lens, query_start_loc,
                                softmax_scale, out, staging_k, staging_v, staging_start_loc,
                                staging_pos0, fused_rot)
        nd, ndt = split.num_decodes, split.num_decode_tokens
        if nd:
            st = () if staging_k is None else (staging_k, staging_v,
                                               staging_start_loc[:nd + 1], staging_pos0[:nd])
            self._kernel(query[:ndt], cache, block_table[:nd], seq_lens[:nd],
                         query_start_loc[:nd + 1], softmax_scale, out[:ndt], *st,
                         fused_rot=fused_rot)
        from vllm_kvq.prefill import attend_prefills
        if not fused_rot:
            attend_prefills(self, query, cache, block_table, softmax_scale, out, staging_k,
                            staging_v, split)
            return out
        o = torch.empty_like(query)
        attend_prefills(self, rotate(query) if self.rotate_keys else query, cache, block_table,
                        softmax_scale, o, staging_k, staging_v, split)
        q1 = split.prefills[-1].q1 if split.prefills else ndt  # the rows it wrote
        rotate(o[ndt:q1], inverse=True, out=out[ndt:q1])
        return out

    def _kernel(self, query, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                out, staging_k=None, staging_v=None, staging_start_loc=None,
                staging_pos0=None, fused_rot: tuple = ()) -> torch.Tensor:
        if staging_k is None:
            staging_k = self._no_staging.get(query.dtype)
            if staging_k is None:
                staging_k = self._no_staging.setdefault(query.dtype, torch.empty(
                    0, cache.shape[1], query.shape[2], dtype=query.dtype, device=query.device))
            staging_v, staging_start_loc, staging_pos0 = staging_k, self._no_rows, self._no_rows
        self._paged_attention(out, query, cache, block_table, seq_lens, query_start_loc,
                              staging_k, staging_v, staging_start_loc, staging_pos0,
                              self.residual_chunk, self.sliding_window, softmax_scale,
                              self.logits_soft_cap, self.k_codec, self.v_codec, self.k_scale,
                              self.v_scale, self.k_levels, self.v_levels, *fused_rot)
        return out
