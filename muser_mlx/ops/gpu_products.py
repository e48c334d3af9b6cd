"""The GPU decode products: q8x activations times raw GGUF weights (kernels product,
product_glu, argmax), each launch's arguments fixed once per weight (`Product`, `GatedProduct`:
built at load by the model from its Settings, so a step only calls them). The one GPU product
family for a few rows of x; formats without a q8x kernel take ops.linear's generic matvec."""

from __future__ import annotations

import math
import mlx.core as mx

from muser_mlx import kernels
from muser_mlx.formats import GGMLType, block_format
from muser_mlx.ops.activations import (ACTIVATIONS, Q8X, Q8X_DTYPES, WovenQ8X, gelu_tanh, glu, glu_quantize_rows,
                                      q8x_shapes, quantize_rows, quantize_rows_mlx)
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.ops.products import linear
from muser_mlx.settings import DEFAULT, ProductConfig, Settings

# Formats the q8x product kernels read (kernels/lib/q8x.metal: muser_load_x_unit / muser_unit_dot).
PRODUCT_FORMATS = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)


def _config(ggml_type, in_features: int, tokens: int, glu: bool, settings: Settings) -> ProductConfig:
    """The launch shape of a product of `tokens` rows (settings' tables, then what the token
    count allows)."""
    key = (ggml_type, in_features)
    config = ((settings.glu_by_width.get(key) if glu else None)
              or settings.products_by_width.get(key) or settings.products[ggml_type])
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


def _check_rows(x: Q8X, in_features: int, tokens: int, what: str, woven: bool = False,
                grouped: bool = False) -> int:
    """The launch's token groups for x (1 unless grouped), after checking that x fits."""
    rows = math.prod(x.shape[:-1])
    if x.shape[-1] != in_features or (rows % tokens or rows == 0 if grouped else rows != tokens):
        raise ValueError(f"{what}: x of shape {list(x.shape)} does not fit: the launch takes "
                         f"{'a multiple of ' if grouped else ''}{tokens} rows of {in_features} features")
    if isinstance(x, WovenQ8X) != woven:
        layouts = ("woven", "plain") if woven else ("plain", "woven")
        raise ValueError(f"{what}: the launch reads {layouts[0]} q8x x, got {layouts[1]} "
                         f"(ops.weave; Product(woven=True) reads woven x)")
    return rows // tokens


class Product:
    """x @ W.T for q8x activations x [..., in] (`tokens` rows, 1..8) and a Q4_K / Q6_K / Q8_0
    weight (a GGUF tensor or stacked rows), with the launch's arguments fixed here.

    second: another weight of the same input (any of those formats): one launch computes both,
    returning [..., out + out2] (first's columns, then second's).
    head: (logit scale s, softcap c) for the LM head: returns (c * tanh(s * x W.T / c) [..., out],
    best [rows, groups, 2]), the per-threadgroup maxima kernel argmax reduces (`greedy`), both
    views of the launch's one output; c = 0: no softcap.
    woven: x arrives in q8x's woven layout (ops.weave; in a multiple of 64), as
    attention_combine writes it for the o-projection: a SIMD group's 16-byte loads of its lanes'
    64-value units become contiguous (6.15 against 6.21 us). settings: the launch shape's
    tables (Settings.products*). grouped: x holds any multiple of `tokens` rows, one launch for all
    (kernel product's GROUPED: the batched decode step, models/batch_decode.py); no head.
    On the CPU: the same math on x's dequantized values (MLX ops)."""

    def __init__(self, weight, second=None, head: tuple[float, float] | None = None, tokens: int = 1,
                 woven: bool = False, settings: Settings = DEFAULT, grouped: bool = False):
        ggml_type = _format(weight, "product")
        if woven and weight.shape[0] % 64:
            raise ValueError(f"product: {weight.name!r} takes {weight.shape[0]} inputs; woven x needs a multiple of 64")
        if grouped and head is not None:
            raise ValueError("product: a grouped launch has no head epilogue")
        self.woven, self.grouped = woven, grouped
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
        self.parameters = kernels.parameters(*(head if head is not None else (1.0, 0.0)))
        config = _config(ggml_type, self.in_features, tokens, False, settings)
        rows, simd_groups, unroll, wide, stage, int_floats, lean = config
        stage = self._stages(wide, settings) if stage else 0
        groups = -(-(-(-self.out_a // rows) - (-self.out_b // rows)) // simd_groups)  # threadgroups
        template = (_weight_template("A", weight) + [("OUT_A", self.out_a)]
                    + _weight_template("B", second if second is not None else weight)
                    + [("OUT_B", self.out_b), ("IN", self.in_features), ("TOKENS", tokens), ("ROWS", rows),
                       ("UNROLL", unroll), ("WIDE", wide), ("STAGE", stage), ("WOVEN", int(woven)),
                       ("EPILOGUE", int(head is not None)), ("INT_FLOATS", int_floats), ("LEAN", lean),
                       ("GROUPED", int(grouped))])
        self._launch = (template, (32 * simd_groups * groups, 1, 1), (32 * simd_groups, 1, 1), groups)

    def launch_arguments(self):
        """(template, grid, threadgroup, threadgroups), fixed at construction."""
        return self._launch

    def _stages(self, wide: int, settings: Settings) -> int:
        """Kernel product's STAGE for a configuration that asks for it: 1 when both weights are
        in wide Q4_K units or Q8_0, IN is whole 64-value blocks of at least stage_min_in values
        and x's copy in threadgroup memory (1.25 bytes a value) fits stage_bytes; else 0 (x read
        from device memory)."""
        readable = all(t == GGMLType.Q8_0 or (t == GGMLType.Q4_K and wide) for t in self.formats)
        fits = (self.in_features % 64 == 0 and self.in_features >= settings.stage_min_in
                and self.tokens * self.in_features * 5 // 4 <= settings.stage_bytes)
        return int(readable and fits)

    @property
    def x_woven(self) -> bool:
        """Whether x must reach this product in q8x's woven layout (ops.weave)."""
        return self.woven

    @property
    def template(self) -> list:
        return self.launch_arguments()[0]

    @property
    def threadgroup(self) -> tuple:
        return self.launch_arguments()[2]

    def __call__(self, x: Q8X):
        token_groups = _check_rows(x, self.in_features, self.tokens, "product", self.x_woven, self.grouped)
        lead = tuple(x.shape[:-1])
        if kernels.backend() == "cpu":
            return self._mlx(x)
        template, grid, threadgroup, groups = self.launch_arguments()
        if self.grouped:  # threadgroup (token group, row group)
            grid = (threadgroup[0] * token_groups, groups, 1)
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
        rows = y.reshape(-1, self.out_features)
        best = mx.stack([mx.max(rows, axis=-1), mx.argmax(rows, axis=-1).astype(mx.float32)], axis=-1)
        return y, best[:, None]


class GatedProduct:
    """The gated FFN's first half: act(x G.T) * (x U.T) for q8x x [..., in] (`tokens` rows),
    returned as q8x [..., ff] for the down projection (kernel product_glu). act: "silu" or
    "gelu_tanh". The launch's arguments are fixed here. grouped: as Product's."""

    def __init__(self, gate, up, activation: str = "silu", tokens: int = 1, settings: Settings = DEFAULT,
                 grouped: bool = False):
        ggml_type = _format(gate, "product_glu")
        _format(up, "product_glu")
        if up.shape != gate.shape or gate.shape[1] % 32:
            raise NoProductKernelError(f"product_glu: gate {gate.name!r} {list(gate.shape)} and up {up.name!r} "
                             f"{list(up.shape)} must have one shape with a multiple of 32 rows")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.gate, self.up, self.activation, self.tokens, self.grouped = gate, up, activation, tokens, grouped
        self.in_features, self.ff = gate.shape
        self.ggml_type = ggml_type
        # x from device memory (no stage); no int_floats or lean
        config = _config(ggml_type, self.in_features, tokens, True, settings)
        template = (_weight_template("G", gate) + _weight_template("U", up)
                    + [("OUT", self.ff), ("IN", self.in_features), ("TOKENS", tokens), ("ROWS", config.rows),
                       ("UNROLL", config.unroll), ("WIDE", config.wide), ("ACTIVATION", ACTIVATIONS[activation]),
                       ("GROUPED", int(grouped))])
        threadgroup = (32 * (32 // config.rows), 1, 1)  # a threadgroup per 32 rows
        self._launch = (template, (self.ff // 32 * threadgroup[0], 1, 1), threadgroup)

    def launch_arguments(self):
        """(template, grid, threadgroup), fixed at construction."""
        return self._launch

    def __call__(self, x: Q8X) -> Q8X:
        token_groups = _check_rows(x, self.in_features, self.tokens, "product_glu", grouped=self.grouped)
        lead = tuple(x.shape[:-1])
        if kernels.backend() == "cpu":
            values = x.dequantize()
            g = linear(values, self.gate)
            g = g * mx.sigmoid(g) if self.activation == "silu" else gelu_tanh(g)
            return quantize_rows_mlx(g * linear(values, self.up))
        template, grid, threadgroup = self.launch_arguments()
        if self.grouped:  # threadgroup (token group, 32-row block)
            grid = (threadgroup[0] * token_groups, grid[0] // threadgroup[0], 1)
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


# The batched step's tile products (kernel product_tiles): x rows a threadgroup stages (its
# token group; 8 of them a tile, all read against each weight block once).
TILE_TOKENS = 64


def tile_chunks(spans: int, threadgroups: int, glu: bool, target: int) -> int:
    """How many runs of its input's spans a tile product's threadgroups split (kernel
    product_tiles' CHUNKS): enough for `target` threadgroups (Settings.tile_threadgroups), each
    run at least two spans; 1 for a gated product (its activation needs whole sums)."""
    if glu:
        return 1
    chunks = max(1, min(-(-target // threadgroups), spans // 2))
    per = -(-spans // chunks)
    return -(-spans // per)  # no empty chunk


class TileProduct:
    """The batched decode step's products on the GPU (kernel product_tiles: int8 matrix products
    of 16-row weight tiles and 8-row tiles of q8x x staged in threadgroup memory, or f16 ones of
    their values from Settings.tile_half_from rows on, on tensor cores where the GPU has them).
    Called with q8x x [rows, in] (rows a multiple of 8): float32 [rows, out] = [x A.T | x B.T]
    for weight A and, if given, `second` B of the same input (formats Q4_K, Q6_K, Q8_0); with
    `activation` ("silu" or "gelu_tanh"), act(x A.T) * (x B.T), A the gate and B the up
    projection (or split, from Settings.tile_glu_split_from rows: gated_q8x). An ungated product
    of one weight may run in pairs (Settings.tile_pairs_from: pair()). Products of few
    rows split the input over several threadgroups (tile_chunks) and add their sums after. On
    the CPU: the same math on x's dequantized values (MLX ops)."""

    def __init__(self, weight, second=None, activation: str | None = None, settings: Settings = DEFAULT):
        self.formats = [_format(weight, "product_tiles")]
        if second is not None:
            self.formats.append(_format(second, "product_tiles"))
            if second.shape[0] != weight.shape[0]:
                raise ValueError(f"product_tiles: {weight.name!r} and {second.name!r} take different inputs")
        if activation is not None:
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
            if second is None or second.shape != weight.shape:
                raise ValueError(f"product_tiles: a gated product needs gate and up of one shape, got "
                                 f"{list(weight.shape)} and {list(second.shape) if second is not None else None}")
        self.weight, self.second, self.activation = weight, second, activation
        self.in_features = weight.shape[0]
        if self.in_features % 32:
            raise NoProductKernelError(f"product_tiles: {weight.name!r} takes {self.in_features} inputs, not whole "
                                       f"32-value blocks")
        self.out_a, self.out_b = weight.shape[1], second.shape[1] if second is not None else 0
        self.out_features = self.out_a if activation else self.out_a + self.out_b
        glu = activation is not None
        self.tiles_a, self.tiles_b = -(-self.out_a // 16), -(-self.out_b // 16)  # 16-row tiles of A and B
        self.warps, self.target = settings.tile_warps, settings.tile_threadgroups
        # From this many rows of x (0: never), an ungated f16 product of one weight whose rows
        # split in two halves of whole tiles runs in pairs (Settings.tile_pairs_from: pair())
        self.pairs_from = settings.tile_pairs_from if second is None and self.out_a % 32 == 0 else 0
        # The 64-row threadgroups an SM holds at once, at least (CUDA: registers capped), of a
        # launch whose lanes hold two tiles' sums (gated or pairs; Settings.tile_glu_min_warps)
        # and of one whose lanes hold one tile's (Settings.tile_min_warps)
        self.least = (max(1, settings.tile_glu_min_warps // self.warps)
                      if (glu or self.pairs_from) and settings.tile_glu_min_warps else 0)
        self.least_one = max(1, settings.tile_min_warps // self.warps) if settings.tile_min_warps else 0
        self.spans = self.in_features // (256 if self.in_features % 256 == 0 else 32)

        def weights(b, out_a: int, out_b: int) -> list:  # the template's weights: A (`weight`), then B
            return (_weight_template("A", weight) + [("OUT_A", out_a)] + _weight_template("B", b)
                    + [("OUT_B", out_b), ("IN", self.in_features)])

        self._template = weights(second if second is not None else weight, self.out_a, self.out_b)
        self.half_from = settings.tile_half_from
        self._halves = None  # pairs: the weight's two halves of rows, A and B of GLU 2
        if self.pairs_from:
            half = self.out_a // 2
            self._pair_template = weights(weight, half, half)
            data = getattr(weight, "data", None)  # (None: a stand-in that only makes launch arguments)
            if data is not None:
                # evaluated now, views of the weight's bytes (no copy), as gguf.stack_rows' are: a
                # lazy array belongs to the stream of the thread that made it
                self._halves = (data[:half], data[half:])
                mx.eval(self._halves)
        self.by_token = settings.tile_stage_by_token
        # A gated product of this many rows or more runs split (its input in chunks like an
        # ungated product's, the activation in quantize_rows: split())
        self.split_from = settings.tile_glu_split_from if glu else 0
        self.split_pairs = settings.tile_glu_split_pairs  # split: gate's and up's same rows a SIMD group (GLU 2)
        self._launches = {}

    @staticmethod
    def tokens(rows: int) -> int:
        """The rows of x a threadgroup takes (kernel product_tiles' TOKENS): the least of 8, 16,
        32, TILE_TOKENS that holds `rows`."""
        return min(TILE_TOKENS, max(8, 1 << (rows - 1).bit_length()))

    def half(self, rows: int) -> bool:
        """Whether `rows` rows of x take the f16 form (kernel product_tiles' HALF 1;
        Settings.tile_half_from)."""
        return rows >= self.half_from

    def split(self, rows: int) -> bool:
        """Whether a gated product of `rows` rows of x runs split (Settings.tile_glu_split_from):
        its halves [chunks, rows, 2 out] (gate's sums, then up's) for ops.glu_quantize_rows, from
        kernel product_tiles' GLU 2 (Settings.tile_glu_split_pairs: a SIMD group takes the same
        rows of both, as the fused form) or GLU 0 (gate and up as one ungated product)."""
        return 0 < self.split_from <= rows

    def pair(self, rows: int) -> bool:
        """Whether `rows` rows of x run this ungated product in pairs (Settings.tile_pairs_from;
        the f16 form only: kernel product_tiles' GLU 2 over the weight's two halves of rows)."""
        return 0 < self.pairs_from <= rows and self.half(rows)

    def launch_inputs(self, rows: int) -> tuple[mx.array, mx.array]:
        """The weight arrays kernel product_tiles takes as A and B for `rows` rows of x."""
        if self.pair(rows):
            if self._halves is None:
                raise ValueError(f"product_tiles: {self.weight.name!r} has no data to launch in pairs")
            return self._halves
        return self.weight.data, (self.second if self.second is not None else self.weight).data

    def launch_arguments(self, rows: int):
        """(template, grid, threadgroup, chunks, width) for `rows` rows of x (made once for each
        count): width, the columns the kernel writes."""
        made = self._launches.get(rows)
        if made is None:
            made = self._launches[rows] = self._launch_arguments(rows)
        return made

    def _launch_arguments(self, rows: int):
        tokens = self.tokens(rows)
        groups = -(-rows // tokens)
        # kernel product_tiles' GLU: 1 fused, 2 split in pairs or an ungated product in pairs (A and
        # B its halves), 0 ungated or split one tile a SIMD group
        split, pair = self.split(rows), self.pair(rows)
        if pair:
            glu = 2
        elif self.activation is None or (split and not self.split_pairs):
            glu = 0
        else:
            glu = 2 if split else 1
        # GLU 1 and 2: a SIMD group takes the same rows of A and B (A's tiles); GLU 0: every tile of both
        tiles = self.tiles_a // 2 if pair else self.tiles_a if glu else self.tiles_a + self.tiles_b
        blocks = -(-tiles // self.warps)
        chunks = tile_chunks(self.spans, groups * blocks, glu == 1, self.target)
        threadgroup = (32 * self.warps, 1, 1)
        half = self.half(rows)
        weights = self._pair_template if pair else self._template
        template = (weights + [("TOKENS", tokens), ("WARPS", self.warps), ("HALF", int(half)),
                               ("BY_TOKEN", int(half and self.by_token)), ("CHUNKS", chunks), ("GLU", glu),
                               ("ACTIVATION", ACTIVATIONS[self.activation] if glu == 1 else 0),
                               ("LAUNCH_THREADS", threadgroup[0]),
                               ("LAUNCH_MIN_THREADGROUPS", (self.least if glu else self.least_one)
                                if tokens == TILE_TOKENS else 0)])
        width = self.out_a if glu == 1 else self.out_a + self.out_b
        return template, (threadgroup[0] * groups, blocks, chunks), threadgroup, chunks, width

    def _check(self, x: Q8X):
        if len(x.shape) != 2 or x.shape[1] != self.in_features or x.shape[0] % 8 or x.shape[0] == 0:
            raise ValueError(f"product_tiles: x must be [rows, {self.in_features}] with rows a positive multiple "
                             f"of 8, got {list(x.shape)}")

    def __call__(self, x: Q8X, summed: bool = True) -> mx.array:
        """summed False: the chunks' partial sums [chunks, rows, out] as the kernel writes them
        (for a consumer that adds them itself: ops.residual_norm_quant's chunked)."""
        self._check(x)
        if kernels.backend() == "cpu":
            values = x.dequantize()
            y = linear(values, self.weight)
            if self.second is not None:
                other = linear(values, self.second)
                y = mx.concatenate([y, other], axis=-1) if self.activation is None else glu(y, other, self.activation)
            return y if summed else y[None]  # one chunk
        rows = x.shape[0]
        if self.split(rows):  # the halves, then the activation as MLX ops
            halves = self._launch(x, summed=True)
            f = glu(halves[:, : self.out_a], halves[:, self.out_a :], self.activation)
            return f if summed else f[None]
        return self._launch(x, summed)

    def _launch(self, x: Q8X, summed: bool) -> mx.array:
        rows = x.shape[0]
        template, grid, threadgroup, chunks, width = self.launch_arguments(rows)
        (y,) = kernels.launch(
            "product_tiles",
            inputs=[*self.launch_inputs(rows), *x],
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[(chunks, rows, width)],
            output_dtypes=[mx.float32],
        )
        return y if not summed else y[0] if chunks == 1 else y.sum(axis=0)

    def gated_q8x(self, x: Q8X) -> Q8X:
        """A gated product's f = act(x A.T) * (x B.T) as q8x (the down projection's input): from
        kernel product_tiles' GLU 1, or (split, Settings.tile_glu_split_from) its ungated form's
        halves through ops.glu_quantize_rows. The CPU: MLX ops, as __call__'s."""
        if self.activation is None:
            raise ValueError("gated_q8x: an ungated product (no activation)")
        rows = x.shape[0]
        if kernels.backend() == "cpu" or not self.split(rows):
            return quantize_rows(self(x))
        self._check(x)
        return glu_quantize_rows(self._launch(x, summed=False), self.activation)


def product(x: Q8X, weight, second=None, head: tuple[float, float] | None = None, settings: Settings = DEFAULT):
    """Product(weight, second, head) for x's rows, called once (tests, benchmarks)."""
    return Product(weight, second, head, math.prod(x.shape[:-1]), settings=settings)(x)


def product_glu(x: Q8X, gate, up, activation: str = "silu", settings: Settings = DEFAULT) -> Q8X:
    """GatedProduct(gate, up, activation) for x's rows, called once (tests, benchmarks)."""
    return GatedProduct(gate, up, activation, math.prod(x.shape[:-1]), settings=settings)(x)


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
