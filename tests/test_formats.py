"""Block formats: the numpy reference against gguf-py, and the quantizers' rounding."""

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import formats, testing
from tests.conftest import relative_error

ALL = list(formats.FORMATS)
# Round-trip error on unit Gaussian rows, ‖dequant(quant(x)) − x‖ / ‖x‖: an upper bound a bit
# above what llama.cpp's reference rounding gives for each format.
ROUND_TRIP_BOUND = {
    GGMLType.F32: 0.0,
    GGMLType.F16: 5e-4,
    GGMLType.BF16: 4e-3,
    GGMLType.Q8_0: 8e-3,
    GGMLType.Q6_K: 2.5e-2,
    GGMLType.Q5_K: 4.5e-2,
    GGMLType.Q5_1: 5e-2,
    GGMLType.Q5_0: 5.5e-2,
    GGMLType.Q4_K: 8e-2,
    GGMLType.Q4_1: 9e-2,
    GGMLType.Q4_0: 1e-1,
}
# gguf-py implements these quantizers with llama.cpp's rounding: ours must match bit for bit.
GGUF_PY_QUANTIZERS = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.BF16]


def random_valid_bytes(rng, ggml_type, blocks):
    """Random quants with random finite f16 scales: every bit pattern a real file may hold."""
    return testing.random_blocks(rng, ggml_type, blocks, formats.FORMATS[ggml_type].block_size)


@pytest.mark.parametrize("ggml_type", ALL, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_on_random_quants(rng, ggml_type):
    fmt = formats.FORMATS[ggml_type]
    # Random bytes everywhere, then finite f16 scale fields: exercises every quant value.
    raw = rng.integers(0, 256, size=(64, fmt.type_size), dtype=np.uint8)
    scale_fields = {
        GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q5_0: [0], GGMLType.Q5_1: [0, 2],
        GGMLType.Q8_0: [0], GGMLType.Q2_K: [80, 82], GGMLType.Q3_K: [108], GGMLType.Q4_K: [0, 2],
        GGMLType.Q5_K: [0, 2], GGMLType.Q6_K: [208], GGMLType.IQ4_NL: [0], GGMLType.IQ4_XS: [0],
    }.get(ggml_type, [])
    for start in scale_fields:
        raw[:, start : start + 2] = rng.normal(0, 0.1, (64, 1)).astype(np.float16).view(np.uint8)
    if fmt.block_size == 1:
        raw = random_valid_bytes(rng, ggml_type, 64)
    shape = [fmt.block_size * 4, 16]
    ours = formats.dequantize(raw, ggml_type, shape)
    theirs = gguf.quants.dequantize(raw.reshape(16, -1), ggml_type)
    assert ours.shape == (16, fmt.block_size * 4)
    assert np.isfinite(ours).all()
    # Same float32 arithmetic in the same order: equal to rounding (here, exactly).
    assert relative_error(ours, theirs) <= 1e-6


@pytest.mark.parametrize("ggml_type", list(formats.QUANTIZABLE), ids=lambda t: t.name)
def test_quantize_round_trip_error_is_bounded(rng, ggml_type):
    values = rng.standard_normal((32, 512)).astype(np.float32)
    raw = formats.quantize(values, ggml_type)
    assert raw.shape == (32, formats.FORMATS[ggml_type].row_bytes(512))
    back = formats.dequantize(raw, ggml_type, [512, 32])
    error = relative_error(back, values)
    assert error <= ROUND_TRIP_BOUND[ggml_type]
    if ggml_type != GGMLType.F32:
        assert error > 0  # a lossy format that loses nothing was not exercised


@pytest.mark.parametrize("ggml_type", GGUF_PY_QUANTIZERS, ids=lambda t: t.name)
def test_quantize_is_bit_exact_with_gguf_py(rng, ggml_type):
    values = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 10, (16, 1))).astype(np.float32)
    ours = formats.quantize(values, ggml_type)
    theirs = gguf.quants.quantize(values, ggml_type)
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))


def test_q4_k_error_is_below_q4_1_and_k_quants_order_by_bits(rng):
    values = rng.standard_normal((64, 1024)).astype(np.float32)
    error = {
        t: relative_error(formats.dequantize(formats.quantize(values, t), t, [1024, 64]), values)
        for t in (GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
    }
    assert error[GGMLType.Q6_K] < error[GGMLType.Q5_K] < error[GGMLType.Q4_K] < error[GGMLType.Q4_1]


def test_quantize_handles_constant_and_zero_blocks():
    values = np.zeros((2, 256), dtype=np.float32)
    values[1] = 3.0
    for ggml_type in formats.QUANTIZABLE:
        back = formats.dequantize(formats.quantize(values, ggml_type), ggml_type, [256, 2])
        assert np.isfinite(back).all(), ggml_type.name
        assert np.abs(back[0]).max() == 0, ggml_type.name


def test_q4_k_element_follows_the_four_level_address(rng):
    """Decode one element by hand from the seed's address and compare with the decoder."""
    raw = testing.random_blocks(rng, GGMLType.Q4_K, 1, 512)[0]
    element = int(rng.integers(0, 512))
    block = raw[(element // 256) * 144 :][:144]
    within = element % 256
    group, within_group = within // 64, within % 64
    sub_block = 2 * group + (within_group >= 32)
    lane = within_group % 32
    scales = block[4:16]
    if sub_block < 4:
        scale, minimum = scales[sub_block] & 63, scales[sub_block + 4] & 63
    else:
        scale = (scales[sub_block + 4] & 15) | ((scales[sub_block - 4] >> 6) << 4)
        minimum = (scales[sub_block + 4] >> 4) | ((scales[sub_block] >> 6) << 4)
    packed = block[16 + 32 * group + lane]
    quant = packed & 15 if within_group < 32 else packed >> 4
    d, dmin = block[0:4].view(np.float16).astype(np.float32)
    expected = d * np.float32(scale) * np.float32(quant) - dmin * np.float32(minimum)
    assert formats.dequantize(raw, GGMLType.Q4_K, [512])[element] == expected


def test_unknown_formats_are_named_errors():
    with pytest.raises(formats.UnsupportedFormatError, match="TQ1_0"):
        formats.block_format(GGMLType.TQ1_0)
    with pytest.raises(formats.UnsupportedFormatError, match="unknown ggml type 999"):
        formats.block_format(999)
    with pytest.raises(formats.UnsupportedFormatError, match="no quantizer for Q2_K"):
        formats.quantize(np.ones((1, 256), np.float32), "Q2_K")


def test_row_not_whole_blocks_and_wrong_byte_count_are_errors():
    with pytest.raises(ValueError, match="not a whole number of 256-element blocks"):
        formats.quantize(np.ones((1, 100), np.float32), GGMLType.Q4_K)
    with pytest.raises(ValueError, match="needs 144 bytes, got 143"):
        formats.dequantize(np.zeros(143, np.uint8), GGMLType.Q4_K, [256])


def test_activations_rounded_per_256_values_lie_within_half_a_step(rng):
    # q8_K, the CPU decode step's x for K-quant products: one scale per 256 values.
    x = (rng.standard_normal((3, 768)) * rng.choice([1e-3, 1.0, 50.0], size=(3, 1))).astype(np.float32)
    x[1, 256:512] = 0
    codes, scales = formats.quantize_activations_super(x)
    assert codes.dtype == np.int8 and codes.shape == x.shape and scales.shape == (3, 3)
    blocks = x.reshape(3, 3, 256)
    np.testing.assert_array_equal(scales, np.abs(blocks).max(axis=-1) / np.float32(127))
    assert np.abs(codes).max() <= 127
    assert (np.abs(codes.reshape(3, 3, 256)).max(axis=-1)[scales > 0] == 127).all()
    assert not codes[1, 256:512].any()
    error = np.abs(formats.dequantize_activations(codes, scales) - x).reshape(3, 3, 256)
    assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()


def test_activations_of_a_partial_256_value_block_are_refused():
    with pytest.raises(ValueError, match="not whole 256-value blocks"):
        formats.quantize_activations_super(np.zeros((1, 288), np.float32))


def test_woven_layout_puts_each_run_s_pieces_side_by_side(rng):
    """formats.woven_positions, by hand: in a run of n units, code piece k of unit j starts at
    16 (k n + j); 2,560 values are a run of 32 units, then one of 8."""
    at = formats.woven_positions(2560, 64, 16)
    assert sorted(at) == list(range(2560))
    for value, place in [(0, 0), (15, 15), (16, 16 * 32), (64, 16), (64 * 31 + 48, 16 * (3 * 32 + 31)),
                         (2048, 2048), (2048 + 16, 2048 + 16 * 8), (2048 + 64 * 7 + 63, 2048 + 16 * (3 * 8 + 7) + 15)]:
        assert at[value] == place, value
    sums = formats.woven_positions(320, 8, 4)  # the same 2,560 values' sums, 4 a piece
    assert [sums[i] for i in (0, 4, 8, 256 + 4, 319)] == [0, 4 * 32, 4, 256 + 4 * 8, 256 + 4 * (8 + 7) + 3]
    codes, _, sums_values = formats.quantize_activations(rng.standard_normal((2, 2560)).astype(np.float32))
    woven_codes, woven_sums = formats.weave_activations(codes, sums_values)
    np.testing.assert_array_equal(woven_codes[:, at], codes)
    back = formats.weave_activations(woven_codes, woven_sums, woven=False)
    np.testing.assert_array_equal(back[0], codes)
    np.testing.assert_array_equal(back[1], sums_values)
    with pytest.raises(ValueError, match="not whole units of 64"):
        formats.woven_positions(96, 64, 16)
