"""Products x @ W.T on the CPU, from raw GGUF blocks: the compiled primitive of cpu_ext.py
where it serves the format, else MLX's own ops."""

from __future__ import annotations

import threading

import mlx.core as mx

from muser_mlx import cpu_ext
from muser_mlx.dequant import affine_codes, dequantize_rows
from muser_mlx.formats import GGMLType

MATVEC_MAX_TOKENS = 8  # up to this many rows of x, a decode product (see linear.linear_path)

# On the CPU, MLX's own quantized_matmul serves every format with one scale and bias per 32
# values: Q4_0/Q4_1 as 4-bit codes (GGUF's nibble order is a fixed permutation of MLX's within
# each block, see _cpu_affine), the rest as 8-bit codes unpacked per call (dequant.affine_codes).
_CPU_4BIT = (GGMLType.Q4_0, GGMLType.Q4_1)
# A CPU product is split into pieces of about this many weights along the output rows, and the
# pieces alternate between two CPU streams (MLX runs each stream on its own thread, so both
# cores work). A piece's unpacked codes or decoded f32 rows stay small. 2^19 measured best for
# SmolLM2 and Gemma 3 decode and prefill against 2^18 and 2^20 (bench/history/session-04.md).
CPU_PIECE = 1 << 19


_thread = threading.local()


def _cpu_streams() -> tuple:
    """This thread's default CPU stream and a second one of its own (MLX streams belong to the
    thread that made them)."""
    if not hasattr(_thread, "cpu_streams"):
        _thread.cpu_streams = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    return _thread.cpu_streams


def _cpu_pieces(product, rows, weight_bytes, fmt, in_features, out_features):
    """product(rows, weight_bytes[a:b], fmt, in_features, b - a) over pieces of the weight's
    output rows, alternating between the two CPU streams; the pieces' outputs concatenated."""
    pieces = max(1, round(out_features * in_features / CPU_PIECE))
    step = -(-out_features // pieces)
    if step >= out_features:
        return product(rows, weight_bytes, fmt, in_features, out_features)
    parts = []
    for i, start in enumerate(range(0, out_features, step)):
        count = min(step, out_features - start)
        # The weight's unpacking waits for x: otherwise the second stream, which needs nothing
        # else, runs ahead through later layers' weights and holds all their temporaries.
        piece = mx.depends(weight_bytes[start : start + count], rows)
        with mx.stream(_cpu_streams()[i % 2]):
            parts.append(product(rows, piece, fmt, in_features, count))
    return mx.concatenate(parts, axis=-1)


def _dequant_matmul_piece(rows, weight_bytes, fmt, in_features, out_features):
    weight = dequantize_rows(weight_bytes.reshape(out_features, -1), fmt.ggml_type)  # [out, in]
    if rows.shape[0] <= MATVEC_MAX_TOKENS:
        return rows @ weight.T
    # MLX's CPU matmul is several times faster on a contiguous [in, out] operand than on a
    # transposed view (measured 44 vs 117 ms for 127 x 576 x 1536): pay one transpose copy.
    return rows @ mx.contiguous(weight.T)


def _qmm8_piece(rows, weight_bytes, fmt, in_features, out_features):
    """The blocks unpacked to 8-bit codes (dequant.affine_codes), through quantized_matmul."""
    codes, scale, bias = affine_codes(weight_bytes.reshape(out_features, -1), fmt.ggml_type)
    return mx.quantized_matmul(rows, codes.view(mx.uint32), scale, bias, transpose=True,
                               group_size=32, bits=8)


def _qmm4_piece(x_permuted, weight_bytes, fmt, in_features, out_features):
    """Q4_0 / Q4_1 as 4-bit codes on their own bytes; x comes permuted (see _cpu_affine), and
    only the quant bytes are copied out of their blocks."""
    blocks = weight_bytes.reshape(out_features, -1, fmt.type_size)
    d = blocks[..., 0:2].view(mx.float16).astype(mx.float32).squeeze(-1)
    if fmt.ggml_type == GGMLType.Q4_0:
        quants, bias = blocks[..., 2:18], -8.0 * d
    else:
        quants, bias = blocks[..., 4:20], blocks[..., 2:4].view(mx.float16).astype(mx.float32).squeeze(-1)
    packed = mx.contiguous(quants).reshape(out_features, -1).view(mx.uint32)
    return mx.quantized_matmul(x_permuted, packed, d, bias, transpose=True, group_size=32, bits=4)


def _cpu_dequant_matmul(rows, weight_bytes, fmt, in_features, out_features):
    return _cpu_pieces(_dequant_matmul_piece, rows, weight_bytes, fmt, in_features, out_features)


def _cpu_affine(rows, weight_bytes, fmt, in_features, out_features):
    """Formats with a scale and bias per 32 values, through mx.quantized_matmul.

    MLX packs a 32-value group's 4-bit codes with values 2k and 2k+1 in byte k; GGUF's Q4_0 and
    Q4_1 put values k and k+16 there. So rather than moving weight bytes, x is permuted within
    each block (x'[2k + j] = x[k + 16 j]), once for all pieces.
    """
    if fmt.ggml_type not in _CPU_4BIT:
        return _cpu_pieces(_qmm8_piece, rows, weight_bytes, fmt, in_features, out_features)
    x_permuted = rows.reshape(rows.shape[0], -1, 2, 16).swapaxes(-1, -2).reshape(rows.shape)
    return _cpu_pieces(_qmm4_piece, x_permuted, weight_bytes, fmt, in_features, out_features)


def _cpu_gguf_linear(rows, weight_bytes, fmt, in_features, out_features, rounded=False):
    return cpu_ext.linear(rows, weight_bytes, fmt.ggml_type, out_features, rounded=rounded)
