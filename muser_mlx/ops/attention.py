"""The tail of the q/k/v projections: head split, per-head norm, RoPE."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from muser_mlx import kernels


def split_heads(y: mx.array, heads: int, head_dim: int, weight: mx.array | None = None,
                eps: float = 0.0, rope: dict | None = None, start: int = 0) -> mx.array:
    """A projection's output [B, T, heads * head_dim] as heads [B, heads, T, head_dim], each
    RMS-normed by `weight` if given, then rotated by RoPE if `rope` (dict(dims, base,
    traditional)) is given, from position `start`. MLX's own ops."""
    batch, tokens, _ = y.shape
    y = y.reshape(batch, tokens, heads, head_dim).transpose(0, 2, 1, 3)
    if weight is not None:
        y = mx.fast.rms_norm(y, weight, eps)
    if rope is not None:
        y = mx.fast.rope(y, rope["dims"], traditional=rope["traditional"], base=rope["base"],
                         scale=1.0, offset=start)
    return y


def qk_norm_rope(q: mx.array, k: mx.array, q_weight: mx.array, k_weight: mx.array, heads: int,
                 kv_heads: int, head_dim: int, eps: float, start: int, rope: dict | None):
    """Per-head RMS norm of the q and k projections, then RoPE, as attention wants them.

    q: [B, T, heads * head_dim], k: [B, T, kv_heads * head_dim] float32; weights [head_dim];
    start: the position of row 0; rope: None (no rotation) or dict(dims, base, traditional).
    Returns q [B, heads, T, head_dim] and k [B, kv_heads, T, head_dim]: on a GPU from one
    launch of kernel qk_norm_rope, on the CPU from MLX's rms_norm and rope.
    """
    batch, tokens, _ = q.shape
    if kernels.backend() == "cpu":
        return qk_norm_rope_mlx(q, k, q_weight, k_weight, heads, kv_heads, head_dim, eps, start, rope)
    dims = rope["dims"] if rope is not None else 0
    q_out, k_out = kernels.launch(
        "qk_norm_rope",
        inputs=[q, k, q_weight, k_weight, _inverse_frequencies(dims, rope["base"] if rope else 0.0),
                mx.array([start], dtype=mx.int32), _scalar(eps)],
        template=[("HEADS", heads), ("KV_HEADS", kv_heads), ("HEAD_DIM", head_dim), ("ROTARY", dims),
                  ("TRADITIONAL", int(bool(rope and rope["traditional"])))],
        grid=(32 * batch * tokens * (heads + kv_heads), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(batch, heads, tokens, head_dim), (batch, kv_heads, tokens, head_dim)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return q_out, k_out


def qk_norm_rope_mlx(q: mx.array, k: mx.array, q_weight: mx.array, k_weight: mx.array, heads: int,
                     kv_heads: int, head_dim: int, eps: float, start: int, rope: dict | None):
    """qk_norm_rope as MLX's own ops (split, rms_norm, rope, for q and k): its CPU rendering,
    and on a GPU what the fused kernel is measured against (bench/decode.py)."""
    return (split_heads(q, heads, head_dim, q_weight, eps, rope, start),
            split_heads(k, kv_heads, head_dim, k_weight, eps, rope, start))


@functools.lru_cache(maxsize=None)
def _inverse_frequencies(dims: int, base: float) -> mx.array:
    """RoPE's base^(-2i / dims) for i < dims / 2, float32 (one dummy value when dims is 0)."""
    if dims == 0:
        return mx.zeros((1,))
    return mx.array((base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _scalar(value: float) -> mx.array:
    return mx.array([value], dtype=mx.float32)
