"""The fused decode step's operations (ops.quantize_rows, product, product_glu, greedy,
residual_norm_quant, attention_decode) against numpy float64, on every backend.

Each takes or makes activations as q8x (formats.quantize_activations). Where a kernel is given
q8x input, only float32 accumulation separates it from the reference (bound 2e-5). Where it
quantizes its own float32 result, a code may land on the other side of a rounding boundary from
the float64 reference's; so each value is checked to lie within half a code step (d / 2) of the
exact result, which is the quantization's own bound, plus float32 rounding."""


import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import formats, kernels, ops, testing
from muser_mlx.gguf import StackedRows
from muser_mlx.reference import rms, rope
from muser_mlx.settings import DEFAULT, Settings
from tests.conftest import relative_error, tile_settings

PRODUCT_BOUND = 2e-5
# The tile products' f16 form (Settings.tile_half_from) against the same float64 products:
# weights' values and x's rounded to f16 (2^-11 relative each; the per-block scales rounded too):
# measured 4e-4 to 8e-4 on random blocks.
HALF_PRODUCT_BOUND = 3e-3
# The tile products' two forms (Settings.tile_half_from), for the tests that check both.
TILE_FORMS = pytest.mark.parametrize("half", [False, True, "by token"], ids=["int8", "f16", "f16-by-token"])


def with_products(products: dict, **fields) -> Settings:
    """The default settings with kernel product's configs of some formats replaced (and other
    Settings fields: products_by_width={} drops the per-width overrides)."""
    return DEFAULT.replace(products={**DEFAULT.products, **products}, **fields)


def q8x(x: np.ndarray) -> tuple[ops.Q8X, np.ndarray]:
    """x as the kernels' q8x input, and the float64 values it stands for."""
    codes, scales, sums = formats.quantize_activations(x)
    values = formats.dequantize_activations(codes, scales).astype(np.float64)
    return ops.Q8X(mx.array(codes), mx.array(scales), mx.array(sums)), values


def weight(rng, ggml_type, in_features, out_features, name="w"):
    """A weight of random valid blocks (a GGUF tensor stand-in) and its float64 values [out, in]."""
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    values = formats.dequantize(raw, ggml_type, [in_features, out_features]).astype(np.float64)
    return StackedRows(name, ggml_type, (in_features, out_features), mx.array(raw)), values


def assert_within_half_a_code(out: ops.Q8X, exact: np.ndarray, slack: float = 1e-4):
    """Every dequantized value of `out` lies within d/2 of `exact` (d: its block's scale) plus
    float32 slack relative to the block's largest value; every scale is written and right, to the
    same slack (a scale is the block's largest computed value / 127)."""
    codes, scales = np.array(out.codes), np.array(out.scales)
    assert np.isfinite(scales).all(), "a block's scale was left unwritten"
    blocks = exact.reshape(*exact.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    np.testing.assert_allclose(scales, amax / 127, rtol=slack, atol=1e-30)
    values = formats.dequantize_activations(codes, scales).reshape(blocks.shape)
    allowed = (0.5 + slack * 127) * scales[..., None] + 1e-30
    assert (np.abs(values - blocks) <= allowed).all()
    sums = np.array(out.sums).reshape(*scales.shape, 4)
    np.testing.assert_allclose(sums, values.reshape(*scales.shape, 4, 8).sum(-1), rtol=1e-5,
                               atol=1e-5 * float(np.abs(sums).max()))


def test_quantize_rows_matches_the_numpy_reference_exactly(backend, rng):
    x = rng.standard_normal((5, 640)).astype(np.float32) * rng.uniform(0.01, 100, size=(5, 1)).astype(np.float32)
    x[1, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
    x[2, 64:96] = np.float32(3.5) * np.sign(rng.standard_normal(32)).astype(np.float32)  # ties at .5
    with kernels.poisoned_outputs():
        out = ops.quantize_rows(mx.array(x).reshape(5, 1, 640))
        mx.eval(out)
    codes, scales, sums = formats.quantize_activations(x)
    assert out.shape == (5, 1, 640)
    np.testing.assert_array_equal(np.array(out.codes).reshape(5, 640), codes)
    np.testing.assert_array_equal(np.array(out.scales).reshape(5, -1), scales)
    np.testing.assert_allclose(np.array(out.sums).reshape(5, -1), sums, rtol=1e-6)


FORMAT_PAIRS = [(GGMLType.Q4_K, None), (GGMLType.Q6_K, None), (GGMLType.Q8_0, None),
                (GGMLType.Q4_K, GGMLType.Q8_0), (GGMLType.Q8_0, GGMLType.Q6_K)]


@pytest.mark.parametrize("formats_ab", FORMAT_PAIRS, ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_product_of_one_or_two_weights_matches_numpy(backend, rng, formats_ab, tokens):
    first, second = formats_ab
    in_features = 256 * int(rng.integers(1, 5))
    out_a, out_b = int(rng.integers(1, 30)) * 3 + 1, int(rng.integers(1, 20)) * 5 + 2  # odd rows
    a, a_values = weight(rng, first, in_features, out_a, "a")
    b, b_values = weight(rng, second, in_features, out_b, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32))
    with kernels.poisoned_outputs():
        out = np.array(ops.product(x, a, b))
    expected = x_values @ a_values.T
    if second:
        expected = np.concatenate([expected, x_values @ b_values.T], axis=-1)
    assert out.shape == expected.shape and np.isfinite(out).all()
    assert relative_error(out, expected) <= PRODUCT_BOUND


@pytest.mark.parametrize("formats_ab", FORMAT_PAIRS + [(GGMLType.Q6_K, GGMLType.Q4_K)],
                         ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("rows", [8, 24, 72, 136])
@TILE_FORMS
def test_tile_products_match_numpy(backend, rng, formats_ab, rows, half):
    """ops.TileProduct (kernel product_tiles: the batched step's int8 or f16 matrix products,
    tensor cores on an NVIDIA GPU) of rows of x in 8-row tiles (threadgroups of 8 rows; 24: of
    32, 8 of them past the rows; 72, 136: token groups past 64) and weights of odd row counts;
    then its gated form against act(x G.T) * (x U.T). The f16 form to HALF_PRODUCT_BOUND."""
    first, second = formats_ab
    settings = tile_settings(half)
    bound = HALF_PRODUCT_BOUND if half else PRODUCT_BOUND
    in_features = 256 * int(rng.integers(1, 5))
    out_a, out_b = int(rng.integers(1, 30)) * 3 + 1, int(rng.integers(1, 20)) * 5 + 2
    a, a_values = weight(rng, first, in_features, out_a, "a")
    b, b_values = weight(rng, second, in_features, out_b, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((rows, in_features)).astype(np.float32))
    with kernels.poisoned_outputs():
        out = np.array(ops.TileProduct(a, b, settings=settings)(x))
    expected = x_values @ a_values.T
    if second:
        expected = np.concatenate([expected, x_values @ b_values.T], axis=-1)
    assert out.shape == expected.shape and np.isfinite(out).all()
    assert relative_error(out, expected) <= bound
    gate, gate_values = weight(rng, first, in_features, 96, "gate")
    up, up_values = weight(rng, second or first, in_features, 96, "up")
    with kernels.poisoned_outputs():
        glu = np.array(ops.TileProduct(gate, up, "silu", settings=settings)(x))
    g = x_values @ gate_values.T
    expected = g / (1 + np.exp(-g)) * (x_values @ up_values.T)
    assert relative_error(glu, expected) <= bound
    split = ops.TileProduct(gate, up, "silu", settings=tile_settings(half, tile_glu_split_from=8))
    with kernels.poisoned_outputs():  # gate and up as one product, quantize_rows' GLU 1 after
        split_glu = np.array(split(x))
        f = split.gated_q8x(x)
    assert relative_error(split_glu, expected) <= bound
    assert_within_half_a_code(f, split_glu, slack=1e-4)
    pairs = ops.TileProduct(gate, settings=tile_settings(half, tile_pairs_from=8))  # f16: 2 halves of 48 rows
    with kernels.poisoned_outputs():
        paired = np.array(pairs(x))
    assert pairs.pair(rows) == bool(half) and relative_error(paired, g) <= bound


@pytest.mark.parametrize("wide", [0, 1], ids=["units32", "wide"])
@pytest.mark.parametrize("unroll", [1, 2, 4])  # 4 with 3 tokens: 1 (at most 4 units x tokens)
@pytest.mark.parametrize("formats_ab", FORMAT_PAIRS[:3], ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 3])
def test_products_that_take_several_units_a_lane_at_a_time_match_numpy(backend, rng, formats_ab,
                                                                         tokens, unroll, wide):
    """ProductConfig.unroll: 88 units a row, so lanes take 2 or 3 units and, two or four at a
    time, the last batch of most lanes runs past the row (those units must add nothing).
    ProductConfig.wide: Q4_K's 44 wide units a row, lanes taking 1 or 2 of them (other formats
    ignore it)."""
    first, _ = formats_ab
    in_features, out = 2816, 37
    settings = with_products({first: ops.ProductConfig(2, 4, unroll, wide)})
    a, a_values = weight(rng, first, in_features, out, "a")
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32))
    gate, gate_values = weight(rng, first, in_features, 64, "gate")
    up, up_values = weight(rng, first, in_features, 64, "up")
    with kernels.poisoned_outputs():
        y = np.array(ops.product(x, a, settings=settings))
        glu = ops.product_glu(x, gate, up, "silu", settings=settings)
        mx.eval(glu)
    assert relative_error(y, x_values @ a_values.T) <= PRODUCT_BOUND
    g, u = x_values @ gate_values.T, x_values @ up_values.T
    assert_within_half_a_code(glu, g / (1 + np.exp(-g)) * u)


@pytest.mark.parametrize("wide", [0, 1], ids=["units32", "wide"])
@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("formats_ab", FORMAT_PAIRS[:3], ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 2])
def test_products_whose_rows_are_one_pass_of_the_lanes_match_numpy(backend, rng, formats_ab, tokens,
                                                                   unroll, wide):
    """Rows of exactly 32 * unroll units (the o-projection's: 64 wide units, 2 a lane) take
    lib/q8x.metal's one-pass form (no loop, no clamp); against numpy, and against the same
    launch on rows one unit longer, which loop and clamp."""
    first, _ = formats_ab
    unit = 64 if wide and first == GGMLType.Q4_K else 32
    settings = with_products({first: ops.ProductConfig(2, 4, unroll, wide)})
    for in_features in (32 * unroll * unit, 32 * unroll * unit + 256):
        a, a_values = weight(rng, first, in_features, int(rng.integers(3, 20)) * 2 + 1, "a")
        x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32))
        with kernels.poisoned_outputs():
            y = np.array(ops.product(x, a, settings=settings))
        assert np.isfinite(y).all() and relative_error(y, x_values @ a_values.T) <= PRODUCT_BOUND


def _with_and_without(field: str, config, formats_ab, a, b, x, tokens: int, on: int = 1, **fields) -> list:
    """The product of x with a (and b) under `config` with ProductConfig field `field` set to 0,
    then `on`, for both weights' formats (each launch's template checked); `fields`: other
    Settings fields."""
    outs = []
    for value in (0, on):
        settings = with_products({t: config._replace(**{field: value}) for t in set(formats_ab) - {None}}, **fields)
        product = ops.Product(a, b, tokens=tokens, settings=settings)
        assert dict(product.template)[field.upper()] == value
        with kernels.poisoned_outputs():
            outs.append(np.array(product(x)))
    return outs


def _reference_product(x_values, a_values, b_values):
    """x A.T, then x B.T beside it when there is a second weight."""
    expected = x_values @ a_values.T
    return expected if b_values is None else np.concatenate([expected, x_values @ b_values.T], axis=-1)


@pytest.mark.parametrize("wide", [0, 1], ids=["units32", "wide"])
@pytest.mark.parametrize("formats_ab", FORMAT_PAIRS, ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 3])
def test_products_that_make_floats_without_conversions_equal_those_that_convert_bit_for_bit(
        backend, rng, formats_ab, tokens, wide):
    """ProductConfig.int_floats (kernel product's INT_FLOATS): the integer dots and scales
    become floats through a float's mantissa (lib/base.metal's muser_int_float) instead of
    conversion instructions: the same values, so the same result bit for bit; and numpy's."""
    first, second = formats_ab
    in_features = 256 * int(rng.integers(2, 6))
    a, a_values = weight(rng, first, in_features, int(rng.integers(3, 30)) * 2 + 1, "a")
    b, b_values = weight(rng, second, in_features, 9, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32) * 4)
    outs = _with_and_without("int_floats", ops.ProductConfig(2, 4, 1, wide), formats_ab, a, b, x, tokens)
    expected = _reference_product(x_values, a_values, b_values)
    assert np.isfinite(outs[1]).all() and relative_error(outs[1], expected) <= PRODUCT_BOUND
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("rows, unroll, stage", [(2, 2, 0), (2, 1, 1), (1, 2, 0), (3, 1, 0)])
@pytest.mark.parametrize("formats_ab", [(GGMLType.Q4_K, None), (GGMLType.Q4_K, GGMLType.Q8_0)],
                         ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 2])
def test_lean_products_match_numpy_and_the_plain_arithmetic(backend, rng, formats_ab, tokens, rows,
                                                           unroll, stage):
    """ProductConfig.lean (kernel product's LEAN): wide Q4_K dots scaled by their 6-bit scales
    as integers, and two rows reduced in one butterfly (ROWS 2); another rounding order, so
    against numpy within the products' bound and against LEAN 0 within float32 rounding. x is
    scaled so that some dots reach the integer bound's order (|63 * dot| up to ~2^21)."""
    first, second = formats_ab
    fields = dict(products_by_width={}, stage_min_in=4096)
    in_features = 4096 if stage else 256 * int(rng.integers(2, 9))
    a, a_values = weight(rng, first, in_features, int(rng.integers(3, 20)) * 2 + 1, "a")
    b, b_values = weight(rng, second, in_features, 7, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32) * 8)
    config = ops.ProductConfig(rows, 4, unroll, 1, stage, 1)
    outs = _with_and_without("lean", config, formats_ab, a, b, x, tokens, **fields)
    settings = with_products({t: config for t in set(formats_ab) - {None}}, **fields)
    assert dict(ops.Product(a, b, tokens=tokens, settings=settings).template)["STAGE"] == stage
    expected = _reference_product(x_values, a_values, b_values)
    assert np.isfinite(outs[1]).all() and relative_error(outs[1], expected) <= PRODUCT_BOUND
    assert relative_error(outs[1], outs[0]) <= 1e-6


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("formats_ab", [(GGMLType.Q6_K, None), (GGMLType.Q6_K, GGMLType.Q4_K)],
                         ids=lambda p: "+".join(t.name for t in p if t))
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_lean_q6k_products_match_numpy_and_the_plain_arithmetic(backend, rng, formats_ab, tokens, rows):
    """Q6_K under ProductConfig.lean: the -32 offset and the int8 scales applied as integers
    (|(q - 32) . c| * |scale| up to 8 * 32 * 127 * 128 < 2^22), one float product by x's scale a
    quarter; another rounding order, so against numpy within the products' bound and against
    LEAN 0 within float32 rounding. x scaled so that some codes reach +-127; scales of -128
    included (testing.random_blocks draws any int8)."""
    first, second = formats_ab
    in_features = 256 * int(rng.integers(2, 9))
    a, a_values = weight(rng, first, in_features, int(rng.integers(3, 20)) * 2 + 1, "a")
    b, b_values = weight(rng, second, in_features, 7, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32) * 8)
    config = ops.ProductConfig(rows, 4, 1)
    outs = _with_and_without("lean", config, formats_ab, a, b, x, tokens, products_by_width={})
    expected = _reference_product(x_values, a_values, b_values)
    assert np.isfinite(outs[1]).all() and relative_error(outs[1], expected) <= PRODUCT_BOUND
    assert relative_error(outs[1], outs[0]) <= 1e-6


@pytest.mark.parametrize("rows, simd_groups, unroll", [(2, 4, 1), (2, 2, 2), (1, 8, 1)])
@pytest.mark.parametrize("tokens", [1, 2])
def test_products_that_stage_x_match_numpy(backend, rng, rows, simd_groups, unroll, tokens):
    """ProductConfig.stage: x in threadgroup memory, read by wide Q4_K units and Q8_0 ones (the
    o-projection's and q+gate with k+v's formats) at 4,096 values: 64 wide units a row, 2 a lane;
    equal to the unstaged launch's result."""
    def settings(stage):
        config = ops.ProductConfig(rows, simd_groups, unroll, 1, stage)
        return with_products({GGMLType.Q4_K: config, GGMLType.Q8_0: config}, products_by_width={}, stage_min_in=4096)

    a, a_values = weight(rng, GGMLType.Q4_K, 4096, 45, "a")
    b, b_values = weight(rng, GGMLType.Q8_0, 4096, 19, "b")
    x, x_values = q8x(rng.standard_normal((tokens, 4096)).astype(np.float32))
    product = ops.Product(a, b, tokens=tokens, settings=settings(1))
    assert dict(product.template)["STAGE"] == 1
    with kernels.poisoned_outputs():
        y = np.array(product(x))
    expected = np.concatenate([x_values @ a_values.T, x_values @ b_values.T], axis=-1)
    assert np.isfinite(y).all() and relative_error(y, expected) <= PRODUCT_BOUND
    with kernels.poisoned_outputs():
        np.testing.assert_array_equal(np.array(ops.Product(a, b, tokens=tokens, settings=settings(0))(x)), y)


WOVEN_CASES = {  # first weight's format, its config, the second weight's format, staged
    "wide": (GGMLType.Q4_K, ops.ProductConfig(2, 4, 2, 1), None),
    "wide-one-at-a-time": (GGMLType.Q4_K, ops.ProductConfig(2, 2, 1, 1), None),
    "units32": (GGMLType.Q4_K, ops.ProductConfig(2, 4, 2, 0), None),
    "Q6_K": (GGMLType.Q6_K, ops.ProductConfig(2, 4), None),
    "Q8_0": (GGMLType.Q8_0, ops.ProductConfig(2, 4, 2), None),
    "staged": (GGMLType.Q4_K, ops.ProductConfig(2, 4, 1, 1, 1), GGMLType.Q8_0),
}


@pytest.mark.parametrize("case", sorted(WOVEN_CASES))
@pytest.mark.parametrize("tokens", [1, 2])
def test_products_read_woven_x_as_the_plain_layout_bit_for_bit(backend, rng, case, tokens):
    """Product(woven=True): x's codes and sums in q8x's woven layout (ops.weave, as
    attention_combine writes the o-projection's x). 2,560 values: a run of 32 64-value units
    and a short run of 8, so both strides of the layout are read. The result is the plain
    layout's bit for bit (the same values, added in the same order)."""
    first, config, second = WOVEN_CASES[case]
    settings = with_products({first: config} if second is None else {first: config, second: config},
                             stage_min_in=2048)
    in_features = 2560
    a, a_values = weight(rng, first, in_features, int(rng.integers(5, 40)), "a")
    b, b_values = weight(rng, second, in_features, 11, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32))
    plain = ops.Product(a, b, tokens=tokens, settings=settings)
    woven = ops.Product(a, b, tokens=tokens, woven=True, settings=settings)
    assert woven.x_woven and dict(woven.template)["WOVEN"] == 1 and dict(plain.template)["WOVEN"] == 0
    assert dict(woven.template)["STAGE"] == int(second is not None)
    woven_x = ops.weave(x)
    assert not np.array_equal(np.array(woven_x.codes), np.array(x.codes))  # the layout moved
    with kernels.poisoned_outputs():
        expected_bits = np.array(plain(x))
        out = np.array(woven(woven_x))
    expected = x_values @ a_values.T
    if second:
        expected = np.concatenate([expected, x_values @ b_values.T], axis=-1)
    assert np.isfinite(out).all() and relative_error(out, expected) <= PRODUCT_BOUND
    np.testing.assert_array_equal(out, expected_bits)


def test_each_product_refuses_the_other_layout(rng):
    a, _ = weight(rng, GGMLType.Q8_0, 96, 8, "odd")
    with pytest.raises(ValueError, match="'odd' takes 96 inputs; woven x needs a multiple of 64"):
        ops.Product(a, woven=True)
    with pytest.raises(ValueError, match="96 values are not whole 64-value units"):
        ops.weave(q8x(rng.standard_normal((1, 96)).astype(np.float32))[0])
    b, _ = weight(rng, GGMLType.Q4_K, 256, 8, "b")
    x, values = q8x(rng.standard_normal((1, 256)).astype(np.float32))
    woven_x = ops.weave(x)
    assert isinstance(woven_x, ops.WovenQ8X) and type(ops.weave(woven_x, woven=False)) is ops.Q8X
    np.testing.assert_array_equal(np.array(woven_x.dequantize()), np.array(x.dequantize()))
    with pytest.raises(ValueError, match="already woven"):
        ops.weave(woven_x)
    with pytest.raises(ValueError, match="not woven"):
        ops.weave(x, woven=False)
    with pytest.raises(ValueError, match="product: the launch reads woven q8x x, got plain"):
        ops.Product(b, woven=True)(x)
    with pytest.raises(ValueError, match="product: the launch reads plain q8x x, got woven"):
        ops.Product(b)(woven_x)
    gate, _ = weight(rng, GGMLType.Q4_K, 256, 32, "gate")
    with pytest.raises(ValueError, match="product_glu: the launch reads plain q8x x, got woven"):
        ops.GatedProduct(gate, gate)(woven_x)


def test_settings_refuse_a_product_config_that_cannot_launch():
    for config, message in [(ops.ProductConfig(2, 4, 3), "unroll must be 1, 2 or 4"),
                            (ops.ProductConfig(2, 4, 1, 2), "wide must be 0 or 1"),
                            (ops.ProductConfig(2, 4, 1, 1, 2), "stage must be 0 or 1"),
                            (ops.ProductConfig(2, 4, 1, 1, 0, 2), "int_floats must be 0 or 1"),
                            (ops.ProductConfig(2, 4, 1, 1, 0, 1, 2), "lean must be 0 or 1"),
                            (ops.ProductConfig(0, 4), "rows and simd_groups must be at least 1")]:
        with pytest.raises(ValueError, match=message):
            with_products({GGMLType.Q4_K: config})
    with pytest.raises(ValueError, match="attention_splits must be 1..128"):
        Settings(attention_splits=129)
    with pytest.raises(ValueError, match="tile_warps must be 1..8"):
        Settings(tile_warps=0)
    with pytest.raises(ValueError, match="tile_threadgroups must be at least 1"):
        Settings(tile_threadgroups=0)
    with pytest.raises(ValueError, match="batch_tiles_from must be at least 1"):
        Settings(batch_tiles_from=0)
    with pytest.raises(ValueError, match="tile_half_from must be at least 1"):
        Settings(tile_half_from=0)
    with pytest.raises(ValueError, match="tile_glu_min_warps must be at least 0"):
        Settings(tile_glu_min_warps=-1)
    with pytest.raises(ValueError, match="tile_glu_split_from must be at least 0"):
        Settings(tile_glu_split_from=-1)
    with pytest.raises(ValueError, match="tile_pairs_from must be at least 0"):
        Settings(tile_pairs_from=-1)
    with pytest.raises(ValueError, match="tile_min_warps must be at least 0"):
        Settings(tile_min_warps=-1)
    with pytest.raises(ValueError, match="batch_attention_splits must be at least 0"):
        Settings(batch_attention_splits=-1)


def test_wide_units_take_at_most_two_tokens_and_fewer_units_at_once(rng):
    """A wide unit holds twice the activations: more than 2 tokens would need more registers
    than product_glu's 512 threads have (nvcc sm_90: 134 a thread at 4 tokens)."""
    settings = with_products({GGMLType.Q4_K: ops.ProductConfig(2, 4, 4, 1)})
    gate, _ = weight(rng, GGMLType.Q4_K, 512, 32, "gate")
    for tokens, unroll, wide in [(1, 2, 1), (2, 1, 1), (3, 1, 0), (8, 1, 0)]:
        for template in (ops.Product(gate, tokens=tokens, settings=settings).template,
                         ops.GatedProduct(gate, gate, tokens=tokens, settings=settings).launch_arguments()[0]):
            assert (dict(template)["UNROLL"], dict(template)["WIDE"]) == (unroll, wide), tokens


def test_a_product_config_for_one_width_overrides_the_format_s(rng):
    narrow_config = ops.ProductConfig(4, 2, 4)
    settings = DEFAULT.replace(products_by_width={**DEFAULT.products_by_width, (GGMLType.Q4_K, 512): narrow_config})
    narrow, _ = weight(rng, GGMLType.Q4_K, 512, 8, "narrow")
    wide, _ = weight(rng, GGMLType.Q4_K, 768, 8, "wide")
    product = ops.Product(narrow, settings=settings)
    template = dict(product.template)
    assert (template["ROWS"], template["UNROLL"], product.threadgroup) == (4, 4, (64, 1, 1))
    # 4 units x 3 tokens: too many registers
    assert dict(ops.Product(narrow, tokens=3, settings=settings).template)["UNROLL"] == 1
    default = DEFAULT.products[GGMLType.Q4_K]
    assert dict(ops.Product(wide, settings=settings).template)["ROWS"] == default.rows
    # product_glu's own override comes first; without one it takes the product's
    glu_settings = settings.replace(glu_by_width={(GGMLType.Q4_K, 512): ops.ProductConfig(1, 8, 2, 1)})
    gate, _ = weight(rng, GGMLType.Q4_K, 512, 32, "gate")
    glu = dict(ops.GatedProduct(gate, gate, settings=glu_settings).launch_arguments()[0])
    assert (glu["ROWS"], glu["UNROLL"], glu["WIDE"]) == (1, 2, 1)
    assert dict(ops.Product(narrow, settings=glu_settings).template)["ROWS"] == 4
    other, _ = weight(rng, GGMLType.Q4_K, 768, 32, "other")
    assert dict(ops.GatedProduct(other, other, settings=glu_settings).launch_arguments()[0])["ROWS"] == default.rows


@pytest.mark.parametrize("cap", [20.0, 0.0], ids=["softcap", "no-softcap"])
def test_lm_head_epilogue_scales_caps_and_picks_the_greedy_row(backend, rng, cap):
    vocab, hidden, scale = 2003, 512, 0.2
    head, head_values = weight(rng, GGMLType.Q6_K, hidden, vocab)
    x, x_values = q8x(rng.standard_normal((2, hidden)).astype(np.float32))
    with kernels.poisoned_outputs():
        logits, best = ops.product(x, head, head=(scale, cap))
        token = np.array(ops.greedy(best))
    expected = x_values @ head_values.T * scale
    if cap:
        expected = cap * np.tanh(expected / cap)
    assert relative_error(np.array(logits), expected) <= PRODUCT_BOUND
    np.testing.assert_array_equal(token, np.argmax(np.array(logits), axis=-1))


def test_greedy_keeps_the_first_of_equal_maxima(backend):
    best = np.zeros((1, 3000, 2), dtype=np.float32)
    best[0, :, 0] = -1.0
    best[0, :, 1] = np.arange(3000) * 4
    best[0, [2999, 1700, 1701], 0] = 5.0
    assert int(np.array(ops.greedy(mx.array(best)))[0]) == 1700 * 4


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 2, 8])  # 8: four rows a SIMD group (ops._config)
def test_product_glu_quantizes_the_gated_product(backend, rng, activation, tokens):
    in_features, ff = 512, 32 * int(rng.integers(1, 6))
    gate, gate_values = weight(rng, GGMLType.Q4_K, in_features, ff, "gate")
    up, up_values = weight(rng, GGMLType.Q6_K, in_features, ff, "up")
    x, x_values = q8x(rng.standard_normal((tokens, in_features)).astype(np.float32))
    with kernels.poisoned_outputs():
        out = ops.product_glu(x, gate, up, activation)
        mx.eval(out)
    g, u = x_values @ gate_values.T, x_values @ up_values.T
    act = g / (1 + np.exp(-g)) if activation == "silu" else 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3)))
    assert out.shape == (tokens, ff)
    assert_within_half_a_code(out, act * u)


def test_product_refuses_a_format_it_has_no_kernel_for(rng):
    w, _ = weight(rng, GGMLType.Q4_1, 256, 8)
    x, _ = q8x(rng.standard_normal((1, 256)).astype(np.float32))
    with pytest.raises(ValueError, match="Q4_1"):
        ops.product(x, w)


@pytest.mark.parametrize("residual, branch_norm, next_norm", [(True, True, True), (True, False, True),
                                                             (False, True, True), (True, True, False)],
                         ids=["sandwich", "plain", "embedding", "post-only"])  # post-only: OLMo 2's
# The kernel cuts a row into slices of ops.norm.SEAM_SLICE_BLOCKS 32-value blocks, one
# threadgroup each: 416 (13 blocks) is one partial slice, 2880 (90 blocks) ends in one. A
# batched step's 64 rows: slices of up to SEAM_WIDE_BLOCKS blocks (6656: two of 104).
@pytest.mark.parametrize("hidden, tokens", [(256, 2), (6656, 2), (416, 3), (2880, 3), (6656, 64)])
@pytest.mark.parametrize("chunks", [1, 3], ids=["", "chunked"])  # a tile product's partial sums, added
def test_residual_norm_quant_matches_numpy(backend, rng, residual, branch_norm, next_norm, hidden, tokens, chunks):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32) * 3
    parts = rng.standard_normal((chunks, tokens, hidden)).astype(np.float32) * 40
    branch = parts.astype(np.float64).sum(axis=0)
    branch_weight, next_weight = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    with kernels.poisoned_outputs():
        total, normed = ops.residual_norm_quant(mx.array(x) if residual else None, mx.array(parts if chunks > 1 else parts[0]),
                                                mx.array(branch_weight) if branch_norm else None,
                                                mx.array(next_weight) if next_norm else None, 1e-8, 1e-5, 0.75,
                                                chunked=chunks > 1)
        mx.eval(total, normed)
    b = branch.astype(np.float64)
    if branch_norm:
        b = rms(b, 1e-8) * branch_weight
    expected = b * 0.75 + (x if residual else 0)
    assert relative_error(np.array(total), expected) <= 1e-5  # float32 sums of 6656 squares
    assert_within_half_a_code(normed, rms(expected, 1e-5) * next_weight if next_norm else expected)


# --- attention -------------------------------------------------------------------------------

HEAD_DIM = 64
# attention_case's (heads, kv_heads, gate, bias, qk_norm, rope_spec, softcap) of each model's
# form: OLMo 2's q/k norm over the whole projections with a bias (none of its own, but the sum
# of squares takes it), Gemma 2's capped scores (a cap of 0.5 bites scores of ~1-3).
ATTENTION_VARIANTS = {
    "muse": (8, 2, True, False, True, (64, True), None),
    "llama": (4, 2, False, False, False, (64, False), None),
    "qwen2": (4, 1, False, True, False, (32, False), None),
    "gqa-3": (6, 2, False, False, True, None, None),
    "olmo2": (6, 2, False, True, "whole", (64, False), None),
    "gemma2": (4, 2, False, False, False, (64, False), 0.5),
}


def attention_case(rng, heads, kv_heads, capacity, position, gate, bias, qk_norm, rope_spec, softcap=None,
                   shared: dict | None = None):
    """Random projections and a cache that already holds positions < position; the numpy
    float64 result of attention_decode for them: (inputs, expected o, expected key/value rows).
    qk_norm: False, True (per head) or "whole" (over each whole projection, OLMo 2's); softcap:
    the scores' cap (Gemma 2's) or None. shared: another case's inputs, whose norm weights and
    bias this one takes (a batch's rows share the model's)."""
    q_width, kv_width = heads * HEAD_DIM, kv_heads * HEAD_DIM
    gate_off = q_width + 2 * kv_width if gate else None
    y = rng.standard_normal((1, q_width + 2 * kv_width + (q_width if gate else 0))).astype(np.float32)
    keys = (rng.standard_normal((1, kv_heads, capacity, HEAD_DIM))).astype(np.float16)
    values = (rng.standard_normal((1, kv_heads, capacity, HEAD_DIM))).astype(np.float16)
    whole = qk_norm == "whole"
    weights = [rng.uniform(0.5, 1.5, size).astype(np.float32)
               for size in ((q_width, kv_width) if whole else (HEAD_DIM, HEAD_DIM))] if qk_norm else [None, None]
    bias_values = (0.3 * rng.standard_normal(q_width + 2 * kv_width)).astype(np.float32) if bias else None
    if shared is not None:
        weights = [np.array(shared[k]) if shared[k] is not None else None for k in ("q_weight", "k_weight")]
        bias_values = np.array(shared["bias"]) if shared["bias"] is not None else None
    rope_dict = None if rope_spec is None else dict(dims=rope_spec[0], traditional=rope_spec[1], base=10000.0)
    eps, scale = 1e-6, HEAD_DIM**-0.5
    # numpy float64
    yy = y[0].astype(np.float64) + np.concatenate([bias_values, np.zeros(y.shape[1] - bias_values.size)]) \
        if bias else y[0].astype(np.float64)
    q = yy[:q_width].reshape(heads, HEAD_DIM)
    k = yy[q_width : q_width + kv_width].reshape(kv_heads, HEAD_DIM)
    v = yy[q_width + kv_width : q_width + 2 * kv_width].reshape(kv_heads, HEAD_DIM)
    if whole:
        q = (rms(q.reshape(-1), eps) * weights[0]).reshape(heads, HEAD_DIM)
        k = (rms(k.reshape(-1), eps) * weights[1]).reshape(kv_heads, HEAD_DIM)
    elif qk_norm:
        q, k = rms(q, eps) * weights[0], rms(k, eps) * weights[1]
    if rope_dict:
        pos = np.array([float(position)])
        q = rope(q[None], pos, rope_dict["dims"], 10000.0, rope_dict["traditional"])[0]
        k = rope(k[None], pos, rope_dict["dims"], 10000.0, rope_dict["traditional"])[0]
    new_k, new_v = k.astype(np.float16), v.astype(np.float16)
    slot, count = position % capacity, min(position + 1, capacity)
    stored_k = keys[0].astype(np.float64).copy()
    stored_v = values[0].astype(np.float64).copy()
    stored_k[:, slot], stored_v[:, slot] = new_k, new_v
    group = heads // kv_heads
    o = np.empty((heads, HEAD_DIM))
    for h in range(heads):
        scores = stored_k[h // group, :count] @ q[h] * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        p = np.exp(scores - scores.max())
        o[h] = p @ stored_v[h // group, :count] / p.sum()
    o = o.reshape(1, -1)
    if gate:
        o = o / (1 + np.exp(-y[:, gate_off:].astype(np.float64)))
    inputs = dict(y=mx.array(y), keys=mx.array(keys), values=mx.array(values),
                  position=mx.array([position], dtype=mx.int32), after=mx.array([0], dtype=mx.int32),
                  heads=heads, kv_heads=kv_heads,
                  head_dim=HEAD_DIM, offsets=(0, q_width, q_width + kv_width), gate=gate_off,
                  q_weight=mx.array(weights[0]) if qk_norm else None,
                  k_weight=mx.array(weights[1]) if qk_norm else None,
                  bias=mx.array(bias_values) if bias else None, rope=rope_dict, eps=eps, scale=scale,
                  qk_norm_whole=whole, softcap=softcap)
    return inputs, o, (slot, new_k, new_v, keys, values)


@pytest.mark.parametrize("capacity, position", [(256, 0), (256, 1), (256, 200), (8, 5), (8, 8), (8, 29), (4096, 3000)],
                         ids=["first", "second", "full-200", "ring-filling", "ring-wraps", "ring-29", "long"])
@pytest.mark.parametrize("variant", ["muse", "llama", "qwen2", "gqa-3", "olmo2", "gemma2"])
@pytest.mark.parametrize("splits", [64, 128], ids=["64-splits", "128-splits"])
def test_attention_decode_matches_numpy_and_writes_its_slot(backend, rng, capacity, position, variant, splits):
    if splits != 64 and capacity < 4096:
        pytest.skip("only a long cache has more than 64 splits")
    inputs, expected, (slot, new_k, new_v, keys, values) = attention_case(
        rng, *ATTENTION_VARIANTS[variant][:2], capacity, position, *ATTENTION_VARIANTS[variant][2:])
    heads = inputs["heads"]
    with kernels.poisoned_outputs():
        out, cache_keys, cache_values = ops.attention_decode(**inputs, splits=splits)
        mx.eval(out, cache_keys, cache_values)
    assert out.shape == (1, heads * HEAD_DIM)
    assert_within_half_a_code(out, expected, slack=2e-3)  # float32 angles, exp
    written_keys, written_values = np.array(cache_keys), np.array(cache_values)
    np.testing.assert_allclose(written_keys[0, :, slot].astype(np.float64), new_k, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(written_values[0, :, slot].astype(np.float64), new_v, atol=2e-3, rtol=2e-3)
    others = np.arange(capacity) != slot
    np.testing.assert_array_equal(written_keys[:, :, others], keys[:, :, others])
    np.testing.assert_array_equal(written_values[:, :, others], values[:, :, others])


@pytest.mark.parametrize("capacity, positions", [(8, (5, 29, 8)), (256, (200, 0, 17))], ids=["ring", "full"])
@pytest.mark.parametrize("variant", ["muse", "olmo2", "gemma2"])
def test_attention_decode_over_a_batchs_rows(backend, rng, capacity, positions, variant):
    """rows=3 (the batched step's): each row its own position, projections and store row, against
    numpy; store row 3 (no sequence) untouched; o's rows 3..7 (padding) zeros."""
    heads, kv_heads = ATTENTION_VARIANTS[variant][:2]
    first = attention_case(rng, heads, kv_heads, capacity, positions[0], *ATTENTION_VARIANTS[variant][2:])
    cases = [first] + [attention_case(rng, heads, kv_heads, capacity, position, *ATTENTION_VARIANTS[variant][2:],
                                      shared=first[0]) for position in (*positions[1:], 0)]
    inputs = dict(cases[0][0], rows=3, out_rows=8,
                  y=mx.concatenate([case[0]["y"] for case in cases]),
                  keys=mx.concatenate([case[0]["keys"] for case in cases]),
                  values=mx.concatenate([case[0]["values"] for case in cases]),
                  position=mx.array([*positions, 0], dtype=mx.int32))
    with kernels.poisoned_outputs():
        out, cache_keys, cache_values = ops.attention_decode(**inputs)
        mx.eval(out, cache_keys, cache_values)
    assert out.shape == (8, heads * HEAD_DIM)
    written_keys, written_values = np.array(cache_keys), np.array(cache_values)
    for row, (_, expected, (slot, new_k, new_v, keys, values)) in enumerate(cases[:3]):
        assert_within_half_a_code(ops.Q8X(*(part[row : row + 1] for part in out)), expected, slack=2e-3)
        np.testing.assert_allclose(written_keys[row, :, slot].astype(np.float64), new_k, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(written_values[row, :, slot].astype(np.float64), new_v, atol=2e-3, rtol=2e-3)
        others = np.arange(capacity) != slot
        np.testing.assert_array_equal(written_keys[row, :, others], keys[0, :, others])
        np.testing.assert_array_equal(written_values[row, :, others], values[0, :, others])
    np.testing.assert_array_equal(written_keys[3], cases[3][2][3][0])
    np.testing.assert_array_equal(written_values[3], cases[3][2][4][0])
    assert not np.array(out.codes)[3:].any() and not np.array(out.scales)[3:].any()


@pytest.mark.parametrize("variant", ["muse", "llama"])
def test_attention_decode_writes_woven_x_for_the_o_projection(backend, rng, variant):
    """woven=True: the same q8x o, its codes and sums at their woven places (ops.weave)."""
    heads, kv_heads, gate, qk_norm, rope_spec = {"muse": (40, 8, True, True, (64, True)),  # 2,560 values
                                                 "llama": (4, 2, False, False, (64, False))}[variant]
    inputs, expected, _ = attention_case(rng, heads, kv_heads, 256, 200, gate, False, qk_norm, rope_spec)
    with kernels.poisoned_outputs():
        plain = ops.attention_decode(**inputs)[0]
        mx.eval(plain)
        woven = ops.attention_decode(**inputs, woven=True)[0]
        mx.eval(woven)
    assert isinstance(woven, ops.WovenQ8X) and not isinstance(plain, ops.WovenQ8X)
    assert_within_half_a_code(ops.weave(woven, woven=False), expected, slack=2e-3)
    codes, sums = formats.weave_activations(np.array(plain.codes), np.array(plain.sums))
    np.testing.assert_array_equal(np.array(woven.codes), codes)
    np.testing.assert_array_equal(np.array(woven.sums), sums)
    np.testing.assert_array_equal(np.array(woven.scales), np.array(plain.scales))


def test_attention_decode_refuses_a_float32_cache(rng):
    inputs, _, _ = attention_case(rng, 4, 2, 8, 3, False, False, False, None)
    inputs["keys"] = inputs["keys"].astype(mx.float32)
    with pytest.raises(ValueError, match="float16"):
        ops.attention_decode(**inputs)


def test_attention_dtype_is_float16_only_for_gpu_prefill_chunks_cudnn_takes():
    assert ops.attention_dtype(512, 128, "cuda") == mx.float16
    assert ops.attention_dtype(ops.MATVEC_MAX_TOKENS + 1, 64, "metal") == mx.float16
    assert ops.attention_dtype(ops.MATVEC_MAX_TOKENS, 128, "cuda") == mx.float32  # decode steps stay exact
    assert ops.attention_dtype(512, 256, "cuda") == mx.float32  # cuDNN takes head_dim <= 128
    assert ops.attention_dtype(512, 100, "cuda") == mx.float32
    assert ops.attention_dtype(512, 128, "cpu") == mx.float32


@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens, keys", [(4, 2, 64, 37, 80), (8, 8, 128, 16, 16)])
def test_prefill_attention_in_float16_matches_numpy(backend, rng, heads, kv_heads, head_dim, tokens, keys):
    """A GPU prefill chunk's attention with float16 keys/values (ops.attention_dtype): q, keys,
    values and the probabilities rounded to float16 (unit roundoff 2^-11 = 4.9e-4 each), so
    the output is within a few of those of float64: bound 3e-3."""
    if backend == "cpu":
        pytest.skip("float16 attention inputs are the GPU prefill path")
    q = rng.standard_normal((1, heads, tokens, head_dim)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, keys, head_dim)).astype(np.float16)
    v = rng.standard_normal((1, kv_heads, keys, head_dim)).astype(np.float16)
    positions = np.arange(keys)
    queries = np.arange(keys - tokens, keys)
    mask = (positions[None, :] <= queries[:, None]) & (positions[None, :] > queries[:, None] - 24)
    scale = head_dim ** -0.5
    out = ops.attention(mx.array(q), mx.array(k), mx.array(v), scale, mx.array(mask))
    assert out.dtype == mx.float32
    group = heads // kv_heads
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k64) * scale
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.einsum("bhts,bhsd->bhtd", p, v64)
    assert relative_error(np.array(out), expected) <= 3e-3
