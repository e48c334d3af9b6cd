"""The MLX-ops block decoders (the CPU route of every kernel) against the numpy reference."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import formats, testing
from muser_mlx.dequant import AFFINE_CODE_TYPES, affine_codes, dequantize_rows
from tests.conftest import relative_error
from tests.test_linear import FORMATS

# The largest code each affine format can hold (its bit width).
CODE_MAX = {GGMLType.Q4_0: 15, GGMLType.Q4_1: 15, GGMLType.Q4_K: 15, GGMLType.Q5_0: 31,
            GGMLType.Q5_1: 31, GGMLType.Q5_K: 31, GGMLType.Q8_0: 255}


def random_rows(rng, ggml_type):
    row_length = max(formats.FORMATS[ggml_type].block_size, 256) * int(rng.integers(1, 3))
    count = int(rng.integers(1, 12))
    raw = testing.random_blocks(rng, ggml_type, count, row_length)
    reference = formats.dequantize(raw, ggml_type, [row_length, count]).astype(np.float64)
    return mx.array(np.asarray(raw).view(np.uint8).reshape(count, -1)), reference


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_dequantize_rows_matches_the_reference(rng, ggml_type):
    rows, reference = random_rows(rng, ggml_type)
    out = dequantize_rows(rows, ggml_type)
    assert relative_error(np.array(out), reference) <= 1e-6  # float32 rounding of d * q


def test_affine_codes_cover_exactly_the_formats_with_one_scale_per_32_values():
    assert AFFINE_CODE_TYPES == set(CODE_MAX)


@pytest.mark.parametrize("ggml_type", sorted(AFFINE_CODE_TYPES), ids=lambda t: t.name)
def test_affine_codes_rebuild_the_reference_values(rng, ggml_type):
    rows, reference = random_rows(rng, ggml_type)
    codes, scale, bias = affine_codes(rows, ggml_type)
    assert codes.dtype == mx.uint8 and codes.shape == reference.shape
    assert scale.shape == bias.shape == (reference.shape[0], reference.shape[1] // 32)
    codes = np.array(codes)
    assert codes.max() <= CODE_MAX[ggml_type]
    assert len(np.unique(codes)) > CODE_MAX[ggml_type] // 2  # the codes vary: not a constant
    groups = codes.reshape(codes.shape[0], -1, 32).astype(np.float64)
    values = groups * np.array(scale)[..., None] + np.array(bias)[..., None]
    assert relative_error(values.reshape(reference.shape), reference) <= 1e-6
