"""ops.qk_norm_rope (per-head RMS norm + RoPE of q and k, head-major) against numpy float64."""

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import kernels, ops
from tests.conftest import relative_error


def reference(y, weight, heads, head_dim, eps, start, rope):
    batch, tokens, _ = y.shape
    y = y.reshape(batch, tokens, heads, head_dim).transpose(0, 2, 1, 3).astype(np.float64)
    y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * weight
    if rope is None:
        return y
    dims = rope["dims"]
    angles = (start + np.arange(tokens))[:, None] * rope["base"] ** (-np.arange(0, dims, 2) / dims)
    cos, sin = np.cos(angles), np.sin(angles)
    out = y.copy()
    if rope["traditional"]:
        a, b = y[..., 0:dims:2], y[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = y[..., : dims // 2], y[..., dims // 2 : dims]
        out[..., : dims // 2], out[..., dims // 2 : dims] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("rope", [None, (64, True), (64, False), (32, True), (32, False)],
                         ids=["none", "pairs", "halves", "partial-pairs", "partial-halves"])
@pytest.mark.parametrize("batch, tokens, start", [(1, 1, 0), (1, 1, 4099), (2, 5, 17), (1, 40, 300)])
def test_qk_norm_rope_matches_numpy(backend, rng, rope, batch, tokens, start):
    heads, kv_heads, head_dim, eps = 4, 2, 64, 1e-6
    rope = None if rope is None else dict(dims=rope[0], traditional=rope[1], base=10000.0)
    q = rng.standard_normal((batch, tokens, heads * head_dim)).astype(np.float32) * 3
    k = rng.standard_normal((batch, tokens, kv_heads * head_dim)).astype(np.float32)
    q_weight, k_weight = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    with kernels.poisoned_outputs():
        q_out, k_out = ops.qk_norm_rope(mx.array(q), mx.array(k), mx.array(q_weight), mx.array(k_weight),
                                        heads, kv_heads, head_dim, eps, start, rope)
        q_out, k_out = np.array(q_out), np.array(k_out)
    assert q_out.shape == (batch, heads, tokens, head_dim)
    assert k_out.shape == (batch, kv_heads, tokens, head_dim)
    # float32 angles at positions up to ~4100 carry ~2e-4 rad of rounding; MLX's rope alike.
    bound = 1e-3 if start > 1000 else 2e-5
    assert relative_error(q_out, reference(q, q_weight, heads, head_dim, eps, start, rope)) <= bound
    assert relative_error(k_out, reference(k, k_weight, kv_heads, head_dim, eps, start, rope)) <= bound


@pytest.mark.parametrize("rope", [None, (64, False), (32, True)], ids=["none", "halves", "partial-pairs"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_q_and_k_read_in_place_from_one_stack_and_written_in_the_attentions_dtype(backend, rng, rope, dtype):
    """A prefill chunk's q/k/v/gate stack as one array: q and k read from their columns (no copy
    of either), in the stack's dtype (a GPU prefill product's float16 output as it is), and
    written in `dtype`, rounded once from the float32 result."""
    heads, kv_heads, head_dim, eps, start, batch, tokens = 4, 2, 64, 1e-6, 9, 2, 13
    rope = None if rope is None else dict(dims=rope[0], traditional=rope[1], base=10000.0)
    # q at columns 0.., k after it, then v and a gate: the stack Muse Glimmer's layers have.
    width = (2 * heads + 2 * kv_heads) * head_dim
    stack_dtype = np.float16 if backend != "cpu" else np.float32  # the CPU's products are float32
    stack = (rng.standard_normal((batch, tokens, width)) * 3).astype(stack_dtype)
    q_weight, k_weight = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    k_first = heads * head_dim
    with kernels.poisoned_outputs():
        q_out, k_out = ops.qk_norm_rope(mx.array(stack), mx.array(stack), mx.array(q_weight), mx.array(k_weight),
                                        heads, kv_heads, head_dim, eps, start, rope, columns=(0, k_first),
                                        dtype=dtype)
    assert q_out.dtype == k_out.dtype == dtype
    values = stack.astype(np.float64)
    expected_q = reference(values[..., :k_first], q_weight, heads, head_dim, eps, start, rope)
    expected_k = reference(values[..., k_first : k_first + kv_heads * head_dim], k_weight, kv_heads, head_dim, eps,
                           start, rope)
    bound = 2e-5 if dtype == mx.float32 else 1e-3  # float16 output: 2^-11 relative a value
    assert relative_error(np.array(q_out), expected_q) <= bound
    assert relative_error(np.array(k_out), expected_k) <= bound


def test_columns_past_the_array_are_refused(rng):
    q = mx.zeros((1, 3, 256))
    with pytest.raises(ValueError, match="do not fit"):
        ops.qk_norm_rope(q, q, mx.ones(64), mx.ones(64), 4, 2, 64, 1e-6, 0, None, columns=(0, 200))
