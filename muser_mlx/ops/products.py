"""Linear layers straight from GGUF blocks: which implementation serves a product
(`linear_path`), the GPU decode kernels, and the GPU prefill path (decode to f16, then the
backend's matmul). The CPU products live in cpu_products.py."""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import mlx.core as mx

from muser_mlx import kernels
from muser_mlx.dequant import AFFINE_CODE_TYPES, dequantize_rows
from muser_mlx.formats import GGMLType, block_format
from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops.activations import Q8X, Q8X_DTYPES, q8x_shapes, quantize_rows_mlx
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS, _cpu_affine, _cpu_dequant_matmul

DEQUANT_THREADGROUP = 256
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

# Formats the q8x product kernels read (blocks.metal: muser_load_x_unit / muser_unit_dot).
PRODUCT_FORMATS = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)
# Rows per SIMD group and SIMD groups per threadgroup of kernel product (and rows per SIMD group
# of product_glu, whose threadgroups hold 32 rows). Chosen by `bench/linear.py --sweep` on the
# H200 (bench/RESULTS.md).
PRODUCT_ROWS = 4
PRODUCT_SIMD_GROUPS = 4

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


# ---------------------------------------------------------------------------------------------
# Products of q8x activations (kernels product, product_glu, argmax)
# ---------------------------------------------------------------------------------------------


def _check_product(x: Q8X, weight, what: str) -> None:
    if len(weight.shape) != 2:
        raise ValueError(f"weight {weight.name!r} must be 2-D, has shape {list(weight.shape)}")
    if block_format(weight.ggml_type).ggml_type not in PRODUCT_FORMATS:
        raise ValueError(f"{what}: weight {weight.name!r} is {block_format(weight.ggml_type).name}; the q8x "
                         f"products read {', '.join(t.name for t in PRODUCT_FORMATS)}")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{what}: x of shape {list(x.shape)} does not fit weight {weight.name!r} "
                         f"(GGUF shape {list(weight.shape)}: x needs {weight.shape[0]} features)")
    tokens = math.prod(x.shape[:-1])
    if not 1 <= tokens <= MATVEC_MAX_TOKENS:
        raise ValueError(f"{what}: {tokens} rows of x; the decode products take 1..{MATVEC_MAX_TOKENS}")


def _weight_template(suffix: str, weight) -> list:
    fmt = block_format(weight.ggml_type)
    return [(f"FORMAT_{suffix}", int(fmt.ggml_type)), (f"ROW_BYTES_{suffix}", fmt.row_bytes(weight.shape[0]))]


def product(x: Q8X, weight, second=None, head: tuple[float, float] | None = None):
    """x @ W.T for q8x activations x [..., in] (1..8 rows) and a Q4_K / Q6_K / Q8_0 weight.

    second: another weight of the same input (any of those formats): one launch computes both,
    returning [..., out + out2] (first's columns, then second's).
    head: (logit scale s, softcap c) for the LM head: returns (c * tanh(s * x W.T / c) [..., out],
    best [rows, groups, 2]), the per-threadgroup maxima kernel argmax reduces (`greedy`); c = 0:
    no softcap. On the CPU: the same math on x's dequantized values (MLX ops)."""
    _check_product(x, weight, "product")
    if second is not None:
        _check_product(x, second, "product")
    lead, in_features = x.shape[:-1], x.shape[-1]
    tokens = math.prod(lead)
    out_a, out_b = weight.shape[1], second.shape[1] if second is not None else 0
    if kernels.backend() == "cpu":
        values = x.dequantize()
        y = linear(values, weight)
        if second is not None:
            y = mx.concatenate([y, linear(values, second)], axis=-1)
        if head is None:
            return y
        y = _softcap(y * head[0], head[1])
        return y, mx.stack([mx.max(y.reshape(tokens, -1), axis=-1),
                            mx.argmax(y.reshape(tokens, -1), axis=-1).astype(mx.float32)], axis=-1)[:, None]
    groups = -(-out_a // PRODUCT_ROWS) - (-out_b // PRODUCT_ROWS)  # SIMD groups
    threadgroups = -(-groups // PRODUCT_SIMD_GROUPS)
    template = (_weight_template("A", weight) + [("OUT_A", out_a)]
                + _weight_template("B", second if second is not None else weight)
                + [("OUT_B", out_b), ("IN", in_features), ("TOKENS", tokens), ("ROWS", PRODUCT_ROWS),
                   ("EPILOGUE", int(head is not None))])
    y, best = kernels.launch(
        "product",
        inputs=[weight.data, (second if second is not None else weight).data, *x,
                _parameters(*(head if head is not None else (1.0, 0.0)))],
        template=template,
        grid=(32 * PRODUCT_SIMD_GROUPS * threadgroups, 1, 1),
        threadgroup=(32 * PRODUCT_SIMD_GROUPS, 1, 1),
        output_shapes=[(*lead, out_a + out_b), (tokens, threadgroups, 2) if head is not None else (1,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return (y, best) if head is not None else y


def _softcap(logits: mx.array, cap: float) -> mx.array:
    return cap * mx.tanh(logits / cap) if cap > 0 else logits


def greedy(best: mx.array) -> mx.array:
    """The row of each token's largest value from product(..., head=...)'s best [T, groups, 2]:
    int32 [T] (kernel argmax; ties keep the first row, as mx.argmax)."""
    tokens, groups, _ = best.shape
    if kernels.backend() == "cpu":
        values, rows = best[..., 0], best[..., 1]
        top = mx.max(values, axis=-1, keepdims=True)
        return mx.min(mx.where(values == top, rows, float("inf")), axis=-1).astype(mx.int32)
    (token,) = kernels.launch(
        "argmax",
        inputs=[best],
        template=[("GROUPS", groups)],
        grid=(1024 * tokens, 1, 1),
        threadgroup=(1024, 1, 1),
        output_shapes=[(tokens,)],
        output_dtypes=[mx.int32],
    )
    return token


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def product_glu(x: Q8X, gate, up, activation: str = "silu") -> Q8X:
    """The gated FFN's first half: act(x G.T) * (x U.T) for q8x x [..., in] (1..8 rows),
    returned as q8x [..., ff] for the down projection. act: "silu" or "gelu_tanh"."""
    _check_product(x, gate, "product_glu")
    _check_product(x, up, "product_glu")
    ff = gate.shape[1]
    if up.shape != gate.shape or ff % 32:
        raise ValueError(f"product_glu: gate {gate.name!r} {list(gate.shape)} and up {up.name!r} "
                         f"{list(up.shape)} must have one shape with a multiple of 32 rows")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    lead = x.shape[:-1]
    if kernels.backend() == "cpu":
        values = x.dequantize()
        g = linear(values, gate)
        g = g * mx.sigmoid(g) if activation == "silu" else gelu_tanh(g)
        return quantize_rows_mlx(g * linear(values, up))
    codes, scales, sums = kernels.launch(
        "product_glu",
        inputs=[gate.data, up.data, *x],
        template=_weight_template("G", gate) + _weight_template("U", up)
        + [("OUT", ff), ("IN", x.shape[-1]), ("TOKENS", math.prod(lead)), ("ROWS", PRODUCT_ROWS),
           ("ACTIVATION", ACTIVATIONS[activation])],
        grid=(ff // 32 * 32 * (32 // PRODUCT_ROWS), 1, 1),
        threadgroup=(32 * (32 // PRODUCT_ROWS), 1, 1),
        output_shapes=q8x_shapes(tuple(lead), ff),
        output_dtypes=Q8X_DTYPES,
    )
    return Q8X(codes, scales, sums)


def gelu_tanh(x: mx.array) -> mx.array:
    """gelu with tanh's approximation, as the kernel computes it."""
    return 0.5 * x * (1.0 + mx.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


@functools.lru_cache(maxsize=None)
def _parameters(*values: float) -> mx.array:
    """A small float32 array of kernel parameters, made once per distinct value list."""
    return mx.array(values, dtype=mx.float32)


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


_LINEAR_PATHS = {
    "gpu_dequant_matmul": _gpu_dequant_matmul,
    "cpu_dequant_matmul": _cpu_dequant_matmul,
    "cpu_affine_qmm": _cpu_affine,
}
