"""Linear layers straight from GGUF blocks: which implementation serves a product
(`linear_path`), the GPU decode kernels, and the GPU prefill path (decode to f16, then the
backend's matmul). The CPU products live in cpu_products.py."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import logging
import math
import threading
from typing import NamedTuple

import mlx.core as mx

from muser_mlx import cpu_ext, kernels
from muser_mlx.dequant import AFFINE_CODE_TYPES, dequantize_rows
from muser_mlx.formats import Q8X_BLOCK, GGMLType, block_format
from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops.activations import quantize_rows_mlx
from muser_mlx.ops.cpu_products import (MATVEC_MAX_TOKENS, _cpu_affine, _cpu_dequant_matmul,
                                        _cpu_gguf_linear)

DEQUANT_THREADGROUP = 256
# The prefill's weight decoder: "dequant_spans" (a lane's 8 values consecutive, 16-byte stores)
# or "dequant_rows" (a lane's values 32 apart, 2-byte stores); the same values either way.
DEQUANT_KERNEL = "dequant_spans"
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
        if ggml_type in cpu_ext.FORMATS:
            return "cpu_gguf_linear"  # the compiled primitive (muser_mlx/cpu_ext.py)
        cpu_ext.note_fallback(ggml_type)  # logged once per format
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
    if path.startswith("matvec"):  # a decode kernel reads x as flat rows, writes [..., out]
        return _matvec(path, x, weight.data, fmt, in_features, out_features)
    out = _LINEAR_PATHS[path](x.reshape(-1, in_features), weight.data, fmt, in_features, out_features)
    # The GPU prefill's matmul gives float16 (the other paths float32: astype returns them as they are).
    return out.reshape(*lead, out_features) if keep_float16 else out.astype(mx.float32).reshape(*lead, out_features)


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
    # dequant_spans stores 8 values at a time: rows of whole 32-value blocks.
    name = DEQUANT_KERNEL if in_features % 32 == 0 else "dequant_rows"
    (values,) = kernels.launch(
        name,
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


def _gpu_dequant_matmul(rows, weight_bytes, fmt, in_features, out_features):
    # Prefill: decode the weight once per call (its cost is shared by all T rows), then the
    # backend's f16 matmul does the arithmetic. A large weight goes in pieces of output rows
    # (PREFILL_PIECE_BYTES of float16 each), each decoded, multiplied and queued on its own.
    # Within paced_products the pieces are decoded into PREFILL_SLOTS reused float16 buffers
    # (no temporary a piece) and the host waits only to keep PREFILL_TEMPORARY_BYTES of pieces
    # queued at once; else each piece is a fresh temporary.
    pacer = getattr(_PACING, "pacer", None)
    x = rows.astype(mx.float16)
    piece = max(PIECE_ROWS, PREFILL_PIECE_BYTES // (2 * in_features) // PIECE_ROWS * PIECE_ROWS)
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


# GPU prefill: a weight's float16 rows decoded at once, at most (bytes), in whole PIECE_ROWS:
# Muse Glimmer's largest weights (ffn gate, up, down: 0.27 GB in float16) whole, its LM head
# (2.7 GB, when a chunk's every logit is asked for) in ten pieces. H200 (bench/RESULTS.md,
# session 11, a 512-token prompt): pieces of 64 MB as fresh temporaries within 0.5 GB 5,883-6,173
# tokens/s (peak 1.06x the file); whole weights into 2 slots within 1 GB 7,083-7,121 (1.076x).
PREFILL_PIECE_BYTES = 280_000_000
PIECE_ROWS = 64


# GPU prefill: the float16 weight pieces queued on the GPU at once, at most (bytes). MLX
# encodes far ahead of the GPU; unbounded, a chunk's temporaries added up to 2x the file.
# Before a piece is queued the host waits for the oldest ones until it fits (one piece is
# queued whatever its size). Waiting for a whole layer instead idled the GPU while the host
# built each layer (H200, session 8: 185-191 ms a 512-row chunk). Without slots each queued
# piece is a float16 temporary, allocated when MLX encodes it and freed when the GPU has run
# it, so this budget is memory (bench/RESULTS.md, sessions 8 and 9); with slots it bounds the
# activations that run-ahead keeps alive.
PREFILL_TEMPORARY_BYTES = 1_000_000_000
# GPU prefill: float16 buffers that pieces are decoded into in turn (kernel dequant_into, in
# place), each as large as the largest piece it has held; 0: a fresh temporary a piece.
PREFILL_SLOTS = 2
# GPU prefill: the memory a paced block may hold beyond what was active when it began, its slots
# not counted (bytes; None: no such bound). Before a piece is queued the host also waits for the
# oldest ones while MLX's active memory is past that. The pieces' budget above bounds what the
# pieces are counted as, not what run-ahead keeps alive besides them (a layer's activations, a
# slot replaced while the GPU still reads it): filling an 8,192-position cache peaked 1.086-1.118x
# the file in three processes of the same code (bench/RESULTS.md, session 28). H200, session 29
# (bench/prefill_memory.py, three rounds, one process): unbounded 1.101-1.118x, 500 MB
# 1.087-1.089x; 300 MB cost a quarter of prefill's speed, 500 MB none measurable at contexts
# 0-1,536 (7,016-7,230 tokens/s a chunk) and ~4 % while filling 8,192 positions; 800 MB 1.099-1.104x.
PREFILL_ACTIVE_HEADROOM = 500_000_000
_PACING = threading.local()
_DEFAULT = object()  # paced_products' headroom when none is given: PREFILL_ACTIVE_HEADROOM


class _Slot:
    def __init__(self):
        self.values = None  # flat float16, or None before its first piece
        self.reader = None  # the last output computed from values


class _Pacer:
    def __init__(self, budget: int, slots: int, headroom: int | None):
        self.budget = budget
        self.queued = collections.deque()  # (output, piece bytes), oldest first
        self.slots = [_Slot() for _ in range(slots)]
        self.turn = 0
        self.headroom = headroom
        self.start = mx.get_active_memory() if headroom is not None else 0

    def over_memory(self) -> bool:
        """Whether MLX's active memory, this pacer's slots left out, is past its start plus headroom."""
        if self.headroom is None:
            return False
        slots = sum(slot.values.nbytes for slot in self.slots if slot.values is not None)
        return mx.get_active_memory() - slots > self.start + self.headroom

    def make_room(self, nbytes: int) -> None:
        while self.queued and (sum(n for _, n in self.queued) + nbytes > self.budget or self.over_memory()):
            mx.eval(self.queued.popleft()[0])

    def queue(self, out: mx.array, nbytes: int) -> None:
        mx.async_eval(out)
        self.queued.append((out, nbytes))

    def slot(self) -> _Slot | None:
        """The next slot in turn (None without slots)."""
        if not self.slots:
            return None
        slot = self.slots[self.turn]
        self.turn = (self.turn + 1) % len(self.slots)
        return slot


@contextlib.contextmanager
def paced_products(budget: int | None = None, slots: int | None = None, headroom=_DEFAULT):
    """Within this block (this thread), every GPU prefill product is queued as it is built,
    after waiting for older ones until the float16 weight pieces queued at once fit in
    `budget` bytes (PREFILL_TEMPORARY_BYTES) and MLX's active memory, the slots left out, is
    within `headroom` bytes (PREFILL_ACTIVE_HEADROOM; None: unbounded) of what it was when the
    block began; with `slots` (PREFILL_SLOTS) > 0 the pieces are decoded into that many reused
    buffers."""
    previous = getattr(_PACING, "pacer", None)
    _PACING.pacer = _Pacer(PREFILL_TEMPORARY_BYTES if budget is None else budget,
                           PREFILL_SLOTS if slots is None else slots,
                           PREFILL_ACTIVE_HEADROOM if headroom is _DEFAULT else headroom)
    try:
        yield
    finally:
        _PACING.pacer = previous


_LINEAR_PATHS = {
    "gpu_dequant_matmul": _gpu_dequant_matmul,
    "cpu_dequant_matmul": _cpu_dequant_matmul,
    "cpu_affine_qmm": _cpu_affine,
    "cpu_gguf_linear": _cpu_gguf_linear,
}
