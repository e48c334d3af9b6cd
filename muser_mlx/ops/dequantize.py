"""The GPU prefill's products: each weight decoded to float16 by our kernels (dequant_spans,
dequant_rows, dequant_into), then multiplied by the backend's matmul; `dequantize_weight` also
serves any caller that wants a matrix's values."""

from __future__ import annotations

import mlx.core as mx

from muser_mlx import kernels
from muser_mlx.dequant import dequantize_rows
from muser_mlx.formats import block_format
from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops import pacer as pacing
from muser_mlx.settings import DEFAULT

DEQUANT_THREADGROUP = 256
# A prefill's weight pieces are whole multiples of this many rows.
PIECE_ROWS = 64


def dequantize_weight(weight_bytes: mx.array, ggml_type, in_features: int, out_features: int,
                      dtype=mx.float32) -> mx.array:
    """Every row of a GGUF matrix decoded: [out, in] in `dtype` (kernel dequant_spans, or
    dequant_rows for rows that are not whole 32-value blocks, on a GPU; dequant.dequantize_rows
    on the CPU)."""
    fmt = block_format(ggml_type)
    if kernels.backend() == "cpu":
        return dequantize_rows(weight_bytes.reshape(out_features, -1), fmt.ggml_type).astype(dtype)
    # dequant_spans stores 8 values at a time (16-byte stores): rows of whole 32-value blocks;
    # dequant_rows (a lane's values 32 apart, 2-byte stores) takes any row.
    kernel = "dequant_spans" if in_features % 32 == 0 else "dequant_rows"
    return launch_dequant(kernel, weight_bytes, ggml_type, in_features, out_features, dtype)


def launch_dequant(kernel: str, weight_bytes: mx.array, ggml_type, in_features: int, out_features: int,
                   dtype) -> mx.array:
    """Kernel `kernel` ("dequant_spans" or "dequant_rows": the same values) over a whole matrix:
    [out, in] in `dtype`. A SIMD group per 256 values of a row."""
    fmt = block_format(ggml_type)
    threads = out_features * -(-in_features // 256) * 32
    if threads > MAX_GRID:
        raise ValueError(f"{out_features} rows of {in_features} values exceed one launch")
    (values,) = kernels.launch(
        kernel,
        inputs=[weight_bytes],
        template=[("FORMAT", int(fmt.ggml_type)), ("IN", in_features),
                  ("ROW_BYTES", fmt.row_bytes(in_features)), ("OUT", out_features)],
        grid=(threads, 1, 1),
        threadgroup=(DEQUANT_THREADGROUP, 1, 1),
        output_shapes=[(out_features, in_features)],
        output_dtypes=[dtype],
    )
    return values


def dequantize_into(weight_bytes: mx.array, ggml_type, in_features: int, out_features: int,
                    target: mx.array, after: mx.array, x: mx.array) -> tuple[mx.array, mx.array]:
    """dequantize_weight's float16 rows written in place into `target` (kernel dequant_into),
    after the launch that produced `after` (the last reader of target's old values), and x
    converted to float16 in the same launch. Returns (target's first out * in values as
    [out, in], x16). A reader of those values must also read x16 (or an array computed from
    it): MLX orders launches by the buffers they read and write (on CUDA, the edges of its CUDA
    graphs), not by mx.depends, and it sees no write of target. GPU only; rows of whole 32-value
    blocks."""
    fmt = block_format(ggml_type)
    if kernels.backend() == "cpu":
        raise ValueError("dequantize_into writes a GPU buffer in place; the CPU has dequantize_weight")
    if in_features % 32:
        raise ValueError(f"dequantize_into takes rows of whole 32-value blocks, got {in_features} values a row")
    if target.dtype != mx.float16 or target.ndim != 1 or target.size < out_features * in_features:
        raise ValueError(f"dequantize_into's target must be float16 [>= {out_features} x {in_features}] flat, "
                         f"got {target.dtype} {list(target.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(f"dequantize_into's x has rows of {x.shape[-1]} values; the weight's are {in_features}")
    threads = max(out_features * -(-in_features // 256) * 32, x.size // 8)
    if threads > MAX_GRID:
        raise ValueError(f"{out_features} rows of {in_features} values exceed one launch")
    (x16,) = kernels.launch(
        "dequant_into",
        inputs=[weight_bytes, target, after, x.astype(mx.float32)],
        template=[("FORMAT", int(fmt.ggml_type)), ("IN", in_features),
                  ("ROW_BYTES", fmt.row_bytes(in_features)), ("OUT", out_features)],
        grid=(threads, 1, 1),
        threadgroup=(DEQUANT_THREADGROUP, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[mx.float16],
    )
    view = target if target.size == out_features * in_features else target[: out_features * in_features]
    return view.reshape(out_features, in_features), x16


def gpu_dequant_matmul(rows, weight_bytes, fmt, in_features, out_features):
    """A GPU prefill product: float32 rows [T, in] -> float16 [T, out]."""
    # Decode the weight once per call (its cost is shared by all T rows), then the backend's
    # f16 matmul does the arithmetic. A large weight goes in pieces of output rows
    # (Settings.prefill_piece_bytes of float16 each), each decoded, multiplied and queued on its
    # own; within ops.paced_products the pacer decides where pieces go and how many are queued.
    pacer = pacing.current()
    piece_bytes = (pacer.settings if pacer is not None else DEFAULT).prefill_piece_bytes
    x = rows.astype(mx.float16)
    piece = max(PIECE_ROWS, piece_bytes // (2 * in_features) // PIECE_ROWS * PIECE_ROWS)
    table = weight_bytes.reshape(out_features, -1) if piece < out_features else weight_bytes
    outs = []
    for first in range(0, out_features, piece):
        count = min(piece, out_features - first)
        temporary = 2 * count * in_features  # the float16 piece, alive until the GPU has run its matmul
        if pacer is not None:  # before the piece's buffer exists: MLX allocates it when encoding
            pacer.make_room(temporary)
        part = table if count == out_features else table[first:first + count]
        slot = pacer.slot() if pacer is not None and in_features % 32 == 0 else None
        if slot is not None and slot.values is not None and slot.values.size >= count * in_features:
            # The matmul reads x16, an output of the write into the slot: it follows that write.
            weight, x16 = dequantize_into(part, fmt.ggml_type, in_features, count, slot.values, slot.reader, rows)
            out = x16 @ weight.T
        else:
            weight = dequantize_weight(part, fmt.ggml_type, in_features, count, mx.float16)
            if slot is not None:  # this fresh array is the slot from now on
                slot.values = weight.reshape(-1)
            out = x @ weight.T
        if slot is not None:
            slot.reader = out
        if pacer is not None:
            pacer.queue(out, temporary)
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)  # float16: linear converts
