"""The fused decode step's products: q8x activations times raw GGUF weights (kernels product,
product_glu, argmax), each launch's arguments fixed once per weight (`Product`, `GatedProduct`:
built at load by the model, so a step only calls them)."""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from muser_mlx import kernels
from muser_mlx.formats import GGMLType, block_format
from muser_mlx.ops.activations import Q8X, Q8X_DTYPES, WovenQ8X, q8x_shapes, quantize_rows_mlx
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.ops.products import linear

# Formats the q8x product kernels read (blocks.metal: muser_load_x_unit / muser_unit_dot).
PRODUCT_FORMATS = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)


class ProductConfig(NamedTuple):
    """Rows per SIMD group, SIMD groups per threadgroup and units per lane at a time (their
    loads issued together) of kernel product for a weight format (a launch of two weights
    takes its first's), wide units, whether x is staged in threadgroup memory, whether
    integers become floats without conversion instructions and whether wide Q4_K units take
    the lean arithmetic (those three kernel product only), and how many passes ahead a lane
    asks L2 for its bytes; product_glu takes `rows`, `unroll`, `wide` and `prefetch` (its
    threadgroups hold 32 rows: 32 / rows SIMD groups)."""

    rows: int
    simd_groups: int
    unroll: int = 1
    wide: int = 0  # 1: Q4_K in 64-value units (one scale unpack per 64 values); other formats ignore it
    stage: int = 0  # 1: kernel product copies x to threadgroup memory first where it can (Product._stages)
    int_floats: int = 0  # 1: kernel product's INT_FLOATS (integers to floats without conversions); product_glu: 0
    lean: int = 0  # 1: kernel product's LEAN (wide Q4_K and Q6_K dots scaled as integers, two rows in one butterfly)
    prefetch: int = 0  # p > 0: rows that loop ask L2 for the bytes p passes ahead (CUDA only; kernel product's PREFETCH)


# Chosen by `bench/linear.py --products` and CUPTI in a real step (`bench/timeline.py`) on the
# H200 (bench/RESULTS.md). Muse Glimmer's ffn_down (Q4_K, 19,968 wide) stages x: 22.85 us
# against 24.04 (session 23); staging x for Q6_K (its own layout) or for the short products
# made them slower. Q6_K takes LEAN (the offset and scales as integers): ffn_down Q6_K 39.02-39.10
# us against 41.17-41.22 (sessions 28-30, 36). PREFETCH (L2 asked for the bytes 1-2 passes ahead)
# made every product it touched slower (ffn_down Q4_K 26.5-27.1 us against 23.0, gate/up 50.7-51.2
# against 45.0) but Q6_K's without LEAN (40.12): off everywhere (bench/RESULTS.md, session 36).
PRODUCT_CONFIG = {GGMLType.Q4_K: ProductConfig(2, 8, 1, 1, 1), GGMLType.Q6_K: ProductConfig(2, 4, 1, 0, 0, 0, 1),
                  GGMLType.Q8_0: ProductConfig(2, 4)}

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

# The most threadgroup memory a staged x may take (ProductConfig.stage): Metal gives a
# threadgroup 32 KiB, CUDA 48 KiB of static shared memory. And the shortest rows it is staged
# for: the copy is one more round trip before any weight load, which paid for Muse Glimmer's
# 19,968-value rows and cost the 4,096- and 6,656-value ones (RESULTS.md, session 23).
STAGE_BYTES = 28 << 10
STAGE_MIN_IN = 8192


# Overrides for one (format, input width): the short rows of a layer's projections (4096 and
# 6656 values: 4-7 units a lane) may want other shapes than the long rows of ffn_down
# (bench/linear.py --products measures both). CUPTI in a Muse Glimmer step (RESULTS.md, sessions
# 21-23): q+gate with k+v (Q4_K, 6656 wide) in wide units with 2 SIMD groups a threadgroup
# (12.24 us, against 12.42 with 4 and 14.06 with 8 in 32-value units); the o-projection (Q4_K,
# 4096 wide) with 4, both of a lane's wide units at once, x woven (WOVEN_X): 6.15 us, against
# 6.19 with 2 SIMD groups, 6.21 with 8, 6.76 one unit at a time, 6.46 / 7.24 with 3 / 4
# rows, 6.45 in 32-value units four at once (session 26, each its own process's default).
#
# int_floats (kernel product's INT_FLOATS: integers to floats without conversion instructions,
# the same values) for the o-projection and the LM head (Q6_K, 6656 wide; the only launch of
# Muse Glimmer whose first weight is Q6_K with 6656 inputs). CUPTI in a step on the H200
# (session 27): the o-projection 6.03-6.04 us in four processes, against 6.13 without.
# product_glu took 45.5 us with it against 44.8-45.0 without, so it keeps conversions; the
# others moved within their run-to-run spread. The head: 314.3-315.0, 315.0 without; with
# Q6_K x's code sums made the same way too (muser_load_x_unit), 310.6 against 315.9 in one
# lease (session 28). On every Q6_K product it left ffn_down Q6_K unchanged (41.30 / 41.21).
#
# lean (kernel product's LEAN) for the o-projection: 5.94 us against 6.06 (session 28, one
# lease, each its own process's default). Its rows are one pass of the lanes (64 wide units,
# 2 a lane: blocks.metal's one-pass form, no loop or clamp), which alone measured 6.46: LEAN
# is what makes that form pay. On every Q4_K product q+gate took 13.09 us against 11.84.
PRODUCT_CONFIG_BY_WIDTH: dict = {(GGMLType.Q4_K, 6656): ProductConfig(2, 2, 1, 1),
                                 (GGMLType.Q4_K, 4096): ProductConfig(2, 4, 2, 1, 0, 1, 1),
                                 (GGMLType.Q6_K, 6656): ProductConfig(2, 4, 1, 0, 0, 1)}

# Whether a Product made with woven=True (the o-projection: attention_combine writes its x)
# reads x in q8x's woven layout (kernel product's WOVEN; formats.woven_positions): a SIMD
# group's 16-byte loads of its lanes' 64-value units become contiguous, 4 L1 wavefronts a load
# instead of 16: 6.15 us against 6.21 (bench/RESULTS.md, session 26). The producer asks the
# Product (x_woven), so turning this off (`timeline.py --set`) changes both ends.
WOVEN_X = True

# product_glu's overrides for one (format, input width), before PRODUCT_CONFIG_BY_WIDTH's:
# Muse Glimmer's gate/up (Q4_K, 6656 wide) with four rows a SIMD group in wide units.
GLU_CONFIG_BY_WIDTH: dict = {(GGMLType.Q4_K, 6656): ProductConfig(4, 8, 1, 1)}


def _config(ggml_type, in_features: int | None = None, tokens: int = 1, glu: bool = False) -> ProductConfig:
    """The configuration a launch takes, read when the launch is built (a traced step reads it
    once; bench variants change it between traces)."""
    key = (ggml_type, in_features)
    config = ProductConfig(*((GLU_CONFIG_BY_WIDTH if glu else {}).get(key)
                             or PRODUCT_CONFIG_BY_WIDTH.get(key, PRODUCT_CONFIG[ggml_type])))
    if config.unroll not in (1, 2, 4):
        raise ValueError(f"product config for {ggml_type.name}: unroll must be 1, 2 or 4, got {config.unroll}")
    for switch in ("stage", "int_floats", "lean"):
        if getattr(config, switch) not in (0, 1):
            raise ValueError(f"product config for {ggml_type.name}: {switch} must be 0 or 1, "
                             f"got {getattr(config, switch)}")
    if config.prefetch not in (0, 1, 2):
        raise ValueError(f"product config for {ggml_type.name}: prefetch must be 0, 1 or 2 (passes ahead), "
                         f"got {config.prefetch}")
    if config.wide not in (0, 1):
        raise ValueError(f"product config for {ggml_type.name}: wide must be 0 or 1 (Q4_K in 64-value units), "
                         f"got {config.wide}")
    # Units a lane loads together, times tokens, at most 4: 3 units of 3 tokens need more
    # registers than a launch of 512 threads has (H200). A wide unit holds twice a unit's
    # activations: wide units for at most 2 tokens (product_glu R2 wide: 102 registers at 2
    # tokens, 134 at 4, past the 128 of its 512 threads; nvcc sm_90).
    wide = config.wide if tokens <= 2 else 0
    unroll = min(config.unroll, max(1, (2 if wide else 4) // tokens))
    # product_glu's threadgroup is 32 / rows SIMD groups: more than 2 tokens at R2 (512 threads,
    # 128 registers each) took 168 registers at 8 tokens; R4's 256 threads have 255.
    rows = max(config.rows, 4) if glu and tokens > 2 else config.rows
    return config._replace(rows=rows, unroll=unroll, wide=wide)


class NoProductKernelError(ValueError):
    """A weight the q8x product kernels cannot read (its format, or its shape for product_glu):
    a model with one runs the general step instead of the fused one."""


def _format(weight, what: str) -> GGMLType:
    if len(weight.shape) != 2:
        raise ValueError(f"{what}: weight {weight.name!r} must be 2-D, has shape {list(weight.shape)}")
    ggml_type = block_format(weight.ggml_type).ggml_type
    if ggml_type not in PRODUCT_FORMATS:
        raise NoProductKernelError(f"{what}: weight {weight.name!r} is {ggml_type.name}; the q8x products read "
                         f"{', '.join(t.name for t in PRODUCT_FORMATS)}")
    return ggml_type


def _weight_template(suffix: str, weight) -> list:
    fmt = block_format(weight.ggml_type)
    return [(f"FORMAT_{suffix}", int(fmt.ggml_type)), (f"ROW_BYTES_{suffix}", fmt.row_bytes(weight.shape[0]))]


def _check_rows(x: Q8X, in_features: int, tokens: int, what: str, woven: bool = False) -> None:
    if x.shape[-1] != in_features or math.prod(x.shape[:-1]) != tokens:
        raise ValueError(f"{what}: x of shape {list(x.shape)} does not fit: the launch takes {tokens} "
                         f"rows of {in_features} features")
    if isinstance(x, WovenQ8X) != woven:
        layouts = ("woven", "plain") if woven else ("plain", "woven")
        raise ValueError(f"{what}: the launch reads {layouts[0]} q8x x, got {layouts[1]} "
                         f"(ops.weave; Product(woven=True) with fused_products.WOVEN_X reads woven x)")


class Product:
    """x @ W.T for q8x activations x [..., in] (`tokens` rows, 1..8) and a Q4_K / Q6_K / Q8_0
    weight (a GGUF tensor or stacked rows), with the launch's arguments fixed here.

    second: another weight of the same input (any of those formats): one launch computes both,
    returning [..., out + out2] (first's columns, then second's).
    head: (logit scale s, softcap c) for the LM head: returns (c * tanh(s * x W.T / c) [..., out],
    best [rows, groups, 2]), the per-threadgroup maxima kernel argmax reduces (`greedy`), both
    views of the launch's one output; c = 0: no softcap.
    woven: the caller can give x in q8x's woven layout (in a multiple of 64); whether it must is
    `x_woven` (WOVEN_X), read when the step is built. On the CPU: the same math on x's
    dequantized values (MLX ops)."""

    def __init__(self, weight, second=None, head: tuple[float, float] | None = None, tokens: int = 1,
                 woven: bool = False):
        ggml_type = _format(weight, "product")
        if woven and weight.shape[0] % 64:
            raise ValueError(f"product: {weight.name!r} takes {weight.shape[0]} inputs; woven x needs a multiple of 64")
        self.woven = woven
        self.formats = {ggml_type}  # the launch's weight formats
        if second is not None:
            self.formats.add(_format(second, "product"))
            if second.shape[0] != weight.shape[0]:
                raise ValueError(f"product: {weight.name!r} and {second.name!r} take different inputs")
        if not 1 <= tokens <= MATVEC_MAX_TOKENS:
            raise ValueError(f"product: {tokens} rows of x; the decode products take 1..{MATVEC_MAX_TOKENS}")
        self.weight, self.second, self.head, self.tokens = weight, second, head, tokens
        self.in_features = weight.shape[0]
        self.ggml_type = ggml_type
        self.out_a, self.out_b = weight.shape[1], second.shape[1] if second is not None else 0
        self.out_features = self.out_a + self.out_b
        self._launch = (None, None)  # (config, its launch arguments)
        self.parameters = kernels.parameters(*(head if head is not None else (1.0, 0.0)))
        self.launch_arguments()  # a configuration that cannot launch is refused here

    def launch_arguments(self):
        """(template, grid, threadgroup, threadgroups) for the configuration in force now."""
        config = _config(self.ggml_type, self.in_features, self.tokens)
        key = (config, STAGE_MIN_IN, STAGE_BYTES, self.x_woven)  # bench variants may change the module's constants
        if self._launch[0] != key:
            rows, simd_groups, unroll, wide, stage, int_floats, lean, prefetch = config
            stage = self._stages(wide) if stage else 0
            groups = -(-(-(-self.out_a // rows) - (-self.out_b // rows)) // simd_groups)  # threadgroups
            template = (_weight_template("A", self.weight) + [("OUT_A", self.out_a)]
                        + _weight_template("B", self.second if self.second is not None else self.weight)
                        + [("OUT_B", self.out_b), ("IN", self.in_features), ("TOKENS", self.tokens), ("ROWS", rows),
                           ("UNROLL", unroll), ("WIDE", wide), ("STAGE", stage), ("WOVEN", int(self.x_woven)),
                           ("EPILOGUE", int(self.head is not None)), ("INT_FLOATS", int_floats),
                           ("LEAN", lean), ("PREFETCH", prefetch)])
            self._launch = (key, (template, (32 * simd_groups * groups, 1, 1), (32 * simd_groups, 1, 1), groups))
        return self._launch[1]

    def _stages(self, wide: int) -> int:
        """Kernel product's STAGE for a configuration that asks for it: 1 when both weights are
        in wide Q4_K units or Q8_0, IN is whole 64-value blocks of at least STAGE_MIN_IN values
        and x's copy in threadgroup memory (1.25 bytes a value) fits STAGE_BYTES; else 0 (x read
        from device memory)."""
        readable = all(t == GGMLType.Q8_0 or (t == GGMLType.Q4_K and wide) for t in self.formats)
        fits = (self.in_features % 64 == 0 and self.in_features >= STAGE_MIN_IN
                and self.tokens * self.in_features * 5 // 4 <= STAGE_BYTES)
        return int(readable and fits)

    @property
    def x_woven(self) -> bool:
        """Whether x must reach this product in q8x's woven layout (ops.weave) now."""
        return self.woven and WOVEN_X

    @property
    def template(self) -> list:
        return self.launch_arguments()[0]

    @property
    def threadgroup(self) -> tuple:
        return self.launch_arguments()[2]

    def __call__(self, x: Q8X):
        _check_rows(x, self.in_features, self.tokens, "product", self.x_woven)
        lead = tuple(x.shape[:-1])
        if kernels.backend() == "cpu":
            return self._mlx(x)
        template, grid, threadgroup, groups = self.launch_arguments()
        values = self.tokens * self.out_features
        (y,) = kernels.launch(
            "product",
            inputs=[self.weight.data, (self.second if self.second is not None else self.weight).data, *x,
                    self.parameters],
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[(values + self.tokens * groups * 2,) if self.head else (*lead, self.out_features)],
            output_dtypes=[mx.float32],
        )
        if self.head is None:
            return y
        return y[:values].reshape(*lead, self.out_features), y[values:].reshape(self.tokens, groups, 2)

    def _mlx(self, x: Q8X):
        """The CPU rendering."""
        values = x.dequantize()  # a WovenQ8X's own dequantize() unweaves it
        y = linear(values, self.weight)
        if self.second is not None:
            y = mx.concatenate([y, linear(values, self.second)], axis=-1)
        if self.head is None:
            return y
        scale, cap = self.head
        y = y * scale
        if cap > 0:
            y = cap * mx.tanh(y / cap)
        rows = y.reshape(self.tokens, -1)
        best = mx.stack([mx.max(rows, axis=-1), mx.argmax(rows, axis=-1).astype(mx.float32)], axis=-1)
        return y, best[:, None]


class GatedProduct:
    """The gated FFN's first half: act(x G.T) * (x U.T) for q8x x [..., in] (`tokens` rows),
    returned as q8x [..., ff] for the down projection (kernel product_glu). act: "silu" or
    "gelu_tanh". The launch's arguments are fixed here."""

    def __init__(self, gate, up, activation: str = "silu", tokens: int = 1):
        ggml_type = _format(gate, "product_glu")
        _format(up, "product_glu")
        if up.shape != gate.shape or gate.shape[1] % 32:
            raise NoProductKernelError(f"product_glu: gate {gate.name!r} {list(gate.shape)} and up {up.name!r} "
                             f"{list(up.shape)} must have one shape with a multiple of 32 rows")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.gate, self.up, self.activation, self.tokens = gate, up, activation, tokens
        self.in_features, self.ff = gate.shape
        self.ggml_type = ggml_type
        self._launch = (None, None)
        self.launch_arguments()

    def launch_arguments(self):
        """(template, grid, threadgroup) for the configuration in force now."""
        config = _config(self.ggml_type, self.in_features, self.tokens, glu=True)
        if self._launch[0] != config:
            # x from device memory (no stage); no int_floats or lean
            rows, unroll, wide, prefetch = config.rows, config.unroll, config.wide, config.prefetch
            template = (_weight_template("G", self.gate) + _weight_template("U", self.up)
                        + [("OUT", self.ff), ("IN", self.in_features), ("TOKENS", self.tokens), ("ROWS", rows),
                           ("UNROLL", unroll), ("WIDE", wide), ("ACTIVATION", ACTIVATIONS[self.activation]),
                           ("PREFETCH", prefetch)])
            threadgroup = (32 * (32 // rows), 1, 1)  # a threadgroup per 32 rows
            self._launch = (config, (template, (self.ff // 32 * threadgroup[0], 1, 1), threadgroup))
        return self._launch[1]

    def __call__(self, x: Q8X) -> Q8X:
        _check_rows(x, self.in_features, self.tokens, "product_glu")
        lead = tuple(x.shape[:-1])
        if kernels.backend() == "cpu":
            values = x.dequantize()
            g = linear(values, self.gate)
            g = g * mx.sigmoid(g) if self.activation == "silu" else gelu_tanh(g)
            return quantize_rows_mlx(g * linear(values, self.up))
        template, grid, threadgroup = self.launch_arguments()
        codes, scales, sums = kernels.launch(
            "product_glu",
            inputs=[self.gate.data, self.up.data, *x],
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=q8x_shapes(lead, self.ff),
            output_dtypes=Q8X_DTYPES,
        )
        return Q8X(codes, scales, sums)


def product(x: Q8X, weight, second=None, head: tuple[float, float] | None = None):
    """Product(weight, second, head) for x's rows, called once (tests, benchmarks)."""
    return Product(weight, second, head, math.prod(x.shape[:-1]))(x)


def product_glu(x: Q8X, gate, up, activation: str = "silu") -> Q8X:
    """GatedProduct(gate, up, activation) for x's rows, called once (tests, benchmarks)."""
    return GatedProduct(gate, up, activation, math.prod(x.shape[:-1]))(x)


def greedy(best: mx.array) -> mx.array:
    """The row of each token's largest value from a head Product's best [T, groups, 2]: int32
    [T] (kernel argmax; ties keep the first row, as mx.argmax)."""
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
        output_shapes=[(max(tokens, kernels.MIN_ARRAY_VALUES),)],  # not MLX's managed pool (kernels.MIN_ARRAY_VALUES)
        output_dtypes=[mx.int32],
    )
    return token[:tokens]


def gelu_tanh(x: mx.array) -> mx.array:
    """gelu with tanh's approximation, as the kernel computes it."""
    return 0.5 * x * (1.0 + mx.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
