"""Norms at the seams of a decoder layer."""

from __future__ import annotations

import math

import mlx.core as mx

from muser_mlx import cpu_ext, kernels
from muser_mlx.ops.activations import Q8X, Q8X_DTYPES, q8x_shapes, quantize_rows_mlx


# residual_norm_quant's launch: a token's row is cut into slices of SEAM_SLICE_BLOCKS 32-value
# blocks, one threadgroup of SEAM_THREADS threads each (on its own SM; each one sums the whole
# row itself). 16 blocks make 13 threadgroups for a hidden size of 6656. The kernel needs
# SEAM_SLICE_BLOCKS * 8 <= SEAM_THREADS (a thread holds 4 values of its slice).
SEAM_SLICE_BLOCKS = 16
SEAM_THREADS = 256
# From SEAM_WIDE_FROM rows on (a batched step's), the rows themselves fill the GPU: a row takes
# as few slices as threadgroups of at most 1,024 threads hold (SEAM_WIDE_BLOCKS blocks each),
# so that the slices' reads of the whole row repeat less: 64 rows of 6,656 values, 5 chunks,
# read ~155 MB from L2 in 13 slices, ~24 MB in 2 of 104 blocks (832 threads)
# (bench/history/session-48.md).
SEAM_WIDE_FROM = 9
SEAM_WIDE_BLOCKS = 128
# residual_norm on a GPU: kernel residual_norm_rows, one launch a seam, a threadgroup a row, of
# at least ROWS_THREADS threads and more while a thread would hold over ROWS_PER_THREAD values.
ROWS_THREADS = 256
ROWS_PER_THREAD = 32


def seam_shape(hidden: int, rows: int) -> tuple[int, int]:
    """(blocks a slice, threads a threadgroup) of residual_norm_quant for `rows` rows."""
    if rows < SEAM_WIDE_FROM:
        return SEAM_SLICE_BLOCKS, SEAM_THREADS
    blocks = hidden // 32
    slices = -(-blocks // SEAM_WIDE_BLOCKS)
    per = -(-blocks // slices)
    return per, -(-per * 8 // 32) * 32


def residual_norm(residual: mx.array, branch: mx.array, branch_weight, next_weight: mx.array,
                  branch_eps: float, next_eps: float) -> tuple[mx.array, mx.array]:
    """The seam between two branches of a decoder layer:

        sum    = residual + rms(branch, branch_eps) * branch_weight   (branch_weight given:
                                                                        a sandwich post-norm)
        sum    = residual + branch                                    (branch_weight None)
        normed = rms(sum, next_eps) * next_weight                     (next_weight None: sum,
                                                                        for a branch without
                                                                        a pre-norm: OLMo 2)

    residual: float32 [..., hidden]; branch: [..., hidden], float32 (or, on a GPU, float16: a
    prefill product's output as it is); weights: float32 [hidden]. Returns (sum, normed), float32.
    On the CPU the compiled primitive (cpu_ext.residual_norm, the CPU decode step's), where MLX's
    ops took ~0.7 ms a Gemma 3 layer of a 128-token prompt; on a GPU kernel residual_norm_rows,
    one launch where MLX's ops took four (a prefill chunk's host builds every launch, and was
    its bound); elsewhere MLX's ops.
    """
    if kernels.backend() == "cpu" and cpu_ext.available():
        shape, hidden = branch.shape, branch.shape[-1]
        total, normed = cpu_ext.residual_norm(residual.reshape(-1, hidden), branch.reshape(-1, hidden),
                                              branch_weight, next_weight, branch_eps, next_eps)
        return total.reshape(shape), normed.reshape(shape)
    if kernels.backend() != "cpu":
        return _residual_norm_rows(residual, branch, branch_weight, next_weight, branch_eps, next_eps)
    branch = branch.astype(mx.float32)
    if branch_weight is not None:
        branch = mx.fast.rms_norm(branch, branch_weight, branch_eps)
    total = residual + branch
    return total, total if next_weight is None else mx.fast.rms_norm(total, next_weight, next_eps)


def _residual_norm_rows(residual, branch, branch_weight, next_weight, branch_eps, next_eps):
    """residual_norm as one launch of kernel residual_norm_rows over the rows of [..., hidden]."""
    hidden = branch.shape[-1]
    if residual.shape != branch.shape or residual.dtype != mx.float32:
        raise ValueError(f"residual_norm: residual {residual.dtype} {list(residual.shape)} and branch "
                         f"{list(branch.shape)} must have one shape, the residual float32")
    if branch.dtype not in (mx.float16, mx.float32):
        raise ValueError(f"residual_norm: branch must be float16 or float32, got {branch.dtype}")
    rows = math.prod(branch.shape[:-1])
    threads = ROWS_THREADS
    while threads < 1024 and -(-hidden // threads) > ROWS_PER_THREAD:
        threads *= 2
    threads = min(threads, 32 * -(-hidden // 32))
    total, normed = kernels.launch(
        "residual_norm_rows",
        inputs=[residual.reshape(rows, hidden), branch.reshape(rows, hidden),
                *(weight if weight is not None else residual for weight in (branch_weight, next_weight)),
                kernels.parameters(branch_eps, next_eps)],
        template=[("HIDDEN", hidden), ("BRANCH_NORM", int(branch_weight is not None)),
                  ("NEXT_NORM", int(next_weight is not None)), ("THREADS", threads)],
        grid=(rows * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, hidden), (rows, hidden)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return total.reshape(branch.shape), normed.reshape(branch.shape)


def residual_norm_quant(residual: mx.array | None, branch: mx.array, branch_weight: mx.array | None,
                        next_weight: mx.array | None, branch_eps: float, next_eps: float,
                        branch_scale: float = 1.0, chunked: bool = False):
    """The seam of a decode step, ready for the next products (kernel residual_norm_quant):

        total  = residual + b * branch_scale      (residual None: total = b * branch_scale)
        b      = rms(branch, branch_eps) * branch_weight   (branch_weight None: b = branch)
        normed = rms(total, next_eps) * next_weight, as q8x   (next_weight None: total, as q8x)

    residual, branch: float32 [T, hidden] (T <= 8); weights float32 [hidden]. Returns (total,
    normed as ops.Q8X). The first seam of a step has no residual (the embedding row becomes
    the residual stream, normed without a weight by a model with embed_norm: pass ones).
    chunked: branch is [chunks, T, hidden], partial sums to add first (TileProduct's, unsummed)."""
    hidden = branch.shape[-1]
    chunks = branch.shape[0] if chunked else 1
    if chunked and branch.ndim != 3:
        raise ValueError(f"residual_norm_quant: a chunked branch is [chunks, T, hidden], got {list(branch.shape)}")
    if hidden % 32:
        raise ValueError(f"residual_norm_quant: hidden {hidden} is not a multiple of 32")
    if kernels.backend() == "cpu":
        b = (branch.sum(axis=0) if chunked else branch).astype(mx.float32)
        if branch_weight is not None:
            b = mx.fast.rms_norm(b, branch_weight, branch_eps)
        total = b * branch_scale if residual is None else residual + b * branch_scale
        return total, quantize_rows_mlx(total if next_weight is None else mx.fast.rms_norm(total, next_weight, next_eps))
    lead = tuple(branch.shape[1 if chunked else 0 : -1])
    slice_blocks, threads = seam_shape(hidden, math.prod(lead))
    if slice_blocks * 8 > threads or threads % 32 or threads > 1024:
        raise ValueError(f"residual_norm_quant: {threads} threads cannot hold a slice of "
                         f"{slice_blocks} blocks (8 threads a block, whole SIMD groups, at most 1024)")
    slices = -(-(hidden // 32) // slice_blocks)
    total, codes, scales, sums = kernels.launch(
        "residual_norm_quant",
        inputs=[(branch[0] if chunked else branch) if residual is None else residual, branch,
                *(weight if weight is not None else branch for weight in (branch_weight, next_weight)),
                kernels.parameters(branch_eps, next_eps, branch_scale)],
        template=[("HIDDEN", hidden), ("RESIDUAL", int(residual is not None)),
                  ("BRANCH_NORM", int(branch_weight is not None)), ("NEXT_NORM", int(next_weight is not None)),
                  ("SLICE_BLOCKS", slice_blocks), ("THREADS", threads), ("CHUNKS", chunks)]
        # CUDA: the registers capped to fit one threadgroup of the wide shape (up to 1,024 threads)
        + ([("LAUNCH_THREADS", threads), ("LAUNCH_MIN_THREADGROUPS", 1)] if threads > SEAM_THREADS else []),
        grid=(math.prod(lead) * slices * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*lead, hidden)] + q8x_shapes(lead, hidden),
        output_dtypes=[mx.float32] + Q8X_DTYPES,
    )
    return total, Q8X(codes, scales, sums)
