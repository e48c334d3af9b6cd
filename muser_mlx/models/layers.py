"""The pieces every step builds a decoder layer from, defined once.

A layer is the same four moves in every step (`decoder_layer`): attention, the seam (the
branch's sandwich post-norm, the residual add, the next norm), the gated feed-forward, the
seam again. The general step (transformer.py: any number of tokens), the fused GPU decode step
(gpu_decode.py) and the CPU decode step (cpu_decode.py) each give that skeleton their own
`attention`, `seam` and `feed_forward` (a `LayerPieces`); the weights are the same modules.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from muser_mlx import gguf, ops
from muser_mlx.dequant import dequantize_rows


def vector(tensor) -> mx.array:
    """A 1-D GGUF tensor (norm weight, bias) decoded to float32 [n]."""
    return dequantize_rows(tensor.data, tensor.ggml_type).reshape(-1)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x / sqrt(mean(x²) + eps) · weight, in float32 (an eps of 1e-8 vanishes in float16)."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps)


class LayerPieces(Protocol):
    """What a step supplies for `decoder_layer`; `state` is whatever its attention carries (a
    cache object, or the cache arrays and the position)."""

    def attention(self, index: int, block, h, state): ...  # -> (branch [.., hidden], state)

    def seam(self, x, branch, branch_weight, next_weight): ...  # -> (x, h)

    def feed_forward(self, index: int, block, h): ...  # -> branch [.., hidden]


def decoder_layer(pieces: LayerPieces, index: int, block, x, h, next_norm: mx.array, state):
    """Layer `index` (its weights `block`): x the residual stream, h it normed for attention.
    Returns (x, h normed by `next_norm`: the next layer's attn_norm or output_norm, state)."""
    a, state = pieces.attention(index, block, h, state)
    x, h = pieces.seam(x, a, block.post_attention_norm, block.ffn_norm)
    f = pieces.feed_forward(index, block, h)
    x, h = pieces.seam(x, f, block.post_ffw_norm, next_norm)
    return x, h, state


def _columns(y: mx.array, first: int, width: int) -> mx.array:
    """Columns first .. first + width - 1 of y: y itself when it is that wide, else a view."""
    return y if y.shape[-1] == width else y[..., first : first + width]


class Linear(nn.Module):
    """y = x W.T (+ b) with W kept as the GGUF tensor's raw blocks."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight_tensor = weight  # a GGUFTensor: not an MLX parameter, its bytes stay raw
        if bias is not None:
            self.bias = vector(bias)

    def __call__(self, x: mx.array, keep_float16: bool = False) -> mx.array:
        """keep_float16: as ops.linear's (with a bias, float32 either way)."""
        y = ops.linear(x, self.weight_tensor, keep_float16=keep_float16)
        return y + self.bias if "bias" in self else y

    @property
    def nbytes(self) -> int:
        return self.weight_tensor.nbytes


class Projections(nn.Module):
    """Several projections of one input, as few products as their formats allow: the weights
    of each format are stacked into one array of rows (gguf.stack_rows, still raw blocks) and
    multiplied at once, then the output is split. A decode step is launch-bound as much as
    byte-bound, so q/k/v/gate become one to three products, FFN gate/up one.

    parts: name -> (weight GGUFTensor, bias GGUFTensor or None); calling returns name -> y."""

    def __init__(self, parts: dict):
        super().__init__()
        by_type = {}
        for name, (weight, _) in parts.items():
            by_type.setdefault((weight.ggml_type, weight.shape[0]), []).append(name)
        self.groups = []  # (stacked weight, names, split offsets)
        for names in by_type.values():
            weights = [parts[n][0] for n in names]
            stacked = gguf.stack_rows(weights) if len(weights) > 1 else weights[0]
            offsets = list(itertools.accumulate(w.rows for w in weights))[:-1]
            self.groups.append((stacked, names, offsets))
        self.biases = {n: vector(b) for n, (_, b) in parts.items() if b is not None}
        self.widths = {n: weight.rows for n, (weight, _) in parts.items()}
        # Where each part lands in the concatenated output of all groups (the decode steps').
        self.offsets, start = {}, 0
        for stacked, names, _ in self.groups:
            for name in names:
                self.offsets[name] = start
                start += parts[name][0].rows

    @property
    def stacks(self) -> list:
        """The stacked weights, one product each, in output order."""
        return [stacked for stacked, _, _ in self.groups]

    def __call__(self, x: mx.array, keep_float16: bool = False) -> dict:
        """name -> y [..., rows of its weight]; keep_float16: as ops.linear's (a part with a bias
        is float32 either way)."""
        return self.parts(self.columns(x, keep_float16))

    @staticmethod
    def parts(columns: dict) -> dict:
        """name -> y [..., width] from what `columns` returns (a view of the part's columns)."""
        return {name: _columns(*part) for name, part in columns.items()}

    def columns(self, x: mx.array, keep_float16: bool = False) -> dict:
        """name -> (its group's output, the part's first column, its width): for an op that
        reads a part's columns in place (ops.qk_norm_rope) rather than a copy of them. A part
        with a bias is its own array (the sum), from column 0."""
        out = {}
        for stacked, names, offsets in self.groups:
            y = ops.linear(x, stacked, keep_float16=keep_float16)
            for name, first in zip(names, [0, *offsets]):
                out[name] = (y, first, self.widths[name])
        for name, bias in self.biases.items():
            y, first, width = out[name]
            out[name] = (_columns(y, first, width) + bias, 0, width)
        return out

    @property
    def nbytes(self) -> int:
        return sum(stacked.nbytes for stacked in self.stacks)
