"""ops.residual_norm and ops.residual_norm_quant, the seam between a layer's branches, against
numpy float64."""

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import kernels, ops
from muser_mlx.reference import rms
from tests.conftest import relative_error
from tests.test_decode_kernels import assert_within_half_a_code


def reference(residual, branch, branch_weight, next_weight, branch_eps, next_eps):
    rms = lambda v, e: v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + e)  # noqa: E731
    added = rms(branch, branch_eps) * branch_weight if branch_weight is not None else branch
    total = residual + added
    return total, rms(total, next_eps) * next_weight


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])  # at 1e-3, the fixed 1e-8 eps matters
@pytest.mark.parametrize("sandwich", [True, False])
@pytest.mark.parametrize("rows, hidden", [(1, 6656), (7, 640), (3, 576), (2, 100)])
def test_residual_norm_matches_numpy(backend, rng, sandwich, rows, hidden, scale):
    residual = rng.standard_normal((rows, hidden)) * 3
    branch = rng.standard_normal((rows, hidden)) * scale
    branch_weight = rng.uniform(0.5, 1.5, hidden) if sandwich else None
    next_weight = rng.uniform(0.5, 1.5, hidden)
    as_mx = lambda v: None if v is None else mx.array(v.astype(np.float32))  # noqa: E731
    total, normed = ops.residual_norm(as_mx(residual), as_mx(branch), as_mx(branch_weight),
                                      as_mx(next_weight), 1e-8, 1e-5)
    expected_total, expected_normed = reference(residual, branch, branch_weight, next_weight, 1e-8, 1e-5)
    assert relative_error(total, expected_total) <= 1e-5
    assert relative_error(normed, expected_normed) <= 1e-5


# ops.residual_norm_quant cuts a row into slices of ops.norm.SEAM_SLICE_BLOCKS 32-value blocks,
# one threadgroup each: 416 (13 blocks) is one partial slice, 2880 (90 blocks) ends in one, and
# 3 tokens make threadgroups of several rows (tests/test_decode_kernels.py has the model's sizes).
@pytest.mark.parametrize("residual, branch_norm", [(True, True), (True, False), (False, True)],
                         ids=["sandwich", "plain", "embedding"])
@pytest.mark.parametrize("hidden", [416, 2880])
def test_residual_norm_quant_partial_slices(backend, rng, residual, branch_norm, hidden):
    x = rng.standard_normal((3, hidden)).astype(np.float32) * 3
    branch = rng.standard_normal((3, hidden)).astype(np.float32) * 40
    branch_weight, next_weight = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    with kernels.poisoned_outputs():
        total, normed = ops.residual_norm_quant(mx.array(x) if residual else None, mx.array(branch),
                                                mx.array(branch_weight) if branch_norm else None,
                                                mx.array(next_weight), 1e-8, 1e-5, 0.75)
        mx.eval(total, normed)
    b = branch.astype(np.float64)
    if branch_norm:
        b = rms(b, 1e-8) * branch_weight
    expected = b * 0.75 + (x if residual else 0)
    assert relative_error(total, expected) <= 1e-5
    assert_within_half_a_code(normed, rms(expected, 1e-5) * next_weight)
