"""ops.residual_norm, the seam between a layer's branches, against numpy float64."""

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import ops
from tests.conftest import relative_error


def reference(residual, branch, branch_weight, next_weight, branch_eps, next_eps):
    rms = lambda v, e: v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + e)  # noqa: E731
    added = rms(branch, branch_eps) * branch_weight if branch_weight is not None else branch
    total = residual + added
    return total, total if next_weight is None else rms(total, next_eps) * next_weight


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])  # at 1e-3, the fixed 1e-8 eps matters
# post_only: OLMo 2's seam, a post-norm and no next norm (the next branch reads the sum itself)
@pytest.mark.parametrize("norms", ["sandwich", "plain", "post_only"])
@pytest.mark.parametrize("rows, hidden", [(1, 6656), (7, 640), (3, 576), (2, 100)])
def test_residual_norm_matches_numpy(backend, rng, norms, rows, hidden, scale):
    residual = rng.standard_normal((rows, hidden)) * 3
    branch = rng.standard_normal((rows, hidden)) * scale
    branch_weight = rng.uniform(0.5, 1.5, hidden) if norms != "plain" else None
    next_weight = rng.uniform(0.5, 1.5, hidden) if norms != "post_only" else None
    as_mx = lambda v: None if v is None else mx.array(v.astype(np.float32))  # noqa: E731
    total, normed = ops.residual_norm(as_mx(residual), as_mx(branch), as_mx(branch_weight),
                                      as_mx(next_weight), 1e-8, 1e-5)
    expected_total, expected_normed = reference(residual, branch, branch_weight, next_weight, 1e-8, 1e-5)
    assert relative_error(total, expected_total) <= 1e-5
    assert relative_error(normed, expected_normed) <= 1e-5


@pytest.mark.parametrize("sandwich", [True, False])
@pytest.mark.parametrize("rows, hidden", [(512, 6656), (9, 640), (20, 100)])
def test_a_float16_branch_is_widened_by_the_gpu_seam(backend, rng, sandwich, rows, hidden):
    """A GPU prefill product's float16 output as the branch (transformer.PREFILL_FUSED): the
    seam reads it as it is, one launch (ops.norm.SEAM_ROWS_KERNEL), against numpy on the same
    float16 values."""
    if backend == "cpu":
        pytest.skip("a GPU seam: the CPU's products return float32")
    residual = (rng.standard_normal((1, rows, hidden)) * 3).astype(np.float32)
    branch = (rng.standard_normal((1, rows, hidden)) * 20).astype(np.float16)
    branch_weight = rng.uniform(0.5, 1.5, hidden).astype(np.float32) if sandwich else None
    next_weight = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    total, normed = ops.residual_norm(mx.array(residual), mx.array(branch),
                                      None if branch_weight is None else mx.array(branch_weight),
                                      mx.array(next_weight), 1e-6, 1e-5)
    assert total.dtype == normed.dtype == mx.float32
    expected_total, expected_normed = reference(residual, branch.astype(np.float64), branch_weight, next_weight,
                                                1e-6, 1e-5)
    assert relative_error(total, expected_total) <= 1e-5
    assert relative_error(normed, expected_normed) <= 1e-5
