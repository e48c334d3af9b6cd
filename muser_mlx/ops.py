"""The operations the model graph calls. Each runs our kernel on Metal or CUDA, or the same
math as MLX array ops on the CPU (muser_mlx/dequant.py), on the same raw GGUF bytes."""

from __future__ import annotations

import functools
import logging
import math
import threading
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from muser_mlx import kernels
from muser_mlx.dequant import AFFINE_CODE_TYPES, affine_codes, dequantize_rows
from muser_mlx.formats import GGMLType, block_format

EMBEDDING_THREADGROUP = 256
DEQUANT_THREADGROUP = 256
MAX_GRID = 2**31 - 1


def check_token_ids(token_ids, vocab_size: int) -> mx.array:
    """Validate token ids on the host, before any kernel is built or run.

    Accepts a list, numpy array or mx.array of integers, shaped [T] or [B, T]. Returns them
    as an int32 mx.array. Raises ValueError naming the problem: wrong dtype or rank, no ids,
    or the first id outside 0..vocab_size-1 with its position.
    """
    if isinstance(token_ids, mx.array):
        if not mx.issubdtype(token_ids.dtype, mx.integer):
            raise ValueError(f"token ids must be integers, got an mx.array of {token_ids.dtype}")
        values = np.array(token_ids)
    else:
        values = np.asarray(token_ids)
        if values.size == 0:
            raise ValueError("no token ids given")
        if values.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {values.dtype} values")
    if values.ndim not in (1, 2):
        raise ValueError(f"token ids must be shaped [T] or [B, T], got shape {list(values.shape)}")
    if values.size == 0:
        raise ValueError("no token ids given")
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
        position = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"token id {int(values[position])} at position {list(position)} is outside the "
            f"vocabulary (size {vocab_size}: valid ids are 0..{vocab_size - 1})"
        )
    return mx.array(values.astype(np.int32))


def embedding(table, token_ids) -> mx.array:
    """Look up and dequantize rows of an embedding table.

    table: a GGUF tensor (`GGUFFile.tensors['token_embd.weight']`), GGUF shape [hidden, vocab]
    token_ids: [T] or [B, T] integers, validated here
    returns float32 [T, hidden] (or [B, T, hidden])
    """
    if len(table.shape) != 2:
        raise ValueError(f"embedding table {table.name!r} must be 2-D, has shape {list(table.shape)}")
    hidden, vocab = table.shape
    ids = check_token_ids(token_ids, vocab)
    return embedding_unchecked(table.data, ids, table.ggml_type, hidden, vocab)


def make_resident(array: mx.array) -> None:
    """On a CUDA GPU, move `array` into GPU memory now. MLX allocates CUDA memory as managed
    memory: pages the host wrote (the loader's copy of the file) move to the GPU when a kernel
    first touches them, a fault at a time. A weight read whole moves in the first step; the
    embedding table is read a row per token, so decode would fault on each new token's row
    (~0.2 ms a step, measured with bench/kernel_times.py). One reduction over the table at load
    moves it whole. Elsewhere (CPU, Metal's unified memory) it does nothing."""
    if kernels.backend() == "cuda":
        mx.eval(mx.max(array))


def embedding_unchecked(table_bytes: mx.array, ids: mx.array, ggml_type, hidden: int, vocab: int,
                        dtype=mx.float32):
    """The gather itself, with no host validation: an id outside the table reads row vocab-1
    (the kernel's clamp). embedding() validates first; tests call this to exercise the clamp.

    table_bytes: uint8 [vocab, row_bytes] (or flat); ids: int32 [...];
    returns [..., hidden] in `dtype` (float32, or float16 for a matmul's operand).
    """
    fmt = block_format(ggml_type)
    row_bytes = fmt.row_bytes(hidden)
    flat = ids.reshape(-1).astype(mx.int32)
    tokens = flat.shape[0]
    if kernels.backend() == "cpu":
        clamped = mx.minimum(flat.astype(mx.uint32), vocab - 1)
        rows = mx.take(table_bytes.reshape(vocab, row_bytes), clamped, axis=0)
        out = dequantize_rows(rows, fmt.ggml_type).astype(dtype)
    else:
        if tokens * hidden > MAX_GRID:
            raise ValueError(f"{tokens} tokens x {hidden} values exceed one launch; split the batch")
        (out,) = kernels.launch(
            "embedding",
            inputs=[table_bytes, flat],
            template=[
                ("FORMAT", int(fmt.ggml_type)),
                ("HIDDEN", hidden),
                ("ROW_BYTES", row_bytes),
                ("VOCAB", vocab),
            ],
            grid=(tokens * hidden, 1, 1),
            threadgroup=(EMBEDDING_THREADGROUP, 1, 1),
            output_shapes=[(tokens, hidden)],
            output_dtypes=[dtype],
        )
    return out.reshape(*ids.shape, hidden)


# ---------------------------------------------------------------------------------------------
# Linear layers straight from GGUF blocks
# ---------------------------------------------------------------------------------------------

MATVEC_MAX_TOKENS = 8  # up to this many rows of x, a decode matvec; beyond it, prefill
MATVEC_SIMD_GROUPS = 8  # SIMD groups (of 32 threads) per threadgroup, at most


class MatvecKernel(NamedTuple):
    """A dedicated decode kernel: its name, the output rows each threadgroup computes (its
    threads share their x loads across those rows), the most threads that split a row's units
    among them, and the values of a row in one unit (one thread's share per iteration)."""

    name: str
    rows: int
    threads: int
    unit: int


# Rows and threads chosen by `bench/linear.py --sweep` on the H200 (bench/RESULTS.md): the best
# or near-best over Muse Glimmer's decode shapes. Q8_0 measured best at 8 rows on large shapes
# (the 202048-row head: 549 vs 679 µs) and equal at 4 on Muse Glimmer's 512 k/v rows; it stays
# at 4, the configuration whose GPU tests passed first. Q4_K (session 6): 4 rows, up to 128
# threads; 8 or 16 rows with x held in registers measured no faster (occupancy fell to 17 %).
MATVEC_KERNELS = {GGMLType.Q4_K: MatvecKernel("matvec_q4k", 4, 128, 64),
                  GGMLType.Q6_K: MatvecKernel("matvec_q6k", 4, 128, 32),
                  GGMLType.Q8_0: MatvecKernel("matvec_q8_0", 4, 128, 32)}

# On the CPU, MLX's own quantized_matmul serves every format with one scale and bias per 32
# values: Q4_0/Q4_1 as 4-bit codes (GGUF's nibble order is a fixed permutation of MLX's within
# each block, see _cpu_affine), the rest as 8-bit codes unpacked per call (dequant.affine_codes).
_CPU_4BIT = (GGMLType.Q4_0, GGMLType.Q4_1)
# A CPU product is split into pieces of about this many weights along the output rows, and the
# pieces alternate between two CPU streams (MLX runs each stream on its own thread, so both
# cores work). A piece's unpacked codes or decoded f32 rows stay small. 2^19 measured best for
# SmolLM2 and Gemma 3 decode and prefill against 2^18 and 2^20 (bench/RESULTS.md, session 4).
CPU_PIECE = 1 << 19


_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _note_generic_matvec(ggml_type) -> None:
    _log.warning("%s weights have no dedicated decode kernel: the generic per-element matvec "
                 "serves them (several times slower than matvec_q4k/q6k/q8_0)", ggml_type.name)


def linear_path(ggml_type, tokens: int, backend: str | None = None) -> str:
    """Which implementation `linear` uses for a weight format and a number of rows of x.
    The one place this is decided."""
    backend = backend or kernels.backend()
    ggml_type = block_format(ggml_type).ggml_type
    if backend == "cpu":
        # MLX's CPU quantized_matmul handles one row well enough but many rows poorly; for a
        # prefill chunk, decoding the weight once and using the BLAS matmul is far faster.
        if ggml_type in AFFINE_CODE_TYPES and tokens <= MATVEC_MAX_TOKENS:
            return "cpu_affine_qmm"
        return "cpu_dequant_matmul"
    if tokens > MATVEC_MAX_TOKENS:
        return "gpu_dequant_matmul"
    if ggml_type in MATVEC_KERNELS:
        return MATVEC_KERNELS[ggml_type].name
    _note_generic_matvec(ggml_type)  # logged once per format: never a silent slow path
    return "matvec"


def linear(x, weight) -> mx.array:
    """x @ W.T for a GGUF weight kept as raw blocks.

    x: [..., in] float (f32, f16 or bf16); weight: GGUF tensor of GGUF shape [in, out]
    returns float32 [..., out].
    """
    if len(weight.shape) != 2:
        raise ValueError(f"weight {weight.name!r} must be 2-D, has shape {list(weight.shape)}")
    in_features, out_features = weight.shape
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"x of shape {list(x.shape)} does not fit weight {weight.name!r} "
            f"(GGUF shape [{in_features}, {out_features}]: x needs {in_features} features)"
        )
    lead = x.shape[:-1]
    x = x if x.dtype == mx.float32 else x.astype(mx.float32)
    path = linear_path(weight.ggml_type, math.prod(lead))
    fmt = block_format(weight.ggml_type)
    if path.startswith("matvec"):  # a decode kernel reads x as flat rows, writes [..., out]
        return _matvec(path, x, weight.data, fmt, in_features, out_features)
    out = _LINEAR_PATHS[path](x.reshape(-1, in_features), weight.data, fmt, in_features, out_features)
    return out.reshape(*lead, out_features)


def _matvec(name, x, weight_bytes, fmt, in_features, out_features):
    """Launch matvec kernel `name` (chosen by linear_path) over a few rows of x [..., in];
    returns [..., out]."""
    tokens = math.prod(x.shape[:-1])
    template = [("IN", in_features), ("ROW_BYTES", fmt.row_bytes(in_features)),
                ("OUT", out_features), ("TOKENS", tokens)]
    if name == "matvec":
        # One SIMD group per output row, MATVEC_SIMD_GROUPS rows per threadgroup.
        template.insert(0, ("FORMAT", int(fmt.ggml_type)))
        threads, groups = 32 * MATVEC_SIMD_GROUPS, -(-out_features // MATVEC_SIMD_GROUPS)
    else:
        # One threadgroup per ROWS output rows; its threads split the row's units, as many
        # SIMD groups as there are units for (a short row needs fewer).
        kernel = MATVEC_KERNELS[fmt.ggml_type]
        template.append(("ROWS", kernel.rows))
        units = in_features // kernel.unit
        threads = min(kernel.threads, 32 * MATVEC_SIMD_GROUPS, 32 * -(-units // 32))
        groups = -(-out_features // kernel.rows)
    (out,) = kernels.launch(
        name,
        inputs=[weight_bytes, x],
        template=template,
        grid=(threads * groups, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*x.shape[:-1], out_features)],
        output_dtypes=[mx.float32],
    )
    return out


def residual_norm(residual: mx.array, branch: mx.array, branch_weight, next_weight: mx.array,
                  branch_eps: float, next_eps: float) -> tuple[mx.array, mx.array]:
    """The seam between two branches of a decoder layer:

        sum    = residual + rms(branch, branch_eps) * branch_weight   (branch_weight given:
                                                                        a sandwich post-norm)
        sum    = residual + branch                                    (branch_weight None)
        normed = rms(sum, next_eps) * next_weight

    residual, branch: float32 [..., hidden]; weights: float32 [hidden]. Returns (sum, normed).
    MLX's own ops on every backend: a fused kernel for this seam measured slower on the H200
    (bench/RESULTS.md, session 3), so it did not replace them.
    """
    branch = branch.astype(mx.float32)
    if branch_weight is not None:
        branch = mx.fast.rms_norm(branch, branch_weight, branch_eps)
    total = residual + branch
    return total, mx.fast.rms_norm(total, next_weight, next_eps)


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


def dequantize_weight(weight_bytes: mx.array, ggml_type, in_features: int, out_features: int,
                      dtype=mx.float32) -> mx.array:
    """Every row of a GGUF matrix decoded: [out, in] in `dtype` (kernel dequant_rows on a GPU,
    dequant.dequantize_rows on the CPU)."""
    fmt = block_format(ggml_type)
    if kernels.backend() == "cpu":
        return dequantize_rows(weight_bytes.reshape(out_features, -1), fmt.ggml_type).astype(dtype)
    threads = out_features * -(-in_features // 256) * 32  # a SIMD group per 256 values
    if threads > MAX_GRID:
        raise ValueError(f"{out_features} rows of {in_features} values exceed one launch")
    (values,) = kernels.launch(
        "dequant_rows",
        inputs=[weight_bytes],
        template=[("FORMAT", int(fmt.ggml_type)), ("IN", in_features),
                  ("ROW_BYTES", fmt.row_bytes(in_features)), ("OUT", out_features)],
        grid=(threads, 1, 1),
        threadgroup=(DEQUANT_THREADGROUP, 1, 1),
        output_shapes=[(out_features, in_features)],
        output_dtypes=[dtype],
    )
    return values


def _gpu_dequant_matmul(rows, weight_bytes, fmt, in_features, out_features):
    # Prefill: decode the weight once per call (its cost is shared by all T rows), then the
    # backend's f16 matmul does the arithmetic.
    weight = dequantize_weight(weight_bytes, fmt.ggml_type, in_features, out_features, mx.float16)
    return (rows.astype(mx.float16) @ weight.T).astype(mx.float32)


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


_LINEAR_PATHS = {
    "gpu_dequant_matmul": _gpu_dequant_matmul,
    "cpu_dequant_matmul": _cpu_dequant_matmul,
    "cpu_affine_qmm": _cpu_affine,
}
