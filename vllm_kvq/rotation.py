"""Rotation before quantization: a seeded randomized Hadamard transform of each head.

R = diag(signs) . H_D / sqrt(D) (H_D the Sylvester Hadamard matrix, signs a fixed seeded
+-1 vector) is orthogonal, R R^T = I. A rotated format stores every key and value of a
head as x R (after RoPE: the backend sees post-RoPE keys); the query is rotated the same
way, so (q R) . (k R) = q . k, and the attention output, a weighted sum of rotated values,
is rotated back once: out = (P . V R) R^T. One large channel of a token is spread over all
D channels, so its per-token / per-group scale stops being set by that channel alone.
Data-free: the same matrix for every model, layer and head (the cache is only readable
with it, so the seed is fixed, not configurable).

Applied around the kernels by vllm_kvq.ops (write rotates K/V before quantizing; attend
rotates the query and the full-precision staging rows and un-rotates the output), and the
same way in vllm_kvq.reference: every kernel (CPU paths, CUDA) sees ordinary inputs.
"""
from __future__ import annotations

import torch

ROTATIONS = ("none", "hadamard")
HEAD_SIZES = (64, 128, 256)  # powers of two: the Sylvester construction
SEED = 0x4B5651

_MATRICES: dict = {}


def hadamard_matrix(D: int) -> torch.Tensor:
    """float32 [D, D]: diag(signs) . H_D / sqrt(D), orthogonal."""
    if D not in HEAD_SIZES:
        raise ValueError(f"a Hadamard rotation needs head_dim in {HEAD_SIZES}, got {D}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:  # H_2n = [[H, H], [H, -H]]
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    gen = torch.Generator().manual_seed(SEED + D)
    signs = torch.randint(0, 2, (D,), generator=gen).to(torch.float64) * 2 - 1
    return (signs[:, None] * H / D ** 0.5).to(torch.float32)


def matrix(D: int, device) -> torch.Tensor:
    """hadamard_matrix(D) on `device`, built once per (D, device)."""
    key = (D, str(device))
    if key not in _MATRICES:
        _MATRICES[key] = hadamard_matrix(D).to(device)
    return _MATRICES[key]


def rotate(x: torch.Tensor, R: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] -> x R in float32 math, returned as `dtype` (default x's), contiguous."""
    return (x.to(torch.float32) @ R).to(dtype or x.dtype)


def unrotate(y: torch.Tensor, R: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [..., D] -> y R^T (the inverse of rotate)."""
    return (y.to(torch.float32) @ R.T).to(dtype or y.dtype)


def for_cache(R: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Keys and values as a rotated format stores them: x R, float32 (quantized next)."""
    return rotate(key, R, torch.float32), rotate(value, R, torch.float32)


def for_attention(R: torch.Tensor, query: torch.Tensor, staging_k, staging_v):
    """The query and the full-precision staging rows (None: no staging) rotated in their
    dtypes, as the kernels of a rotated format read them; the output is unrotate()d."""
    if staging_k is not None:
        staging_k, staging_v = rotate(staging_k, R), rotate(staging_v, R)
    return rotate(query, R), staging_k, staging_v
