"""Token embedding: host validation of ids, and the gather + dequantization of table rows
(kernel `embedding` on a GPU, dequant.dequantize_rows on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from muser_mlx import kernels
from muser_mlx.dequant import dequantize_rows
from muser_mlx.formats import block_format
from muser_mlx.kernels import MAX_GRID

EMBEDDING_THREADGROUP = 256


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
