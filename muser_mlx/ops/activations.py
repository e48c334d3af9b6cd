"""Activations as int8 blocks (q8x): the input format of the GPU decode products.

A product reads each weight byte once; with float32 x it also read 4 bytes of x per value for
every few rows, which bound the kernels by L1 traffic, not by DRAM (bench/history/session-06.md). As q8x, x is 1.625 bytes a value (the code, a 32nd of a scale, an 8th of a sum) and the
products multiply codes by codes (dp4a). x is converted once per input, by the kernel that
produced it (the seams, the attention's second pass, the FFN's gate/up product) or by
`quantize_rows`, and shared by every product that reads it. formats.quantize_activations is the numpy reference; formats.py states its error.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from muser_mlx import kernels
from muser_mlx.formats import Q8X_BLOCK, Q8X_SUM, Q8X_WOVEN_UNIT, woven_positions


class Q8X(NamedTuple):
    """x [..., n] as codes int8 [..., n], scales f32 [..., n/32] (max |x| / 127 per 32
    values) and sums f32 [..., n/8] (scale * the sum of each 8 codes)."""

    codes: mx.array
    scales: mx.array
    sums: mx.array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequantize(self) -> mx.array:
        """float32 [..., n]: code * scale, the values the products multiply by."""
        blocks = self.codes.astype(mx.float32).reshape(*self.codes.shape[:-1], -1, Q8X_BLOCK)
        return (blocks * self.scales[..., None]).reshape(self.codes.shape)


def q8x_shapes(lead: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """The shapes of a Q8X of x [*lead, n]: codes, scales, sums."""
    return [(*lead, n), (*lead, n // Q8X_BLOCK), (*lead, n // Q8X_SUM)]


Q8X_DTYPES = [mx.int8, mx.float32, mx.float32]

# A gated FFN's activations (the kernels' ACTIVATION constant).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def quantize_rows(x: mx.array) -> Q8X:
    """x [..., n] float (n a multiple of 32) as q8x: kernel quantize_rows on a GPU, the same
    arithmetic as MLX ops on the CPU (round half away from zero, as the kernels' round)."""
    n = x.shape[-1]
    if n % Q8X_BLOCK:
        raise ValueError(f"activations of {n} values are not whole {Q8X_BLOCK}-value blocks")
    lead = tuple(x.shape[:-1])
    x = x.astype(mx.float32)
    if kernels.backend() == "cpu":
        return quantize_rows_mlx(x)
    rows = x.reshape(-1, n)
    codes, scales, sums = kernels.launch(
        "quantize_rows",
        inputs=[rows],
        template=[("IN", n), ("GLU", 0), ("ACTIVATION", 0), ("CHUNKS", 1)],
        grid=(rows.shape[0] * n, 1, 1),  # a SIMD group per 32 values
        threadgroup=(256, 1, 1),
        output_shapes=q8x_shapes(lead, n),
        output_dtypes=Q8X_DTYPES,
    )
    return Q8X(codes, scales, sums)


def glu_quantize_rows(halves: mx.array, activation: str) -> Q8X:
    """A gated FFN's f = act(gate) * up as q8x [rows, n], from its two halves as a tile product
    writes them unsummed: halves float32 [chunks, rows, 2n] (gate's n columns, then up's; the
    chunks' partial sums added here). Kernel quantize_rows' GLU 1 on a GPU; MLX ops on the CPU."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if halves.ndim != 3 or halves.shape[-1] % (2 * Q8X_BLOCK) or 0 in halves.shape:
        raise ValueError(f"glu_quantize_rows: halves must be [chunks, rows, 2n] with n whole {Q8X_BLOCK}-value "
                         f"blocks, got {list(halves.shape)}")
    chunks, rows, width = halves.shape
    n = width // 2
    halves = halves.astype(mx.float32)
    if kernels.backend() == "cpu":
        summed = halves.sum(axis=0)
        return quantize_rows_mlx(glu(summed[:, :n], summed[:, n:], activation))
    codes, scales, sums = kernels.launch(
        "quantize_rows",
        inputs=[halves],
        template=[("IN", n), ("GLU", 1), ("ACTIVATION", ACTIVATIONS[activation]), ("CHUNKS", chunks)],
        grid=(rows * n, 1, 1),  # a SIMD group per 32 values of f
        threadgroup=(256, 1, 1),
        output_shapes=q8x_shapes((rows,), n),
        output_dtypes=Q8X_DTYPES,
    )
    return Q8X(codes, scales, sums)


def quantize_rows_mlx(x: mx.array) -> Q8X:
    """The CPU rendering of quantize_rows (and of every kernel's quantizing epilogue)."""
    n = x.shape[-1]
    blocks = x.astype(mx.float32).reshape(*x.shape[:-1], -1, Q8X_BLOCK)
    scales = mx.max(mx.abs(blocks), axis=-1) / 127.0
    safe = mx.where(scales > 0, scales, 1.0)[..., None]
    ratio = blocks / safe
    codes = mx.where(scales[..., None] > 0, mx.sign(ratio) * mx.floor(mx.abs(ratio) + 0.5), 0.0)
    sums = codes.reshape(*x.shape[:-1], -1, Q8X_BLOCK // Q8X_SUM, Q8X_SUM).sum(axis=-1) * scales[..., None]
    return Q8X(codes.astype(mx.int8).reshape(x.shape), scales,
               sums.reshape(*x.shape[:-1], n // Q8X_SUM))


@functools.lru_cache(maxsize=None)
def _woven_order(n: int, woven: bool) -> tuple[mx.array, mx.array]:
    """Gather indices for x [..., n]'s codes and sums: into the woven layout, or back from it."""
    code_at = woven_positions(n, Q8X_WOVEN_UNIT, 16)
    sum_at = woven_positions(n // Q8X_SUM, Q8X_WOVEN_UNIT // Q8X_SUM, 4)
    if woven:
        code_at, sum_at = np.argsort(code_at), np.argsort(sum_at)
    return mx.array(code_at.astype(np.int32)), mx.array(sum_at.astype(np.int32))


class WovenQ8X(Q8X):
    """A Q8X whose codes and sums are in q8x's woven layout (`weave`, formats.woven_positions):
    what attention_combine writes for a Product made with woven=True. Such a Product refuses a
    plain Q8X, and every other product refuses this one."""

    __slots__ = ()

    def dequantize(self) -> mx.array:
        return weave(self, woven=False).dequantize()


def weave(x: Q8X, woven: bool = True) -> Q8X:
    """x's codes and sums in q8x's woven layout as a WovenQ8X (n a multiple of 64), or
    (woven=False) a WovenQ8X back in the plain one: the CPU rendering of what attention_combine
    writes for kernel product's WOVEN, and how that product's CPU rendering reads it."""
    n = x.shape[-1]
    if n % Q8X_WOVEN_UNIT:
        raise ValueError(f"activations of {n} values are not whole {Q8X_WOVEN_UNIT}-value units to weave")
    if isinstance(x, WovenQ8X) == woven:
        raise ValueError(f"weave: x is {'already' if woven else 'not'} woven")
    code_order, sum_order = _woven_order(n, woven)
    return (WovenQ8X if woven else Q8X)(mx.take(x.codes, code_order, axis=-1), x.scales,
                                       mx.take(x.sums, sum_order, axis=-1))


def gelu_tanh(x: mx.array) -> mx.array:
    """gelu with tanh's approximation, as the kernel computes it."""
    return 0.5 * x * (1.0 + mx.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def glu(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    """act(gate) * up, act silu or gelu_tanh, as MLX ops (kernel product_tiles' GLU 1 math)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return (gate * mx.sigmoid(gate) if activation == "silu" else gelu_tanh(gate)) * up
