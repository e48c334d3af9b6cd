"""Linear layers straight from GGUF blocks: `linear`, and which implementation serves a
product (`linear_path`, the one place that is decided). The paths live beside it: the CPU's
compiled products (cpu_products.py), the GPU prefill's decode-then-matmul (dequantize.py), and
here the generic GPU matvec for a few rows of float x, any format (the general step; the fused
decode step's q8x products are gpu_products.py)."""

from __future__ import annotations

import contextlib
import contextvars
import math

import mlx.core as mx

from muser_mlx import cpu_ext, kernels
from muser_mlx.dequant import AFFINE_CODE_TYPES
from muser_mlx.formats import Q8X_BLOCK, block_format
from muser_mlx.ops.activations import quantize_rows_mlx
from muser_mlx.ops.cpu_products import (MATVEC_MAX_TOKENS, _cpu_affine, _cpu_dequant_matmul,
                                        _cpu_gguf_linear)
from muser_mlx.ops.dequantize import gpu_dequant_matmul

# The generic matvec's SIMD groups (of 32 threads, one an output row) per threadgroup.
MATVEC_SIMD_GROUPS = 8


def linear_path(ggml_type, tokens: int, backend: str | None = None) -> str:
    """Which implementation `linear` uses for a weight format and a number of rows of x.
    The one place this is decided."""
    backend = backend or kernels.backend()
    ggml_type = block_format(ggml_type).ggml_type
    if backend == "cpu":
        if ggml_type in cpu_ext.FORMATS:
            return "cpu_gguf_linear"  # the compiled primitive (muser_mlx/cpu_ext.py)
        cpu_ext.note_fallback(ggml_type)  # logged once per format
        # MLX's CPU quantized_matmul handles one row well enough but many rows poorly; for a
        # prefill chunk, decoding the weight once and using the BLAS matmul is far faster.
        if ggml_type in AFFINE_CODE_TYPES and tokens <= MATVEC_MAX_TOKENS:
            return "cpu_affine_qmm"
        return "cpu_dequant_matmul"
    return "gpu_dequant_matmul" if tokens > MATVEC_MAX_TOKENS else "matvec"


_ROUNDING = contextvars.ContextVar("muser_mlx_rounded_products", default=False)


@contextlib.contextmanager
def rounded_products(enabled: bool = True):
    """Within it (when `enabled`), every product the compiled CPU extension serves rounds its
    input as `linear(..., rounded=True)` does; other paths are unchanged. generate()'s prompt
    chunks on the CPU (generate.prefill), as llama.cpp's CPU prompt does: more than 8 rows run
    as integer panels, ~2x the float panels. A context variable: it holds for the thread (or
    task) that entered it and the graph built there."""
    token = _ROUNDING.set(enabled)
    try:
        yield
    finally:
        _ROUNDING.reset(token)


def linear(x, weight, rounded: bool = False, keep_float16: bool = False) -> mx.array:
    """x @ W.T for a GGUF weight kept as raw blocks.

    x: [..., in] float (f32, f16 or bf16); weight: GGUF tensor of GGUF shape [in, out]
    returns float32 [..., out].
    rounded: multiply x rounded to int8: the CPU's one-token decode step
    (models/cpu_decode.py); inside `rounded_products()` every product the CPU extension serves
    (generate()'s prompt chunks). The compiled CPU product rounds x itself, per 32 values for the
    32-value formats (q8_0, formats.quantize_activations) and per 256 for the K-quants (q8_K,
    formats.quantize_activations_super), and multiplies with integer dot products; any other
    path (no extension) rounds per 32 values and multiplies the rounded values.
    keep_float16: a GPU prefill product (path gpu_dequant_matmul) returns its matmul's float16
    output as it is, for a caller that converts it within its own next launch (a compiled
    elementwise op, the float16 KV cache): the same values, one launch fewer. Every other path
    returns float32 regardless.
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
    rounded = rounded or (path == "cpu_gguf_linear" and _ROUNDING.get())  # inside rounded_products()
    if rounded:
        if in_features % Q8X_BLOCK:
            raise ValueError(f"weight {weight.name!r}: {in_features} input features are not whole "
                             f"{Q8X_BLOCK}-value blocks, which a rounded product needs")
        if path == "cpu_gguf_linear":  # x [T, in] as the decode step has it: no reshape nodes
            rows = x if x.ndim == 2 else x.reshape(-1, in_features)
            out = _cpu_gguf_linear(rows, weight.data, fmt, in_features, out_features, rounded=True)
            return out if x.ndim == 2 else out.reshape(*lead, out_features)
        x = quantize_rows_mlx(x).dequantize()
    if path == "matvec":  # the kernel reads x as flat rows, writes [..., out]
        return _matvec(x, weight.data, fmt, in_features, out_features)
    out = _LINEAR_PATHS[path](x.reshape(-1, in_features), weight.data, fmt, in_features, out_features)
    # The GPU prefill's matmul gives float16 (the other paths float32: astype returns them as they are).
    return out.reshape(*lead, out_features) if keep_float16 else out.astype(mx.float32).reshape(*lead, out_features)


def _matvec(x, weight_bytes, fmt, in_features, out_features):
    """Kernel matvec over a few rows of float x [..., in] (one SIMD group per output row,
    MATVEC_SIMD_GROUPS rows per threadgroup); returns float32 [..., out]."""
    tokens = math.prod(x.shape[:-1])
    template = [("FORMAT", int(fmt.ggml_type)), ("IN", in_features), ("ROW_BYTES", fmt.row_bytes(in_features)),
                ("OUT", out_features), ("TOKENS", tokens)]
    threads, groups = 32 * MATVEC_SIMD_GROUPS, -(-out_features // MATVEC_SIMD_GROUPS)
    (out,) = kernels.launch(
        "matvec",
        inputs=[weight_bytes, x],
        template=template,
        grid=(threads * groups, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*x.shape[:-1], out_features)],
        output_dtypes=[mx.float32],
    )
    return out


_LINEAR_PATHS = {
    "gpu_dequant_matmul": gpu_dequant_matmul,
    "cpu_dequant_matmul": _cpu_dequant_matmul,
    "cpu_affine_qmm": _cpu_affine,
    "cpu_gguf_linear": _cpu_gguf_linear,
}
