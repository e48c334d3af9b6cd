"""Every kernel through its op's real GPU path, run on the CPU by the emulator (tests/emulate.py:
the Metal rendering compiled with g++, GPU launch semantics), against the numpy reference; then
broken variants of our kernels, which the emulator must catch.

Shapes are fixed and small (each template instantiation is one g++ build, cached on disk) and
chosen to leave partial threadgroups, several SIMD groups per threadgroup and rows that are no
multiple of ROWS; inputs are fresh random values. Outputs start as NaN (poisoned_outputs).
"""

import dataclasses
import importlib
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import formats, gguf, kernels, ops, testing
from muser_mlx.kernels import KernelSource
from muser_mlx.models import build_model
from muser_mlx.reference import Reference, rms
from muser_mlx.settings import DEFAULT, Settings
from tests.conftest import gpu_available, relative_error, tile_settings
from tests.emulate import EmulationError, emulated_gpu, run
from tests.test_decode_kernels import (ATTENTION_VARIANTS, HALF_PRODUCT_BOUND, PRODUCT_BOUND, TILE_FORMS,
                                       assert_within_half_a_code, attention_case, q8x, weight)
from tests.test_models import FUSED_NUMERICS_BOUND, decode_one_by_one
from tests.test_qk_norm_rope import reference as rope_reference

# On a GPU machine the other tests run these kernels for real (and its session time is scarce).
pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="the emulator's runtime is Linux-only"),
              pytest.mark.skipif(gpu_available(), reason="a real GPU runs the kernels in the other tests")]

# Relative error ||out - ref|| / ||ref|| allowed: float32 sums in another order (~1e-7; the
# bound of tests/test_linear.py); decoded values are exact; float16 outputs round each value
# (2^-11 relative); the prefill path multiplies in float16 (tests/test_linear.py's bound).
F32_SUMS = 2e-5
F16_VALUES = 1e-3
F16_MATMUL = 3e-3

ALL_FORMATS = list(formats.FORMATS)
KERNELS_TESTED = {"embedding", "dequant_rows", "dequant_spans", "dequant_into", "matvec", "qk_norm_rope", "quantize_rows",
                  "product", "argmax", "product_glu", "residual_norm_quant", "residual_norm_rows", "attention_decode",
                  "attention_combine", "product_tiles"}


def test_every_kernel_is_emulated():
    assert KERNELS_TESTED == set(kernels.kernel_names())


def weight_tensor(tmp_path, rng, ggml_type, in_features, out_features):
    """A GGUF weight of random valid blocks, as the model loads it, and its float64 values."""
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    path = testing.write_gguf(tmp_path / "w.gguf", {}, {"w": (ggml_type, (in_features, out_features), raw)})
    values = formats.dequantize(raw, ggml_type, [in_features, out_features]).astype(np.float64)
    return gguf.read(path), values


def linear(tmp_path, rng, ggml_type, in_features, out_features, tokens):
    model, values = weight_tensor(tmp_path, rng, ggml_type, in_features, out_features)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    with model, emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.linear(mx.array(x), model.tensors["w"]))
    assert np.isfinite(out).all(), f"{launches}: an output left unwritten"
    return out, x.astype(np.float64) @ values.T, launches


@pytest.mark.parametrize("ggml_type", ALL_FORMATS, ids=lambda t: t.name)
def test_decode_matvec_every_format(tmp_path, rng, ggml_type):
    # 3 tokens, 13 rows: the last threadgroup holds rows past OUT (8 or 4 rows per threadgroup).
    in_features = 256 if formats.FORMATS[ggml_type].block_size > 1 else 160
    out, expected, launches = linear(tmp_path, rng, ggml_type, in_features, 13, 3)
    assert [launch[0] for launch in launches] == [ops.linear_path(ggml_type, 3, "cuda")]
    assert relative_error(out, expected) <= F32_SUMS


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens, in_features", [(1, 2304), (8, 512)])
def test_the_generic_matvec_one_and_eight_tokens(tmp_path, rng, ggml_type, tokens, in_features):
    # 2304 values: each lane strides 72 elements of its row.
    out, expected, launches = linear(tmp_path, rng, ggml_type, in_features, 10, tokens)
    assert launches[0][0] == "matvec"
    assert relative_error(out, expected) <= F32_SUMS


def test_prefill_decodes_the_weight_with_dequant_spans(tmp_path, rng):
    out, expected, launches = linear(tmp_path, rng, GGMLType.Q4_K, 512, 7, 9)
    assert [launch[0] for launch in launches] == ["dequant_spans"]
    assert relative_error(out, expected) <= F16_MATMUL


@pytest.mark.parametrize("kernel", ["dequant_rows", "dequant_spans"])
@pytest.mark.parametrize("ggml_type, in_features", [
    (GGMLType.Q4_K, 512), (GGMLType.Q6_K, 256), (GGMLType.Q8_0, 96), (GGMLType.Q5_K, 256), (GGMLType.F32, 100),
    (GGMLType.Q4_1, 160), (GGMLType.F16, 64)], ids=lambda v: getattr(v, "name", v))
def test_dequant_rows_and_spans(tmp_path, rng, kernel, ggml_type, in_features):
    # Q8_0, Q4_1 and F32 rows end inside their last 256-value span; 11 rows leave surplus SIMD
    # groups. F32 rows of 100 values are not whole 32-value blocks: only dequant_rows takes them,
    # and dequantize_weight chooses it for them.
    from muser_mlx.ops import dequantize

    if kernel == "dequant_spans" and in_features % 32:
        pytest.skip("dequant_spans takes rows of whole 32-value blocks")
    out_features = 11
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    expected = formats.dequantize(raw, ggml_type, [in_features, out_features])
    for dtype in (mx.float16, mx.float32):
        with emulated_gpu() as launches, kernels.poisoned_outputs():
            out = np.array(dequantize.launch_dequant(kernel, mx.array(raw), ggml_type, in_features, out_features, dtype))
            chosen = ops.dequantize_weight(mx.array(raw), ggml_type, in_features, out_features, dtype)
            mx.eval(chosen)
        assert [launch[0] for launch in launches] == [kernel, "dequant_spans" if in_features % 32 == 0 else "dequant_rows"]
        assert np.isfinite(out).all(), "an output left unwritten"
        if dtype == mx.float32 and ggml_type != GGMLType.F16:
            assert relative_error(out, expected) <= 1e-7
        else:
            assert relative_error(out, expected) <= F16_VALUES


@pytest.mark.parametrize("ggml_type, in_features", [(GGMLType.Q4_K, 512), (GGMLType.Q6_K, 256),
                                                   (GGMLType.Q8_0, 96), (GGMLType.Q5_K, 256)],
                         ids=lambda v: getattr(v, "name", v))
def test_dequant_into_writes_dequant_spans_bits_in_place(rng, ggml_type, in_features):
    """dequant_into: the first OUT * IN values of a longer float16 target become dequant_spans'
    values (bit for bit); the rest of the target stays as it was; x16 (poisoned first) is x
    in float16. x has more values (3 x 512 / 8 threads) or fewer than the weight's threads."""
    from muser_mlx.ops import dequantize

    out_features = 11  # surplus SIMD groups in the last threadgroup
    raw = mx.array(testing.random_blocks(rng, ggml_type, out_features, in_features))
    before = rng.standard_normal(out_features * in_features + 37).astype(np.float16)
    x = rng.standard_normal((3 * 512 // in_features * 2, in_features)).astype(np.float32)
    target = mx.array(before)
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        spans = np.array(ops.dequantize_weight(raw, ggml_type, in_features, out_features, mx.float16))
        view, x16 = dequantize.dequantize_into(raw, ggml_type, in_features, out_features, target, target, mx.array(x))
        view, x16 = np.array(view), np.array(x16)
    np.testing.assert_array_equal(x16.view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert [launch[0] for launch in launches] == ["dequant_spans", "dequant_into"]
    after = np.array(target)
    np.testing.assert_array_equal(view.view(np.uint16), spans.view(np.uint16))
    np.testing.assert_array_equal(after[: spans.size].view(np.uint16), spans.reshape(-1).view(np.uint16))
    np.testing.assert_array_equal(after[spans.size:].view(np.uint16), before[spans.size:].view(np.uint16))


def test_dequant_into_refuses_a_target_it_does_not_fit(rng):
    from muser_mlx.ops import dequantize

    raw = mx.array(testing.random_blocks(rng, GGMLType.Q8_0, 4, 64))
    with emulated_gpu():
        for target, message in ((mx.zeros((255,), mx.float16), "float16"), (mx.zeros((256,), mx.float32), "float16"),
                                (mx.zeros((16, 16), mx.float16), "flat")):
            with pytest.raises(ValueError, match=message):
                dequantize.dequantize_into(raw, GGMLType.Q8_0, 64, 4, target, target, mx.zeros((2, 64)))
        with pytest.raises(ValueError, match="32-value blocks"):
            dequantize.dequantize_into(raw, GGMLType.Q8_0, 48, 4, mx.zeros((256,), mx.float16), raw, mx.zeros((2, 48)))
        with pytest.raises(ValueError, match="x has rows of 32"):
            dequantize.dequantize_into(raw, GGMLType.Q8_0, 64, 4, mx.zeros((256,), mx.float16), raw, mx.zeros((2, 32)))


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_dequant_spans_gives_dequant_rows_bits(tmp_path, rng, ggml_type):
    """The same expression for each value: the two decoders agree bit for bit."""
    from muser_mlx.ops import dequantize

    raw = mx.array(testing.random_blocks(rng, ggml_type, 5, 512))
    outs = []
    for kernel in ("dequant_rows", "dequant_spans"):
        with emulated_gpu(), kernels.poisoned_outputs():
            outs.append(np.array(dequantize.launch_dequant(kernel, raw, ggml_type, 512, 5, mx.float16)))
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@pytest.mark.parametrize("ggml_type, dtype", [(GGMLType.Q4_K, mx.float32), (GGMLType.Q6_K, mx.float32),
                                              (GGMLType.IQ4_XS, mx.float32), (GGMLType.Q8_0, mx.float16)],
                         ids=["Q4_K", "Q6_K", "IQ4_XS", "Q8_0-f16"])
def test_embedding(rng, ggml_type, dtype):
    # A [2, 7] batch of ids with both ends of the table (surplus threads: the next test).
    vocab, hidden = 29, 256
    raw = testing.random_blocks(rng, ggml_type, vocab, hidden)
    ids = rng.integers(0, vocab, size=(2, 7)).astype(np.int32)
    ids[0, 0], ids[1, -1] = 0, vocab - 1
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.embedding_unchecked(mx.array(raw), mx.array(ids), ggml_type, hidden, vocab, dtype))
    expected = formats.dequantize(raw, ggml_type, [hidden, vocab])[ids]
    assert [launch[0] for launch in launches] == ["embedding"] and out.shape == (2, 7, hidden)
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, expected) <= (F16_VALUES if dtype == mx.float16 else 1e-7)


def test_embedding_surplus_threads_and_clamp(rng):
    # 3 tokens x 96 values: 288 threads in 2 threadgroups of 256 (224 surplus threads); an id
    # past the table reads its last row (the kernel's clamp).
    vocab, hidden = 20, 96
    raw = testing.random_blocks(rng, GGMLType.Q8_0, vocab, hidden)
    ids = np.array([3, vocab + 5, 0], np.int32)
    with emulated_gpu(), kernels.poisoned_outputs():
        out = np.array(ops.embedding_unchecked(mx.array(raw), mx.array(ids), GGMLType.Q8_0, hidden, vocab))
    expected = formats.dequantize(raw, GGMLType.Q8_0, [hidden, vocab])[np.minimum(ids, vocab - 1)]
    assert relative_error(out, expected) <= 1e-7


@pytest.mark.parametrize("rope", [None, (64, True), (32, False)], ids=["none", "pairs", "partial-halves"])
def test_qk_norm_rope(rng, rope):
    # 2 x 3 rows x 6 heads: 36 SIMD groups, 1152 threads in 5 threadgroups (surplus SIMD groups).
    heads, kv_heads, head_dim, eps, start = 4, 2, 64, 1e-6, 17
    rope = None if rope is None else dict(dims=rope[0], traditional=rope[1], base=10000.0)
    q = rng.standard_normal((2, 3, heads * head_dim)).astype(np.float32) * 3
    k = rng.standard_normal((2, 3, kv_heads * head_dim)).astype(np.float32)
    q_weight, k_weight = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        q_out, k_out = ops.qk_norm_rope(mx.array(q), mx.array(k), mx.array(q_weight), mx.array(k_weight),
                                        heads, kv_heads, head_dim, eps, start, rope)
    assert [launch[0] for launch in launches] == ["qk_norm_rope"]
    assert relative_error(np.array(q_out), rope_reference(q, q_weight, heads, head_dim, eps, start, rope)) <= F32_SUMS
    assert relative_error(np.array(k_out), rope_reference(k, k_weight, kv_heads, head_dim, eps, start, rope)) <= F32_SUMS


# The fused decode step's kernels: q8x activations (tests/test_decode_kernels.py's references
# and bounds).


def kernel_names(launches) -> list[str]:
    return [launch[0] for launch in launches]


def test_quantize_rows(rng):
    x = rng.standard_normal((3, 640)).astype(np.float32) * rng.uniform(0.01, 100, size=(3, 1)).astype(np.float32)
    x[1, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = ops.quantize_rows(mx.array(x))
    codes, scales, sums = formats.quantize_activations(x)
    assert kernel_names(launches) == ["quantize_rows"]
    np.testing.assert_array_equal(np.array(out.codes), codes)
    np.testing.assert_array_equal(np.array(out.scales), scales)
    np.testing.assert_allclose(np.array(out.sums), sums, rtol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_quantize_rows(rng, activation):
    """Kernel quantize_rows' GLU 1 (ops.glu_quantize_rows): a split gated product's halves, 3
    chunks of 5 rows of gate (640 values) and up, summed, activated, multiplied and quantized:
    every value within half a code of the float64 reference (the sums in float32)."""
    halves = rng.standard_normal((3, 5, 1280)).astype(np.float32) * 2
    halves[:, 2, 64:96] = 0.0  # a block of zeros in gate: f 0, scale 0
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = ops.glu_quantize_rows(mx.array(halves), activation)
        mx.eval(*out)
    assert kernel_names(launches) == ["quantize_rows"]
    assert dict(launches[0][1])["GLU"] == 1 and dict(launches[0][1])["CHUNKS"] == 3
    summed = halves.astype(np.float64).sum(axis=0)
    gate, up = summed[:, :640], summed[:, 640:]
    act = gate / (1 + np.exp(-gate)) if activation == "silu" else (
        0.5 * gate * (1 + np.tanh(0.7978845608 * (gate + 0.044715 * gate**3))))
    assert_within_half_a_code(out, act * up)
    with pytest.raises(ValueError, match="halves must be"):
        ops.glu_quantize_rows(mx.array(halves[0]), activation)


@TILE_FORMS
@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "one-tile"])
@pytest.mark.parametrize("rows", [8, 16])
def test_split_gated_tile_products(rng, rows, pairs, half):
    """A gated tile product from Settings.tile_glu_split_from rows on (16): product_tiles' GLU 2
    (pairs: gate's and up's same rows a SIMD group) or gate and up as one ungated launch (GLU 0),
    its 1,024 inputs in 2 chunks either way, then quantize_rows' GLU 1 (the chunks summed, the
    activation); below it (8 rows) the fused GLU 1 launch and a plain quantize_rows. Its q8x f
    against numpy's act(x G.T) * (x U.T) within the form's bound plus half a code; the float form
    (__call__) within the bound."""
    gate, gate_values = weight(rng, GGMLType.Q4_K, 1024, 96, "gate")
    up, up_values = weight(rng, GGMLType.Q6_K, 1024, 96, "up")
    x, x_values = q8x(rng.standard_normal((rows, 1024)).astype(np.float32))
    product = ops.TileProduct(gate, up, "gelu_tanh", settings=tile_settings(half, tile_glu_split_from=16,
                                                                                 tile_glu_split_pairs=pairs))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        f = product.gated_q8x(x)
        mx.eval(*f)
        out = np.array(product(x))
    split = rows >= 16
    assert kernel_names(launches)[:2] == ["product_tiles", "quantize_rows"]
    tiles, quantize = dict(launches[0][1]), dict(launches[1][1])
    assert tiles["GLU"] == ((2 if pairs else 0) if split else 1) and quantize["GLU"] == int(split)
    assert tiles["CHUNKS"] == (2 if split else 1) and quantize["CHUNKS"] == tiles["CHUNKS"]
    assert tiles["OUT_B"] == 96 and (tiles["LAUNCH_MIN_THREADGROUPS"] == 0 or not split)
    g = x_values @ gate_values.T
    expected = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) * (x_values @ up_values.T)
    bound = HALF_PRODUCT_BOUND if half else PRODUCT_BOUND
    assert out.shape == expected.shape and relative_error(out, expected) <= bound
    # f is the kernel's floats rounded to codes: each value moves at most half its block's scale d,
    # so its distance from the reference is at most the float form's bound plus ||d/2|| / ||ref||.
    half_codes = 0.5 * np.repeat(np.array(f.scales), 32, axis=-1)
    rounding = float(np.linalg.norm(half_codes) / np.linalg.norm(expected))
    assert relative_error(f.dequantize(), expected) <= bound + rounding * (1 + 1e-3)


@pytest.mark.parametrize("first, out, rows", [(GGMLType.Q4_K, 96, 16), (GGMLType.Q6_K, 160, 24),
                                              (GGMLType.Q4_K, 96, 8), (GGMLType.Q8_0, 40, 16)],
                         ids=["Q4_K-96-16", "Q6_K-160-24", "Q4_K-96-8-below", "Q8_0-40-16-odd-halves"])
@TILE_FORMS
def test_tile_products_in_pairs(rng, first, out, rows, half):
    """Settings.tile_pairs_from (16): an ungated f16 product of one weight from 16 rows of x on
    runs kernel product_tiles' GLU 2 over its two halves of rows (views of the weight: A rows
    0..out/2-1, B the rest), 1,024 inputs in 2 chunks; below 16 rows, in the int8 form, or where
    the halves are not whole 16-row tiles (40 rows: 20 and 20), GLU 0 over the whole weight.
    Against numpy within the form's bound, summed and as the kernel's chunks."""
    a, a_values = weight(rng, first, 1024, out, "a")
    x, x_values = q8x(rng.standard_normal((rows, 1024)).astype(np.float32))
    product = ops.TileProduct(a, settings=tile_settings(half, tile_pairs_from=16))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        summed = np.array(product(x))
        chunks = np.array(product(x, summed=False))
    paired = bool(half) and rows >= 16 and out % 32 == 0
    template = dict(launches[0][1])
    assert kernel_names(launches) == ["product_tiles"] * 2 and product.pair(rows) == paired
    assert template["GLU"] == (2 if paired else 0) and template["CHUNKS"] == 2
    assert (template["OUT_A"], template["OUT_B"]) == ((out // 2, out // 2) if paired else (out, 0))
    if paired:
        halves = product.launch_inputs(rows)
        assert [h.shape[0] for h in halves] == [out // 2] * 2
        np.testing.assert_array_equal(np.concatenate([np.array(h) for h in halves]), np.array(a.data))
    expected = x_values @ a_values.T
    bound = HALF_PRODUCT_BOUND if half else PRODUCT_BOUND
    assert summed.shape == expected.shape and relative_error(summed, expected) <= bound
    assert chunks.shape == (2, *expected.shape) and relative_error(chunks.sum(axis=0), expected) <= bound


@pytest.mark.parametrize("first, second, tokens", [(GGMLType.Q4_K, None, 3), (GGMLType.Q8_0, GGMLType.Q6_K, 1),
                                                   (GGMLType.Q6_K, GGMLType.Q4_K, 8)],
                         ids=["Q4_K-3", "Q8_0+Q6_K-1", "Q6_K+Q4_K-8"])
def test_product(rng, first, second, tokens):
    a, a_values = weight(rng, first, 512, 13, "a")
    b, b_values = weight(rng, second, 512, 22, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((tokens, 512)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.product(x, a, b))
    expected = x_values @ a_values.T
    if second:
        expected = np.concatenate([expected, x_values @ b_values.T], axis=-1)
    assert kernel_names(launches) == ["product"] and np.isfinite(out).all()
    assert relative_error(out, expected) <= PRODUCT_BOUND


@pytest.mark.parametrize("rows", [16, 24])
def test_grouped_products_take_every_token_group(rng, rows):
    """Kernel product and product_glu GROUPED (the batched decode step): x of several groups of
    8 rows, one launch, each group its own rows of x and y; two formats in one product."""
    a, a_values = weight(rng, GGMLType.Q4_K, 512, 13, "a")
    b, b_values = weight(rng, GGMLType.Q6_K, 512, 22, "b")
    gate, gate_values = weight(rng, GGMLType.Q4_K, 512, 64, "gate")
    up, up_values = weight(rng, GGMLType.Q8_0, 512, 64, "up")
    x, x_values = q8x(rng.standard_normal((rows, 512)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.Product(a, b, tokens=8, grouped=True)(x))
        glu = ops.GatedProduct(gate, up, "silu", tokens=8, grouped=True)(x)
        mx.eval(glu)
    assert kernel_names(launches) == ["product", "product_glu"]
    assert all(dict(launch[1])["GROUPED"] == 1 for launch in launches)
    expected = np.concatenate([x_values @ a_values.T, x_values @ b_values.T], axis=-1)
    assert np.isfinite(out).all() and relative_error(out, expected) <= PRODUCT_BOUND
    g, u = x_values @ gate_values.T, x_values @ up_values.T
    assert_within_half_a_code(glu, g / (1 + np.exp(-g)) * u)
    with pytest.raises(ValueError, match="a multiple of 8 rows"):
        ops.Product(a, tokens=8, grouped=True)(q8x(rng.standard_normal((12, 512)).astype(np.float32))[0])


@TILE_FORMS
@pytest.mark.parametrize("warps, target, rows", [(1, 1, 72), (3, 64, 16), (8, 512, 16)])
def test_tile_products_take_their_launch_shape_from_the_settings(rng, warps, target, rows, half):
    """Settings.tile_warps (weight tiles a threadgroup: 1, 3 with a last threadgroup of fewer
    tiles, 8 with SIMD groups that have none) and tile_threadgroups (the chunks: 1 for a target of
    1; 3 runs of the 6 spans for 64), in both forms (f16: the tokens a SIMD group stages, 64 of a
    group of 72 rows' two, the second partial, and two M a lane; 6 or 5 of 16; 2)."""
    a, a_values = weight(rng, GGMLType.Q4_K, 1536, 77, "a")
    x, x_values = q8x(rng.standard_normal((rows, 1536)).astype(np.float32))
    settings = tile_settings(half, tile_warps=warps, tile_threadgroups=target)
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.TileProduct(a, settings=settings)(x))
    template = dict(launches[0][1])
    assert template["WARPS"] == warps and template["CHUNKS"] == {1: 1, 64: 3, 512: 3}[target]
    assert np.isfinite(out).all()
    assert relative_error(out, x_values @ a_values.T) <= (HALF_PRODUCT_BOUND if half else PRODUCT_BOUND)


@pytest.mark.parametrize("rows, first, second, activation, n",
                         [(8, GGMLType.Q4_K, GGMLType.Q6_K, None, 512), (24, GGMLType.Q8_0, None, None, 576),
                          (72, GGMLType.Q6_K, GGMLType.Q4_K, None, 512), (16, GGMLType.Q4_K, None, None, 1024),
                          (16, GGMLType.Q4_K, GGMLType.Q8_0, "silu", 512), (8, GGMLType.Q6_K, GGMLType.Q6_K, "gelu_tanh", 512)],
                         ids=["Q4_K+Q6_K-8", "Q8_0-24", "Q6_K+Q4_K-72", "Q4_K-16-chunks", "glu-Q4_K+Q8_0-16", "glu-Q6_K-8"])
@TILE_FORMS
def test_tile_products(rng, rows, first, second, activation, n, half):
    """Kernel product_tiles (the batched decode step's products, int8 matrix products: shuffles
    and dot4 here, the same values as tensor cores): 8-row tiles of x staged in threadgroup
    memory (72 rows: two token groups, the second partial), 16-row tiles of weights with rows past
    OUT (37 and 45 rows: a threadgroup's last SIMD groups without a tile), two formats in one
    launch, the gated form; the input split in chunks (Q8_0 rows of 576 values, a block a span:
    9 chunks of 2 spans; 1024 Q4_K values: 2 chunks of 2 spans); in both forms (f16: spans of
    one block for Q8_0)."""
    launches, a = tile_product_against_numpy(rng, rows, first, second, activation, n, tile_settings(half))
    assert dict(launches[0][1])["HALF"] == int(bool(half))
    assert dict(launches[0][1])["BY_TOKEN"] == int(half == "by token")
    assert dict(launches[0][1])["CHUNKS"] == {576: 9, 1024: 2}.get(n, 1)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        ops.TileProduct(a)(q8x(rng.standard_normal((12, n)).astype(np.float32))[0])


@pytest.mark.parametrize("rows, first, second, activation, n",
                         [(24, GGMLType.Q4_K, GGMLType.Q6_K, None, 1024), (16, GGMLType.Q4_K, GGMLType.Q8_0, "silu", 768),
                          (72, GGMLType.Q6_K, None, None, 512), (24, GGMLType.Q4_K, GGMLType.Q4_K, "silu", 512),
                          (8, GGMLType.Q8_0, GGMLType.Q4_K, None, 512)],
                         ids=["Q4_K+Q6_K-24-chunks", "glu-Q4_K+Q8_0-16", "Q6_K-72", "glu-Q4_K-24", "Q8_0+Q4_K-8"])
def test_tile_products_take_their_rows_and_form_from_the_count(rng, rows, first, second, activation, n):
    """With the default settings a tile product's threadgroups take the least of 8, 16, 32, 64
    rows of x that holds the step's (TOKENS 32 for 24 rows, 16 for 16, 8 for 8, 64 for 72: two
    token groups, the second partial), and the f16 form from Settings.tile_half_from rows on
    (the int8 form below), each within its bound against numpy."""
    launches, _ = tile_product_against_numpy(rng, rows, first, second, activation, n, DEFAULT)
    template = dict(launches[0][1])
    assert template["TOKENS"] == {24: 32, 16: 16, 72: 64, 8: 8}[rows]
    assert template["HALF"] == int(rows >= DEFAULT.tile_half_from)


def tile_product_against_numpy(rng, rows, first, second, activation, n, settings):
    """Kernel product_tiles on the emulated GPU against numpy for `rows` rows of x (37 rows of A
    and 45 of B, or 64 of each gated); returns (the launches, weight A)."""
    out_a = 64 if activation else 37
    a, a_values = weight(rng, first, n, out_a, "a")
    b, b_values = weight(rng, second, n, out_a if activation else 45, "b") if second else (None, None)
    x, x_values = q8x(rng.standard_normal((rows, n)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.TileProduct(a, b, activation, settings=settings)(x))
    assert kernel_names(launches) == ["product_tiles"] and np.isfinite(out).all()
    expected = x_values @ a_values.T
    if activation == "silu":
        expected = expected / (1 + np.exp(-expected)) * (x_values @ b_values.T)
    elif activation:
        expected = (0.5 * expected * (1 + np.tanh(0.7978845608 * (expected + 0.044715 * expected**3)))
                    * (x_values @ b_values.T))
    elif second:
        expected = np.concatenate([expected, x_values @ b_values.T], axis=-1)
    bound = HALF_PRODUCT_BOUND if dict(launches[0][1])["HALF"] else PRODUCT_BOUND
    assert out.shape == expected.shape and relative_error(out, expected) <= bound
    return launches, a


def configured(config, *ggml_types, **fields) -> Settings:
    """Settings with kernel product's (and product_glu's) configuration for these formats (and
    other fields)."""
    return DEFAULT.replace(products={**DEFAULT.products, **{t: config for t in ggml_types}}, **fields)


@pytest.mark.parametrize("rows, unroll, tokens", [(2, 1, 1), (1, 1, 2), (4, 2, 1)])  # wide: at most 2 tokens
def test_products_in_wide_units(rng, rows, unroll, tokens):
    """ProductConfig.wide: Q4_K in 64-value units. 1,280 values: 20 wide units a row, so most
    lanes take none, and with unroll every lane's batch runs past the row (adds nothing). Q6_K
    weights (32-value units, whatever the configuration says) second in a launch, first in one
    and as product_glu's up."""
    wide = 1
    settings = configured(ops.ProductConfig(rows, 4, unroll, wide), GGMLType.Q4_K, GGMLType.Q6_K)
    a, a_values = weight(rng, GGMLType.Q4_K, 1280, 11, "a")
    b, b_values = weight(rng, GGMLType.Q6_K, 1280, 6, "b")
    c, c_values = weight(rng, GGMLType.Q6_K, 1280, 9, "c")
    gate, gate_values = weight(rng, GGMLType.Q4_K, 1280, 32, "gate")
    up, up_values = weight(rng, GGMLType.Q6_K, 1280, 32, "up")
    x, x_values = q8x(rng.standard_normal((tokens, 1280)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.product(x, a, b, settings=settings))
        out_c = np.array(ops.product(x, c, settings=settings))
        glu = ops.product_glu(x, gate, up, "silu", settings=settings)
        mx.eval(glu)
    assert kernel_names(launches) == ["product", "product", "product_glu"]
    assert np.isfinite(out).all() and np.isfinite(out_c).all()
    assert all(dict(launch[1])["WIDE"] == wide and dict(launch[1])["UNROLL"] == unroll for launch in launches)
    expected = np.concatenate([x_values @ a_values.T, x_values @ b_values.T], axis=-1)
    assert relative_error(out, expected) <= PRODUCT_BOUND
    assert relative_error(out_c, x_values @ c_values.T) <= PRODUCT_BOUND
    g, u = x_values @ gate_values.T, x_values @ up_values.T
    assert_within_half_a_code(glu, g / (1 + np.exp(-g)) * u)


@pytest.mark.parametrize("rows, unroll, tokens", [(2, 1, 1), (1, 2, 2), (4, 1, 2)])
def test_products_that_stage_x_in_threadgroup_memory(rng, rows, unroll, tokens):
    """ProductConfig.stage: x copied to threadgroup memory (muser_stage_x's slots), then read
    there by wide Q4_K units and Q8_0 ones, each first and second in a launch; 1,280 values:
    80 chunks of 16 codes a token, a second token's from chunk 80 on. The result equals the
    unstaged launch's bit for bit (same sums, same order). A Q6_K weight in the launch, or a
    1,312-value row (not whole 64-value blocks), is not staged."""
    # stage_min_in 1024: short rows here, to be quick
    settings = configured(ops.ProductConfig(rows, 4, unroll, 1, 1), GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K,
                          stage_min_in=1024)
    a, a_values = weight(rng, GGMLType.Q4_K, 1280, 13, "a")
    b, b_values = weight(rng, GGMLType.Q8_0, 1280, 22, "b")
    c, _ = weight(rng, GGMLType.Q6_K, 1280, 5, "c")
    d, _ = weight(rng, GGMLType.Q8_0, 1312, 5, "d")
    x, x_values = q8x(rng.standard_normal((tokens, 1280)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        ab = np.array(ops.product(x, a, b, settings=settings))
        ba = np.array(ops.product(x, b, a, settings=settings))
    assert [dict(launch[1])["STAGE"] for launch in launches] == [1, 1]
    expected = np.concatenate([x_values @ a_values.T, x_values @ b_values.T], axis=-1)
    assert np.isfinite(ab).all() and relative_error(ab, expected) <= PRODUCT_BOUND
    np.testing.assert_array_equal(ba, np.concatenate([ab[..., 13:], ab[..., :13]], axis=-1))
    unstaged = configured(ops.ProductConfig(rows, 4, unroll, 1, 0), GGMLType.Q4_K, GGMLType.Q8_0, stage_min_in=1024)
    with emulated_gpu():
        np.testing.assert_array_equal(np.array(ops.product(x, a, b, settings=unstaged)), ab)
    assert dict(ops.Product(a, c, tokens=tokens, settings=settings).template)["STAGE"] == 0
    assert dict(ops.Product(d, tokens=tokens, settings=settings).template)["STAGE"] == 0
    assert dict(ops.Product(a, b, tokens=tokens, settings=settings.replace(stage_min_in=2048)).template)["STAGE"] == 0


def test_lm_head_product_and_argmax(rng):
    head, head_values = weight(rng, GGMLType.Q6_K, 256, 301)
    x, x_values = q8x(rng.standard_normal((2, 256)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        logits, best = ops.product(x, head, head=(0.2, 20.0))
        token = np.array(ops.greedy(best))
    expected = 20.0 * np.tanh(x_values @ head_values.T * 0.2 / 20.0)
    assert kernel_names(launches) == ["product", "argmax"]
    assert relative_error(np.array(logits), expected) <= PRODUCT_BOUND
    np.testing.assert_array_equal(token, np.argmax(np.array(logits), axis=-1))


@pytest.mark.parametrize("activation, tokens", [("silu", 2), ("gelu_tanh", 1), ("silu", 5)])  # 5: R4 (ops._config)
def test_product_glu(rng, activation, tokens):
    gate, gate_values = weight(rng, GGMLType.Q4_K, 512, 96, "gate")
    up, up_values = weight(rng, GGMLType.Q6_K, 512, 96, "up")
    x, x_values = q8x(rng.standard_normal((tokens, 512)).astype(np.float32))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = ops.product_glu(x, gate, up, activation)
    g, u = x_values @ gate_values.T, x_values @ up_values.T
    act = g / (1 + np.exp(-g)) if activation == "silu" else 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3)))
    assert kernel_names(launches) == ["product_glu"]
    assert_within_half_a_code(out, act * u)


# A threadgroup writes a slice of ops.norm.SEAM_SLICE_BLOCKS blocks: 416 = 13 blocks (one partial
# slice), 2880 = 90 blocks (a partial last slice, a whole-row pass that leaves the row early).
# post-only: OLMo 2's seam, no next norm (h is the sum, quantized). From SEAM_WIDE_FROM rows on
# (a batched step's), slices of up to SEAM_WIDE_BLOCKS: 6656 in two of 104 blocks (832
# threads), 2880 in one of 90 (736).
@pytest.mark.parametrize("residual, branch_norm, hidden, tokens, next_norm",
                         [(True, True, 256, 2, True), (False, True, 6656, 2, True), (True, False, 416, 3, True),
                          (True, True, 2880, 3, True), (True, True, 416, 3, False), (True, True, 6656, 9, True),
                          (False, True, 2880, 10, True)],
                         ids=["sandwich-256", "embedding-6656", "plain-416x3", "sandwich-2880x3", "post-only-416x3",
                              "wide-6656x9", "wide-embedding-2880x10"])
@pytest.mark.parametrize("chunks", [1, 3], ids=["", "chunked"])  # a tile product's partial sums, added
def test_residual_norm_quant(rng, residual, branch_norm, hidden, tokens, next_norm, chunks):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32) * 3
    parts = rng.standard_normal((chunks, tokens, hidden)).astype(np.float32) * 40
    branch = parts.astype(np.float64).sum(axis=0)
    branch_weight, next_weight = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        total, normed = ops.residual_norm_quant(mx.array(x) if residual else None, mx.array(parts if chunks > 1 else parts[0]),
                                                mx.array(branch_weight) if branch_norm else None,
                                                mx.array(next_weight) if next_norm else None, 1e-8, 1e-5, 0.75,
                                                chunked=chunks > 1)
    b = branch.astype(np.float64)
    if branch_norm:
        b = rms(b, 1e-8) * branch_weight
    expected = b * 0.75 + (x if residual else 0)
    assert kernel_names(launches) == ["residual_norm_quant"]
    assert relative_error(np.array(total), expected) <= 1e-5  # float32 sums of 6656 squares
    assert_within_half_a_code(normed, rms(expected, 1e-5) * next_weight if next_norm else expected)


# A threadgroup a row: 6656 values over 256 threads (26 each, the last pass partial), 100 over
# 128 (lanes past the row), 40000 over 1024 (ops.norm.ROWS_PER_THREAD raises the threads).
@pytest.mark.parametrize("branch_norm, next_norm", [(True, True), (False, True), (True, False)],
                         ids=["sandwich", "plain", "post-only"])  # post-only: OLMo 2's, normed is the sum
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("hidden, rows", [(6656, 3), (100, 5), (40000, 2)])
def test_residual_norm_rows(rng, branch_norm, next_norm, dtype, hidden, rows):
    x = rng.standard_normal((1, rows, hidden)).astype(np.float32) * 3
    branch = (rng.standard_normal((1, rows, hidden)) * 40).astype(np.float16 if dtype == mx.float16 else np.float32)
    branch_weight, next_weight = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        total, normed = ops.residual_norm(mx.array(x), mx.array(branch), mx.array(branch_weight) if branch_norm else None,
                                          mx.array(next_weight) if next_norm else None, 1e-8, 1e-5)
    b = branch.astype(np.float64)
    if branch_norm:
        b = rms(b, 1e-8) * branch_weight
    expected = x + b
    assert kernel_names(launches) == ["residual_norm_rows"]
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == mx.float32
    assert relative_error(np.array(total), expected) <= 1e-5  # float32 sums of up to 40000 squares
    assert relative_error(np.array(normed), rms(expected, 1e-5) * next_weight if next_norm else expected) <= 1e-5


@pytest.mark.parametrize("variant, capacity, position", [("muse", 8, 29), ("qwen2", 256, 200), ("llama", 4096, 3000),
                                                       ("olmo2", 256, 200), ("gemma2", 8, 29)],
                         ids=["muse-ring", "qwen2-bias", "llama-long", "olmo2-whole-norm", "gemma2-softcap-ring"])
def test_attention_decode_and_combine(rng, variant, capacity, position):
    # Its key and value go into the cache in place (the emulator writes them back, as a GPU does).
    heads, kv_heads, *rest = ATTENTION_VARIANTS[variant]
    inputs, expected, (slot, new_k, new_v, keys, values) = attention_case(
        rng, heads, kv_heads, capacity, position, *rest)
    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out, cache_keys, cache_values = ops.attention_decode(**inputs)
    assert kernel_names(launches) == ["attention_decode", "attention_combine"]
    assert_within_half_a_code(out, expected, slack=2e-3)
    written_keys, written_values = np.array(cache_keys), np.array(cache_values)
    np.testing.assert_allclose(written_keys[0, :, slot].astype(np.float64), new_k, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(written_values[0, :, slot].astype(np.float64), new_v, atol=2e-3, rtol=2e-3)
    others = np.arange(capacity) != slot
    np.testing.assert_array_equal(written_keys[:, :, others], keys[:, :, others])


# ---------------------------------------------------------------------------------------------
# The emulator's own semantics, on small kernels written here
# ---------------------------------------------------------------------------------------------

# Small kernels for the emulator's own tests (metal_program renders kernels with at least one
# template constant: WIDTH, the values per thread).
PROBE = """\
uint i = thread_position_in_grid.x;
float value = x[i];
device float* row = out + i * WIDTH;
row[0] = float(i);
row[1] = float(thread_position_in_threadgroup.x);
row[2] = float(threadgroup_position_in_grid.x);
row[3] = float(simdgroup_index_in_threadgroup * 32u + thread_index_in_simdgroup);
row[4] = simd_sum(value);
row[5] = simd_shuffle_xor(value, ushort(1));
row[6] = simd_prefix_exclusive_sum(value);
row[7] = simd_max(value);
"""


def probe(body, inputs=("x",)):
    return KernelSource("probe", inputs, ("out",), body, "")


# A last-threadgroup-done sum (device atomics: lib/base.metal's muser_atomic_add, muser_atomic_store,
# muser_device_fence): every threadgroup (one SIMD group) writes its partial sum and counts
# itself in; the one that counts last adds the partials in threadgroup order and resets the
# counter for the next launch. Also compiled as Metal and CUDA (tests/test_kernels.py).
LAST_DONE_BODY = """\
#include "lib/base.metal"
threadgroup uint last[1];
uint lane = thread_index_in_simdgroup;
uint group = threadgroup_position_in_grid.x;
float sum = simd_sum(x[thread_position_in_grid.x]);
if (lane == 0u) {
  partial[group] = sum;
  muser_device_fence();
  uint before = muser_atomic_add((device uint*)counter, 1u);
  last[0] = before + 1u == threadgroups_per_grid.x ? 1u : 0u;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (last[0] != 0u) {
  muser_device_fence();
  float all = 0.0f;
  for (uint g = lane; g < threadgroups_per_grid.x; g += 32u) {
    all += partial[g];
  }
  all = simd_sum(all);
  if (lane == 0u) {
    total[0] = all;
    muser_atomic_store((device uint*)counter, 0u);
  }
}
"""
LAST_DONE = kernels.kernel_source("last_done", ("x", "counter"), ("partial", "total"), LAST_DONE_BODY)
LAST_DONE_LAUNCH = ([mx.float32, mx.uint32], [("WIDTH", 1)], (32 * 40, 1, 1), (32, 1, 1), [(40,), (1,)],
                    [mx.float32, mx.float32])


def test_a_launch_runs_whole_threadgroups_with_simd_groups_of_32_lanes(rng):
    # grid 100 in threadgroups of 64: as MLX's CUDA launch, 128 threads run.
    x = rng.standard_normal(128).astype(np.float32)
    (out,) = run("probe", [x], [("WIDTH", 8)], (100, 1, 1), (64, 1, 1), [(128, 8)], [mx.float32], source=probe(PROBE))
    lanes = x.reshape(4, 32)
    i = np.arange(128)
    assert (out[:, 0] == i).all() and (out[:, 1] == i % 64).all() and (out[:, 2] == i // 64).all()
    assert (out[:, 3] == i % 64).all()
    butterfly = lanes.copy()  # simd_sum adds in the CUDA rendering's order: lane i ^ 16, ^ 8, ...
    for offset in (16, 8, 4, 2, 1):
        butterfly = butterfly + butterfly[:, np.arange(32) ^ offset]
    assert (out[:, 4] == butterfly.reshape(-1)).all()
    assert (out[:, 5] == x[i ^ 1]).all() and (out[:, 7] == np.repeat(lanes.max(1), 32)).all()
    exclusive = np.concatenate([np.zeros((4, 1), np.float32), np.cumsum(lanes, 1, dtype=np.float32)[:, :-1]], 1)
    assert (out[:, 6] == exclusive.reshape(-1)).all()


def test_metal_dispatch_cuts_the_last_threadgroup():
    body = "out[thread_position_in_grid.x * WIDTH] = float(threads_per_threadgroup.x);\n"
    (out,) = run("probe", [np.zeros(1, np.float32)], [("WIDTH", 1)], (100, 1, 1), (64, 1, 1), [(128,)], [mx.float32],
                 init_value=-1.0, source=probe(body), partial_threadgroups=True)
    assert (out[:64] == 64).all() and (out[64:100] == 36).all() and (out[100:] == -1).all()


def test_shapes_strides_ndim_and_scalars_reach_the_kernel():
    # MLX adds x_shape, x_strides, x_ndim where the body names them; a 0-d input is a reference.
    body = ("out[0] = float(x_shape[0]); out[1] = float(x_shape[1]); out[2] = float(x_strides[0]);\n"
            "out[3] = float(x_ndim); out[4] = float(scale) * x[7];\n")
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    (out,) = run("probe", [x, np.array(2, np.int32)], [("WIDTH", 1)], (1, 1, 1), (32, 1, 1), [(5,)], [mx.float32],
                 source=KernelSource("probe", ("x", "scale"), ("out",), "if (thread_position_in_grid.x == 0) {\n" + body + "}\n", ""))
    assert out.tolist() == [3, 5, 5, 2, 14]


SHARED = """\
threadgroup float shared[64];
uint t = thread_position_in_threadgroup.x;
shared[t] = x[thread_position_in_grid.x];
threadgroup_barrier(mem_flags::mem_threadgroup);
out[thread_position_in_grid.x * WIDTH] = shared[63u - t];
"""


def test_threadgroups_share_their_arrays_and_a_missing_barrier_reads_nan(rng):
    x = rng.standard_normal(128).astype(np.float32)
    args = ("probe", [x], [("WIDTH", 1)], (128, 1, 1), (64, 1, 1), [(128,)], [mx.float32])
    (out,) = run(*args, source=probe(SHARED))
    assert (out == x.reshape(2, 64)[:, ::-1].reshape(-1)).all()
    racy = probe(SHARED.replace("threadgroup_barrier(mem_flags::mem_threadgroup);\n", ""))
    for order in ("forward", "reverse"):  # threadgroup arrays start as NaN in each threadgroup
        (out,) = run(*args, source=racy, order=order)
        assert np.isnan(out).sum() == 64


def test_device_atomics_a_last_threadgroup_done_sum(rng):
    # The threadgroup that counts last differs between the orders (forward: the last index,
    # reverse: the first); the sum and the reset counter must not.
    _, template, grid, threadgroup, shapes, dtypes = LAST_DONE_LAUNCH
    x = rng.standard_normal(32 * 40).astype(np.float32)
    counter = mx.array(np.zeros(4, np.uint32))
    for order in ("forward", "reverse", "forward"):  # the counter carries over, reset each time
        partial, total = run("last_done", [x, counter], template, grid, threadgroup, shapes, dtypes,
                             order=order, source=LAST_DONE)
        np.testing.assert_allclose(partial, x.reshape(40, 32).sum(axis=1), rtol=1e-6, atol=1e-5)
        assert abs(total[0] - x.astype(np.float64).sum()) <= 1e-5 * np.abs(x).sum()
        assert np.array(counter).tolist() == [0, 0, 0, 0]
    # Without the reset the counter keeps the launch's count, and the next launch has no last
    # threadgroup: its total stays as MLX left it (NaN here).
    no_reset = dataclasses.replace(LAST_DONE, body=LAST_DONE.body.replace("counter,0u)", "counter,threadgroups_per_grid.x)"))
    assert no_reset.body != LAST_DONE.body
    run("last_done", [x, counter], template, grid, threadgroup, shapes, dtypes, source=no_reset)
    assert np.array(counter)[0] == 40
    _, total = run("last_done", [x, counter], template, grid, threadgroup, shapes, dtypes, source=no_reset)
    assert np.isnan(total[0])


INT_FLOAT = kernels.kernel_source("int_float", ("v", "c"), ("out",), """\
#include "lib/base.metal"
uint i = thread_position_in_grid.x;
out[2u * i] = muser_int_float(v[i]);
out[2u * i + 1u] = muser_uint_float(c[i]);
""")


def test_integers_become_floats_exactly_without_a_conversion(rng):
    """lib/base.metal's muser_int_float (|v| < 2^22) and muser_uint_float (c < 2^23), which the
    product kernels use for their dots and 6-bit scales: float(v) exactly, over both ranges'
    ends and random values between."""
    ends = np.array([0, 1, -1, 2, -2, 127, -128, 975360, -975360, (1 << 22) - 1, -(1 << 22) + 1], np.int64)
    v = np.concatenate([ends, rng.integers(-(1 << 22) + 1, 1 << 22, 8192 - len(ends))]).astype(np.int32)
    c = np.concatenate([[0, 1, 63, 255, (1 << 23) - 1], rng.integers(0, 1 << 23, 8192 - 5)]).astype(np.uint32)
    (out,) = run("int_float", [v, c], [("WIDTH", 1)], (8192, 1, 1), (256, 1, 1), [(8192, 2)], [mx.float32],
                 source=INT_FLOAT)
    np.testing.assert_array_equal(out[:, 0], v.astype(np.float32))
    np.testing.assert_array_equal(out[:, 1], c.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# Our kernels, broken: the emulator catches each
# ---------------------------------------------------------------------------------------------


def broken(name, part, old, new):
    """Kernel `name` with `old` replaced by `new` in its header or body (both written as in
    kernels/, squeezed as kernels.source squeezes the files)."""
    source = kernels.source(name)
    text = getattr(source, part)
    old, new = kernels._code_only(old).rstrip("\n"), kernels._code_only(new).rstrip("\n")
    assert old in text, f"{name}: the mutation no longer applies; update this test"
    return {name: dataclasses.replace(source, **{part: text.replace(old, new)})}


def tensor(rng, ggml_type, in_features, out_features):
    """A stand-in for a GGUF tensor: what ops.linear reads of one."""
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    return SimpleNamespace(shape=(in_features, out_features), name="w", ggml_type=ggml_type, data=mx.array(raw))


def seam_inputs(rng, rows: int, hidden: int):
    """ops.residual_norm's inputs for `rows` rows: residual, branch, next_weight."""
    return tuple(mx.array(rng.standard_normal(shape).astype(np.float32)) for shape in ((rows, hidden), (rows, hidden), (hidden,)))


def test_a_missing_barrier_is_reported(rng):
    # A row's eight SIMD groups add their sums through threadgroup memory; without the barrier
    # a thread reads another group's slot before it is written (poisoned, or written, by the
    # order the emulator runs the threads in): the two orders disagree.
    sources = broken("residual_norm_rows", "body", "threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    residual, branch, weight = seam_inputs(rng, 2, 2304)
    with emulated_gpu(sources=sources), kernels.poisoned_outputs(), \
            pytest.raises(EmulationError, match="`normed` differs between threads run .*a missing barrier"):
        mx.eval(ops.residual_norm(residual, branch, None, weight, 1e-5, 1e-5))


def test_a_thread_returning_before_a_barrier_is_reported(rng):
    sources = broken("residual_norm_rows", "body", "if (row >= uint(residual_shape[0])) {",
                     "if (row >= uint(residual_shape[0]) || thread_position_in_threadgroup.x >= 32u) {")
    residual, branch, weight = seam_inputs(rng, 1, 2304)
    with emulated_gpu(sources=sources), pytest.raises(EmulationError, match="barrier that not every thread"):
        mx.eval(ops.residual_norm(residual, branch, None, weight, 1e-5, 1e-5))


def test_lanes_returning_before_simd_sum_are_reported(rng):
    # The last lane of the last row returns alone: the CUDA rendering's full-mask shuffle hangs.
    sources = broken("matvec", "body", "if (row >= uint(OUT)) {", "if (thread_position_in_grid.x + 1u >= 32u * uint(OUT)) {")
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    with emulated_gpu(sources=sources), pytest.raises(EmulationError, match=r"lane 31\).* has returned, while .* waits in simd_sum"):
        ops.linear(x, tensor(rng, GGMLType.Q5_K, 256, 9))  # no dedicated kernel: matvec


def test_an_unwritten_output_is_nan(rng):
    sources = broken("embedding", "body", "if (index >= tokens * uint(HIDDEN)) {", "if (index + 1u >= tokens * uint(HIDDEN)) {")
    raw = testing.random_blocks(rng, GGMLType.Q8_0, 20, 96)
    with emulated_gpu(sources=sources), kernels.poisoned_outputs():
        out = np.array(ops.embedding_unchecked(mx.array(raw), mx.array(np.array([3, 2], np.int32)), GGMLType.Q8_0, 96, 20))
    assert np.isnan(out).sum() == 1 and np.isnan(out[-1, -1])


def test_a_read_past_an_input_is_reported(rng):
    # Without the clamp, an id past the table reads past the end of the table's buffer.
    sources = broken("embedding", "body", "min(uint(token_ids[slot]), uint(VOCAB - 1))", "uint(token_ids[slot])")
    raw = testing.random_blocks(rng, GGMLType.Q8_0, 20, 96)
    with emulated_gpu(sources=sources), pytest.raises(EmulationError, match=r"reads `table` at byte 20\d\d.*past its end \(2040 bytes"):
        ops.embedding_unchecked(mx.array(raw), mx.array(np.array([3, 20], np.int32)), GGMLType.Q8_0, 96, 20)


def test_surplus_threads_without_the_bound_check_are_reported(rng):
    sources = broken("embedding", "body", "if (index >= tokens * uint(HIDDEN)) {\n  return;\n}\n", "")
    raw = testing.random_blocks(rng, GGMLType.Q8_0, 20, 96)
    with emulated_gpu(sources=sources), pytest.raises(EmulationError, match=r"thread_position_in_grid \(288, 0, 0\) reads `token_ids` at byte 12"):
        ops.embedding_unchecked(mx.array(raw), mx.array(np.array([3, 2, 1], np.int32)), GGMLType.Q8_0, 96, 20)


def test_a_misaligned_vector_load_is_reported(rng):
    # Q6_K's d read one byte off: a 2-byte load at an odd address.
    sources = broken("product", "header", "(weight + block + 208u)", "(weight + block + 209u)")
    a, _ = weight(rng, GGMLType.Q6_K, 256, 5, "a")
    x, _ = q8x(rng.standard_normal((1, 256)).astype(np.float32))
    with emulated_gpu(sources=sources), pytest.raises(EmulationError, match=r"2-byte aligned values at byte 209 of `weight_a`"):
        mx.eval(ops.product(x, a))


def test_an_endless_loop_is_reported(rng):
    source = broken("matvec", "body", "e += 32)", "e += 0)")["matvec"]
    raw = testing.random_blocks(rng, GGMLType.Q5_K, 9, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    template = [("FORMAT", 13), ("IN", 256), ("ROW_BYTES", 176), ("OUT", 9), ("TOKENS", 1)]
    with pytest.raises(EmulationError, match="ran out of CPU time"):
        run("matvec", [raw, x], template, (288, 1, 1), (256, 1, 1), [(1, 9)], [mx.float32], source=source,
            cpu_seconds=0.2)


# ---------------------------------------------------------------------------------------------
# A whole model through the GPU path
# ---------------------------------------------------------------------------------------------


def _two_stores_of_the_same_sequences(model, rng, lengths):
    """Two BatchKV stores of the same sequences (random prompts of these lengths, prefilled once)
    and a random next token for each: (stores, tokens int32 [sequences])."""
    from muser_mlx.models.batch_decode import BatchKV
    caches = [model.make_cache(mx.float16) for _ in lengths]
    for n, cache in zip(lengths, caches):
        mx.eval(model.hidden(mx.array(rng.integers(0, model.config.vocab, size=(1, n))), cache))
    stores = [BatchKV(model, mx.float16) for _ in range(2)]
    for kv in stores:
        for cache in caches:
            kv.add(cache)
    return stores, mx.array(rng.integers(0, model.config.vocab, size=len(lengths)), dtype=mx.int32)


# Muse Glimmer's layer (QK norm, attention gate, sliding window); OLMo 2's (q/k norm over the
# whole projections, no pre-norms); Gemma 2's (attention softcap, here one that bites).
@pytest.mark.parametrize("chosen, tiles_from, tiles, half, split",
                         [(False, 9, False, False, False), (True, 9, True, False, False), (None, 3, True, False, False),
                          (None, 4, False, False, False), (True, 9, True, True, False), (True, 9, True, True, True),
                          (True, 9, True, True, "pairs")],
                         ids=["grouped", "tiles", "tiles-by-count", "grouped-by-count", "tiles-f16", "tiles-f16-split",
                              "tiles-f16-pairs"])
def test_the_batched_step_on_the_emulated_gpu(tmp_path, rng, chosen, tiles_from, tiles, half, split):
    """BatchStep's GPU form, with its grouped products (kernels product / product_glu) or its tile
    products (kernel product_tiles), chosen or picked by the count of sequences
    (Settings.batch_tiles_from), on a 1-layer tiny Muse Glimmer (Q4_K and Q6_K weights;
    ffn_down 1,024 wide: the tile form splits it in 2 chunks), 3 sequences of their own lengths
    padded to 8 rows, against the same step's CPU rendering from the same store: the products sum
    in another order, which may move an int8 code of a later input (test_batch.py's bounds).
    half: the tile products in f16 at these 8 rows (Settings.tile_half_from 1; by default 8 rows
    take the int8 form), within the same bound. split: the gated product split from 8 rows
    (Settings.tile_glu_split_from: product_tiles GLU 0, then quantize_rows' GLU 1); "pairs": the
    ungated products of one weight in pairs from 8 rows (Settings.tile_pairs_from: GLU 2 over
    the weight's halves; the gated product fused)."""
    path = testing.tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q4_K_M", layers=1, ff=1024)
    from muser_mlx.models.batch_decode import BatchStep
    with gguf.read(path) as file:
        model = build_model(file, Settings(batch_tiles_from=tiles_from, tile_half_from=1 if half else DEFAULT.tile_half_from,
                                           tile_glu_split_from=8 if split is True else 0,
                                           tile_pairs_from=8 if split == "pairs" else 0))
        assert BatchStep(model, q8x=True, tiles=chosen).uses_tiles(3) == tiles
        stores, tokens = _two_stores_of_the_same_sequences(model, rng, (3, 9, 5))
        step = BatchStep(model, q8x=True, tiles=chosen)
        expected = np.array(step(tokens, stores[0]))
        with emulated_gpu() as launches, kernels.poisoned_outputs():
            step = BatchStep(model, q8x=True, tiles=chosen)
            logits = np.array(step(tokens, stores[1]))
    names = {launch[0] for launch in launches}
    assert ("product_tiles" in names) == tiles
    assert {"product", "product_glu"}.isdisjoint(names) == tiles
    assert any(dict(launch[1]).get("CHUNKS", 1) > 1 for launch in launches) == tiles
    glus = {dict(launch[1])["GLU"] for launch in launches if launch[0] == "product_tiles"}
    # split: GLU 2 (the split's pairs' default); pairs: GLU 2 for the ungated products of one weight
    assert (1 in glus) == (tiles and split is not True) and (2 in glus) == bool(split)
    assert any(dict(launch[1])["GLU"] for launch in launches if launch[0] == "quantize_rows") == (split is True)
    if split == "pairs":  # o-projection and down (256 rows: halves as A and B); not the head's 326 rows
        assert sum(dict(launch[1])["GLU"] == 2 for launch in launches if launch[0] == "product_tiles") == 2
    assert all(dict(launch[1])["HALF"] == int(half) for launch in launches if launch[0] == "product_tiles")
    assert np.isfinite(logits).all() and logits.shape == expected.shape
    for row, row_expected in zip(logits, expected):
        assert relative_error(row, row_expected) <= FUSED_NUMERICS_BOUND
    assert stores[1].lengths == stores[0].lengths == [4, 10, 6]


@pytest.mark.parametrize("aim, splits", [(0, 128), (16, 2), (4, 1)], ids=["default", "16", "4"])
def test_the_batched_steps_attention_splits_follow_its_rows(tmp_path, rng, aim, splits):
    """Settings.batch_attention_splits: kernel attention_decode's MAX_SPLITS in a batched step of
    3 sequences (padded to 8 rows) is the model's attention_splits (0), or the aim over 8 (16: 2
    splits of a 256-slot store, 128 slots each; 4: 1), and the step's logits stay within the
    batched step's bound of the default's (the splits merge in another order)."""
    path = testing.tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q4_K_M", layers=1)
    from muser_mlx.models.batch_decode import BatchStep
    with gguf.read(path) as file:
        model = build_model(file)
        stores, tokens = _two_stores_of_the_same_sequences(model, rng, (40, 9, 150))
        with emulated_gpu() as launches, kernels.poisoned_outputs():
            expected = np.array(BatchStep(model, q8x=True, tiles=True)(tokens, stores[0]))
            step = BatchStep(model, q8x=True, tiles=True, launch_settings=Settings(batch_attention_splits=aim))
            logits = np.array(step(tokens, stores[1]))
    attention = [dict(launch[1]) for launch in launches if launch[0] == "attention_decode"]
    assert [a["MAX_SPLITS"] for a in attention] == [128, splits]
    assert step.attention_splits(8) == splits
    assert np.isfinite(logits).all() and logits.shape == expected.shape
    for row, row_expected in zip(logits, expected):
        assert relative_error(row, row_expected) <= FUSED_NUMERICS_BOUND


def test_the_batched_steps_write_their_store_in_place_on_the_emulated_gpu(tmp_path, rng):
    """BatchStep's GPU form over 10 steps: its attention kernels (attention_decode with rows)
    write each row's key and value into the store in place, and the store's own MLX ops (a row
    removed, a sequence joining, a row taken out) wait for those writes (BatchKV.finish_writes).
    Against the same steps' CPU rendering (new store arrays each step) from the same caches: a
    4-layer tiny Muse Glimmer (3 sliding-window layers of 8 keys and a full one), rows of
    their own lengths (3, 9, 5; the window wraps), a row leaving after step 4 and a sequence of 2
    positions joining."""
    path = testing.tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q4_K_M", layers=4)
    from muser_mlx.models.batch_decode import BatchKV, BatchStep

    def caches(lengths):
        made = [model.make_cache(mx.float16) for _ in lengths]
        for n, cache in zip(lengths, made):
            mx.eval(model.hidden(mx.array(rng.integers(0, model.config.vocab, size=(1, n))), cache))
        return made

    with gguf.read(path) as file:
        model = build_model(file)
        stores = {name: BatchKV(model, mx.float16) for name in ("cpu", "gpu")}
        for cache in caches((3, 9, 5)):
            for kv in stores.values():
                kv.add(cache)
        for step in range(10):
            if step == 5:
                joining = caches((2,))[0]
                for kv in stores.values():
                    kv.remove(1)
                    kv.add(joining)
            tokens = mx.array(rng.integers(0, model.config.vocab, size=3), dtype=mx.int32)
            expected = np.array(BatchStep(model, q8x=True)(tokens, stores["cpu"]))
            with emulated_gpu() as launches, kernels.poisoned_outputs():
                logits = np.array(BatchStep(model, q8x=True)(tokens, stores["gpu"]))
            assert {"attention_decode", "attention_combine"} <= {launch[0] for launch in launches}
            assert stores["gpu"].written_by is not None and np.isfinite(logits).all()
            for row, row_expected in zip(logits, expected):
                assert relative_error(row, row_expected) <= FUSED_NUMERICS_BOUND, step
        assert stores["gpu"].lengths == stores["cpu"].lengths == [13, 15, 7]
        taken = {name: kv.take(2) for name, kv in stores.items()}
        assert stores["gpu"].written_by is None
        # Layer 0's keys and values come from the same embeddings in both forms, so they agree to
        # the products' summation order; a deeper layer's come from hidden states that already
        # differ by the step's rounding, so they get the logits' bound (a seed gave 1.2e-2 at
        # layer 3 of 4).
        for layer, (got, want) in enumerate(zip(taken["gpu"], taken["cpu"])):
            assert got.offset == want.offset == 7
            bound = 1e-3 if layer == 0 else FUSED_NUMERICS_BOUND
            for name in ("keys", "values"):
                error = relative_error(np.array(getattr(got, name), dtype=np.float32),
                                       np.array(getattr(want, name), dtype=np.float32))
                assert error <= bound, (layer, name)


@pytest.mark.parametrize("architecture, metadata", [("muse-glimmer", {}), ("olmo2", {}),
                                                    ("gemma2", {"gemma2.attn_logit_softcapping": 0.25})],
                         ids=["muse-glimmer", "olmo2", "gemma2"])
def test_a_tiny_model_decodes_on_the_emulated_gpu(tmp_path, rng, architecture, metadata):
    # The fused decode step (Transformer.decode_step: eight launches a layer, the LM head's
    # epilogue and argmax) with Q4_K / Q6_K weights, 6 tokens one by one, against the float64
    # reference with the decode step's rounding (tests/test_models.py's bounds).
    path = testing.tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q4_K_M", layers=1,
                              extra_metadata=metadata)
    with gguf.read(path) as file, emulated_gpu() as launches, kernels.poisoned_outputs():
        model = build_model(file)
        ids = rng.integers(0, model.config.vocab, size=6)
        logits, greedy = decode_one_by_one(model, ids, model.make_cache())
        rounded = Reference(model.config, file.tensors, decode_numerics=True).forward(ids)
    assert {launch[0] for launch in launches} == {"embedding", "residual_norm_quant", "product", "product_glu",
                                                  "attention_decode", "attention_combine", "argmax"}
    assert relative_error(logits, rounded) <= FUSED_NUMERICS_BOUND
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
