"""Rotation before quantization: a seeded randomized Hadamard transform of each head.

R = diag(signs) . H_D / sqrt(D) (H_D the Sylvester Hadamard matrix, signs a fixed seeded
+-1 vector) is orthogonal, R R^T = I. A rotated format stores every key and value of a
head as x R (after RoPE: the backend sees post-RoPE keys); the query is rotated the same
way, so (q R) . (k R) = q . k, and the attention output, a weighted sum of rotated values,
is rotated back once: out = (P . V R) R^T. One large channel of a token is spread over all
D channels, so its per-token / per-group scale stops being set by that channel alone.
Data-free: the same matrix for every model, layer and head (the cache is only readable
with it, so the seed is fixed, not configurable).

Computed as a fast Walsh-Hadamard transform (D log2 D adds, not a D x D product), in fp32:
    x R   = fwht(x * sc)     x R^T = fwht(x) * sc      sc = signs / sqrt(D)
fwht's butterfly order is the definition the C++ op (torch.ops.vllm_kvq.hadamard,
csrc/cpu/hadamard_body.h) follows, so both round every value alike (bit-identical).

A format may rotate its values only ("hadamard_values", name suffix _rotv): then keys,
query and key staging rows are not rotated, the output still is.

Applied by vllm_kvq.ops: write rotates K/V before quantizing; attention reads the query
and the full-precision staging rows rotated and un-rotates the output. The CPU attention
kernel rotates the query rows and un-rotates the output rows itself, in fp32 (the
paged_attention op's `rotation` argument); CUDA's kernels see ordinary inputs, rotated
around them. vllm_kvq.reference does what the CPU kernel does. The serving path keeps a
residual window's rows rotated (ops.LayerOps.rotate_rows): a step rotates its new tokens
once, not the window's rows every step.
"""
from __future__ import annotations

import torch

# "hadamard": keys and values; "hadamard_values": values only, for formats whose keys are
# grouped per channel (KIVI, the nuq defaults): the rotation spreads the channel outliers
# those groups are built around over every channel (measured: nuq2 keys rotated KL +10%,
# values rotated -4%; reports/rotation/values-only).
ROTATIONS = ("none", "hadamard", "hadamard_values")
HEAD_SIZES = (64, 128, 256)  # powers of two: the Sylvester construction
SEED = 0x4B5651

_MATRICES: dict = {}
_SCALES: dict = {}


def _signs(D: int) -> torch.Tensor:
    if D not in HEAD_SIZES:
        raise ValueError(f"a Hadamard rotation needs head_dim in {HEAD_SIZES}, got {D}")
    gen = torch.Generator().manual_seed(SEED + D)
    return torch.randint(0, 2, (D,), generator=gen).to(torch.float64) * 2 - 1


def hadamard_matrix(D: int) -> torch.Tensor:
    """float32 [D, D]: R = diag(signs) . H_D / sqrt(D), orthogonal (for tests and reading)."""
    signs = _signs(D)
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:  # H_2n = [[H, H], [H, -H]]
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (signs[:, None] * H / D ** 0.5).to(torch.float32)


def matrix(D: int, device) -> torch.Tensor:
    """hadamard_matrix(D) on `device`, built once per (D, device): on a GPU one product
    (x R, fp32) is fewer launches than fwht's log2(D) stages (equal up to fp32 rounding)."""
    key = (D, str(device))
    if key not in _MATRICES:
        _MATRICES[key] = hadamard_matrix(D).to(device)
    return _MATRICES[key]


def signed_scale(D: int, device="cpu") -> torch.Tensor:
    """float32 [D]: signs / sqrt(D), on `device`, built once per (D, device)."""
    key = (D, str(device))
    if key not in _SCALES:
        _SCALES[key] = (_signs(D) / D ** 0.5).to(torch.float32).to(device)
    return _SCALES[key]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of the last dim (a power of two), float32:
    stages h = 1, 2, ..., D/2, each pairing elements i and i + h (bit h of i clear) into
    (x_i + x_{i+h}, x_i - x_{i+h}). x H_D, H_D the Sylvester matrix."""
    shape, D = x.shape, x.shape[-1]
    h = 1
    while h < D:
        y = x.reshape(-1, D // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(shape)


def rotate(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] -> x R in float32 math, returned as `dtype` (default x's), contiguous."""
    sc = signed_scale(x.shape[-1], x.device)
    return fwht(x.to(torch.float32) * sc).to(dtype or x.dtype)


def unrotate(y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [..., D] -> y R^T (the inverse of rotate)."""
    sc = signed_scale(y.shape[-1], y.device)
    return (fwht(y.to(torch.float32)) * sc).to(dtype or y.dtype)


def rotates_keys(rotation: str) -> bool:
    return rotation == "hadamard"


def for_cache(key: torch.Tensor, value: torch.Tensor, keys: bool = True, rot=rotate):
    """Keys and values as a rotated format stores them: x R in float32 (quantized next);
    the keys as given when `keys` is False (a values-only rotation). rot: the rotation's
    implementation (vllm_kvq.ops passes its C++ op)."""
    return (rot(key, torch.float32) if keys else key), rot(value, torch.float32)


def for_staging(staging_k, staging_v, keys: bool = True, rot=rotate):
    """The full-precision staging rows (None: no staging) rotated in their dtypes, as the
    kernels of a rotated format read them (a values-only rotation: the value rows only).
    The query is rotated by the CPU kernel itself (in fp32; around the kernel on CUDA) and
    the output unrotate()d."""
    if staging_k is None:
        return staging_k, staging_v
    return (rot(staging_k) if keys else staging_k), rot(staging_v)
