"""The compiled CPU products and attention (muser_mlx._cpu_kernels via cpu_ext). Products:
every format with a product, decode and prefill row counts, odd row counts, one and several
threads, against float64 products of gguf-py's decoded weights (gguf.quants: independent of
our decoders). Attention: decode and prefill shapes, masks, grouped heads, against float64.

The product multiplies in float32 with x as given (no int8 rounding of x), so only float32
rounding of the weights and of a sum in another order separates it from the reference: a
relative error ~1e-7 measured, bound 2e-5 as for every other product (tests/test_linear.py).

The rounded product (rounded=True: the CPU decode step's) rounds x to int8 blocks first: of 32
values for the 32-value formats (formats.quantize_activations), of 256 for the K-quants
(formats.quantize_activations_super). Against the reference fed the same rounded x only float32
scaling and summation separate them: the same 2e-5. Against the exact reference its error is
the rounding's: each value off by at most max|x| / 254 of its block, an RMS of max|x| / (127
sqrt(12)): for normal x, max|x| ~2.5 sigma over 32 values (0.57 % of the output), ~3 sigma over
256 (0.7 %); ROUNDED_BOUND is 2 %.
"""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants

from muser_mlx import cpu_ext, formats, gguf, ops, testing
from muser_mlx.ops import products
from tests.conftest import relative_error

# `make test` installs the package, which builds the extension, and sets MUSER_REQUIRE_CPU_EXT:
# there the suite fails if it is missing. A checkout run without installing it (the GPU
# machine's suite) skips these tests; its CPU runs MLX's ops.
if not cpu_ext.available() and os.environ.get("MUSER_REQUIRE_CPU_EXT") != "1":
    pytest.skip(f"the CPU extension is not built here: {cpu_ext.unavailable()}", allow_module_level=True)

FORMATS = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
           GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
BLOCK = {t: (256 if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 32) for t in FORMATS}
# Byte offsets of each format's f16 fields (d, and dmin or m), for blocks of random bytes.
F16_FIELDS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
              GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}
BOUND = 2e-5


def random_byte_blocks(rng, ggml_type, rows, row_length) -> np.ndarray:
    """Every bit pattern: random bytes, with finite f16 scales so products stay finite."""
    fmt_bytes = quants.GGML_QUANT_SIZES[ggml_type][1]
    raw = rng.integers(0, 256, size=(rows, row_length // BLOCK[ggml_type] * fmt_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt_bytes)
    for start in F16_FIELDS[ggml_type]:
        scale = rng.uniform(-0.1, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start : start + 2] = scale.reshape(-1, 1).view(np.uint8)
    return raw


ROUNDED_BOUND = 2e-2


def product(x, raw, ggml_type, out_features, threads, rounded=False):
    """The compiled product into an output buffer that held NaN: MLX's buffer cache hands the
    poisoned buffer of the same size back, so an element left unwritten stays NaN."""
    poison = mx.full((x.shape[0], out_features), float("nan"))
    mx.eval(poison)
    del poison
    out = cpu_ext.linear(mx.array(x), mx.array(raw), ggml_type, out_features, threads, rounded=rounded)
    return np.array(out)


def rounded(x: np.ndarray, ggml_type) -> np.ndarray:
    """x as the rounded product of `ggml_type` weights reads it, float64: rounded per 256
    values for K-quants (formats.quantize_activations_super), else per 32."""
    if BLOCK[ggml_type] == 256:
        codes, scales = formats.quantize_activations_super(x)
    else:
        codes, scales, _ = formats.quantize_activations(x)
    return formats.dequantize_activations(codes, scales).astype(np.float64)


def shape_for(rng, ggml_type):
    # 32-value formats: an odd block count too.
    in_features = BLOCK[ggml_type] * int(rng.integers(1, 12 if BLOCK[ggml_type] == 32 else 4))
    out_features = int(rng.integers(1, 30)) * 2 + 1  # odd: the last 4-row tile is short
    return in_features, out_features


def test_the_extension_is_built_and_serves_every_format():
    # Fails where the install could not build the extension, rather than letting the suite
    # pass on the slow MLX-ops path.
    assert cpu_ext.available(), cpu_ext.unavailable()
    assert cpu_ext.FORMATS == set(FORMATS)
    for ggml_type in FORMATS:
        for tokens in (1, 8, 9, 512):
            assert ops.linear_path(ggml_type, tokens, "cpu") == "cpu_gguf_linear"


def test_MUSER_CPU_EXT_PATH_loads_the_extension_built_there_or_says_why_not(tmp_path):
    # make test runs this file again on builds for other instruction sets (MUSER_CPU_EXT_PATH).
    probe = "from muser_mlx import cpu_ext; print(cpu_ext.available()); print(cpu_ext.unavailable())"
    env = dict(os.environ, MUSER_CPU_EXT_PATH=str(tmp_path))
    lines = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1] == f"MUSER_CPU_EXT_PATH={tmp_path} holds no _cpu_kernels extension"
    if os.environ.get("MUSER_CPU_EXT_PATH"):
        loaded = os.path.dirname(os.path.abspath(cpu_ext._cpu_kernels.__file__))
        assert loaded == os.path.abspath(os.environ["MUSER_CPU_EXT_PATH"])


def test_without_the_extension_products_take_mlx_ops_and_say_so_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_ext, "_cpu_kernels", None)
    monkeypatch.setattr(cpu_ext, "FORMATS", frozenset())
    monkeypatch.setattr(cpu_ext, "_why", "the extension muser_mlx._cpu_kernels was not built at install")
    cpu_ext.note_unavailable.cache_clear()
    cpu_ext.note_fallback.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="muser_mlx.cpu_ext"):
            paths = {ops.linear_path(ggml_type, tokens, "cpu") for ggml_type in FORMATS for tokens in (1, 64)}
    finally:
        cpu_ext.note_unavailable.cache_clear()
        cpu_ext.note_fallback.cache_clear()
    assert paths == {"cpu_affine_qmm", "cpu_dequant_matmul"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].endswith("was not built at install")


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 512])
@pytest.mark.parametrize("threads", [1, 3])
def test_product_matches_reference(rng, ggml_type, tokens, threads):
    in_features, out_features = shape_for(rng, ggml_type)
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)  # [out, in]
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    out = product(x, raw, ggml_type, out_features, threads)
    assert out.shape == (tokens, out_features)
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, x.astype(np.float64) @ weight.T) <= BOUND


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 64])
def test_product_of_random_bytes_matches_reference(rng, ggml_type, tokens):
    # Blocks no quantizer would write: every scale, min and code bit pattern, negative d.
    in_features, out_features = shape_for(rng, ggml_type)
    raw = random_byte_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    out = product(x, raw, ggml_type, out_features, 2)
    assert relative_error(out, x.astype(np.float64) @ weight.T) <= BOUND


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 7, 9, 13, 140])  # 9 on: integer panels (12 tokens a tile)
@pytest.mark.parametrize("threads", [1, 3])
def test_rounded_product_matches_the_reference_on_rounded_x(rng, ggml_type, tokens, threads):
    in_features, out_features = shape_for(rng, ggml_type)
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    out = product(x, raw, ggml_type, out_features, threads, rounded=True)
    assert out.shape == (tokens, out_features)
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, rounded(x, ggml_type) @ weight.T) <= BOUND


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_rounded_product_of_random_bytes_matches_the_reference(rng, ggml_type):
    # Every code bit pattern (Q8_0's -128 too), negative scales; x of mixed magnitudes, with
    # a block of zeros (its scale 0) and exact halves of a code step.
    in_features, out_features = BLOCK[ggml_type] * 4, 37
    raw = random_byte_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = (rng.standard_normal((3, in_features)) * rng.choice([1e-3, 1.0, 50.0], size=(3, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.arange(32) - 15.5
    x[1, 0] = 127.0  # scale 1: the other values are halves, rounded away from zero
    out = product(x, raw, ggml_type, out_features, 2, rounded=True)
    assert relative_error(out, rounded(x, ggml_type) @ weight.T) <= BOUND


def test_the_rounded_product_rounds(rng):
    # Fails if the rounded path silently multiplied x as given: its output must be the rounded
    # reference's, measurably apart from the exact one, and within ROUNDED_BOUND of it (a shape
    # of many outputs: over a few, the relative error of a product near zero may dominate).
    ggml_type, in_features, out_features = GGMLType.Q4_K, 1024, 64
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((1, in_features)).astype(np.float32)
    out = product(x, raw, ggml_type, out_features, 2, rounded=True)
    exact = x.astype(np.float64) @ weight.T
    assert relative_error(out, rounded(x, ggml_type) @ weight.T) <= BOUND
    assert 20 * relative_error(rounded(x, ggml_type) @ weight.T, out) < relative_error(out, exact) <= ROUNDED_BOUND


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_k_quant_products_round_x_per_256_values(rng, ggml_type):
    # Fails if a K-quant product rounded x per 32 values (or per row): one large value in each
    # 256 coarsens the step of all 256, only of its own 32 under q8_0 and of every 256 under one
    # scale a row, so the three roundings give measurably different products.
    in_features, out_features = 1024, 64
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((1, in_features)).astype(np.float32)
    x[0, ::256] = 40.0 * np.arange(1, 5)
    out = product(x, raw, ggml_type, out_features, 2, rounded=True)
    per_256 = relative_error(out, rounded(x, ggml_type) @ weight.T)
    codes, scales, _ = formats.quantize_activations(x)
    per_32 = formats.dequantize_activations(codes, scales).astype(np.float64) @ weight.T
    step = np.abs(x).max() / 127
    per_row = np.sign(x) * np.floor(np.abs(x) / step + 0.5) * step
    assert per_256 <= BOUND
    assert relative_error(out, per_32) > 100 * per_256
    assert relative_error(out, per_row.astype(np.float64) @ weight.T) > 100 * per_256


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_rounded_panels_over_several_slices_match_the_decode_tiles(rng, ggml_type):
    # More than 8 tokens run as integer panels, 16 rows and a slice of at most 2048 values of
    # each row at a time: rows past 2048 values (three slices), 37 rows (a short last panel),
    # 300 tokens (past one 256-token group; a short last tile). Each token's row must be what the
    # decode tiles give it alone (the same rounding of x, the same integer sums: only float32
    # scaling in another order apart), and the reference's on the rounded x.
    in_features = 2 * 2048 + 2 * BLOCK[ggml_type]
    raw = random_byte_blocks(rng, ggml_type, 37, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((300, in_features)).astype(np.float32)
    out = product(x, raw, ggml_type, 37, 2, rounded=True)
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, rounded(x, ggml_type) @ weight.T) <= BOUND
    alone = np.concatenate([product(x[t : t + 5], raw, ggml_type, 37, 2, rounded=True) for t in range(0, 300, 5)])
    assert relative_error(out, alone) <= BOUND


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64])
def test_a_batch_of_rows_gives_each_row_its_one_row_product(rng, ggml_type, tokens):
    # A batched decode step multiplies B rows of x at once, as decode tiles (a few rows) or
    # integer panels (more: products.cpp's rounded_tile_tokens, by format); every row must get
    # what its one-row product (the single-sequence decode's) gives it: the same rounding of x,
    # the same integer sums, only float32 scaling in another order apart. Fresh random bytes,
    # an odd count of 32-value blocks where the format has them, a short last tile of rows.
    in_features = BLOCK[ggml_type] * (7 if BLOCK[ggml_type] == 32 else 3)
    out_features = 53
    raw = random_byte_blocks(rng, ggml_type, out_features, in_features)
    x = (rng.standard_normal((tokens, in_features)) * rng.choice([1e-2, 1.0, 30.0], size=(tokens, 1))).astype(np.float32)
    batch = product(x, raw, ggml_type, out_features, 2, rounded=True)
    rows = np.concatenate([product(x[t : t + 1], raw, ggml_type, out_features, 2, rounded=True) for t in range(tokens)])
    assert np.isfinite(batch).all(), "an output left unwritten"
    assert max(relative_error(batch[t], rows[t]) for t in range(tokens)) <= BOUND  # rows of every scale


@pytest.mark.parametrize("rounded_x", [False, True])
def test_a_strided_x_is_read_in_its_strides(rng, rounded_x):
    # The primitive takes x as it comes (no copy node in the graph): a slice of wider rows and
    # a transposed array must multiply as their values.
    ggml_type, in_features, out_features = GGMLType.Q4_0, 64, 9
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    wide = rng.standard_normal((3, 2 * in_features)).astype(np.float32)
    for x, values in ((mx.array(wide)[:, 1 : in_features + 1], wide[:, 1 : in_features + 1]),
                      (mx.array(np.ascontiguousarray(wide[:, :in_features].T)).T, wide[:, :in_features])):
        out = np.array(cpu_ext.linear(x, mx.array(raw), ggml_type, out_features, 2, rounded=rounded_x))
        expected = (rounded(values, ggml_type) if rounded_x else values.astype(np.float64)) @ weight.T
        assert relative_error(out, expected) <= BOUND


def test_ops_linear_runs_the_compiled_product_on_the_cpu(rng, tmp_path, monkeypatch):
    # Through the model's entry point, with MLX's own CPU paths made to fail: the compiled
    # product must be what ran.
    for fallback in ("cpu_affine_qmm", "cpu_dequant_matmul"):
        monkeypatch.setitem(products._LINEAR_PATHS, fallback, None)
    ggml_type, in_features, out_features = GGMLType.Q4_K, 512, 33
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    path = testing.write_gguf(tmp_path / "w.gguf", {}, {"w": (ggml_type, (in_features, out_features), raw)})
    weight = quants.dequantize(raw, ggml_type).astype(np.float64)
    x = rng.standard_normal((3, 5, in_features)).astype(np.float32)
    with mx.stream(mx.cpu), gguf.read(path) as model:
        out = np.array(ops.linear(mx.array(x), model.tensors["w"]))
    assert relative_error(out, x.astype(np.float64) @ weight.T) <= BOUND


def test_refuses_a_format_without_a_product():
    with pytest.raises(ValueError, match="ggml type 10 has no CPU product"):
        cpu_ext.linear(mx.zeros((1, 256)), mx.zeros((4, 84), dtype=mx.uint8), GGMLType.Q2_K, 4)


def test_refuses_rows_that_do_not_hold_x():
    with pytest.raises(ValueError, match="rows of 36 bytes do not hold 64 values of ggml type 8"):
        cpu_ext.linear(mx.zeros((1, 64)), mx.zeros((4, 36), dtype=mx.uint8), GGMLType.Q8_0, 4)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def attention_reference(q, k, v, scale, mask):
    """float64 softmax(q kᵀ scale, where mask) v with kv heads shared by heads // kv_heads."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    scores = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0))
    total = weights.sum(axis=-1, keepdims=True)
    return np.where(total > 0, (weights / np.where(total > 0, total, 1)) @ v, 0.0)


@pytest.mark.parametrize("tokens, keys, heads, kv_heads, head_dim, window", [
    (1, 37, 9, 3, 64, None),  # a decode step over a full cache: no mask
    (1, 16, 4, 2, 128, 5),  # a decode step on a sliding-window layer
    (7, 20, 4, 1, 256, None),  # a prefill chunk after 13 cached tokens, Gemma's head_dim
    (64, 64, 4, 2, 64, 8),  # a windowed prefill
    (33, 50, 6, 6, 16, None),  # no grouping; keys past a multiple of 16
    (3, 19, 2, 1, 400, None),  # wider than the 256 channels summed in registers at a time
])
@pytest.mark.parametrize("threads", [1, 3])
def test_attention_matches_reference(rng, tokens, keys, heads, kv_heads, head_dim, window, threads):
    q = rng.standard_normal((1, heads, tokens, head_dim)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, keys, head_dim)).astype(np.float32)
    v = rng.standard_normal((1, kv_heads, keys, head_dim)).astype(np.float32)
    mask = None
    if tokens > 1 or window:
        positions = np.arange(keys - tokens, keys)[:, None]
        visible = np.arange(keys)[None, :] <= positions
        if window:
            visible &= np.arange(keys)[None, :] > positions - window
        mask = visible
    scale = head_dim ** -0.5
    out = cpu_ext.attention(mx.array(q), mx.array(k), mx.array(v), scale,
                            None if mask is None else mx.array(mask), threads)
    assert relative_error(np.array(out), attention_reference(q, k, v, scale, mask)) <= BOUND


def test_attention_row_that_sees_no_key_is_zeros(rng):
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 4, 16)).astype(np.float32)
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    out = np.array(cpu_ext.attention(mx.array(q), mx.array(k), mx.array(k), 0.25, mx.array(mask)))
    assert (out[:, :, 1] == 0).all()
    assert relative_error(out, attention_reference(q, k, k, 0.25, mask)) <= BOUND


def test_ops_attention_runs_the_compiled_attention_on_the_cpu(rng, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("MLX's own attention ran on the CPU")

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", refuse)
    q = rng.standard_normal((1, 4, 5, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 64)).astype(np.float32)
    mask = np.tril(np.ones((5, 5), dtype=bool))
    with mx.stream(mx.cpu):
        out = ops.attention(mx.array(q), mx.array(k), mx.array(k), 0.125, mx.array(mask))
        assert relative_error(np.array(out), attention_reference(q, k, k, 0.125, mask)) <= BOUND


def test_attention_refuses_a_head_dim_off_16():
    with pytest.raises(ValueError, match=r"head_dim of 16\), got q \(1,2,1,24\)"):
        cpu_ext.attention(mx.zeros((1, 2, 1, 24)), mx.zeros((1, 1, 3, 24)), mx.zeros((1, 1, 3, 24)), 1.0, None)


# --- a prompt's heads: per-head norm and RoPE (ops.split_heads on the CPU) --------------------
# 70 tokens from position 1000: the angles are computed directly every 32 positions and by
# rotation between them; partial rotation, the consecutive layout, no norm, no rotation.
@pytest.mark.parametrize("heads, head_dim, rotary_dim, traditional, normed",
                         [(4, 256, 256, False, True), (3, 64, 32, True, True), (2, 128, 128, False, False),
                          (2, 64, 0, False, True)],
                         ids=["gemma-q", "partial-consecutive", "rope-only", "norm-only"])
def test_norm_rope_heads_matches_reference(rng, heads, head_dim, rotary_dim, traditional, normed):
    from muser_mlx.reference import rope, rms

    tokens, start, extra = 70, 1000, 3 * head_dim
    y = (rng.standard_normal((2, tokens, heads * head_dim + extra)) * 4).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, head_dim).astype(np.float32)
    whole = mx.array(y)
    part = whole[..., extra:]  # a slice of a wider product output, read in place
    rope_args = dict(dims=rotary_dim, base=10000.0, traditional=traditional) if rotary_dim else None
    out = np.array(ops.split_heads(part, heads, head_dim, mx.array(norm) if normed else None, 1e-6,
                                   rope_args, start))
    expected = y[..., extra:].astype(np.float64).reshape(2, tokens, heads, head_dim)
    if normed:
        expected = rms(expected, 1e-6) * norm
    if rotary_dim:
        positions = np.arange(start, start + tokens, dtype=np.float64)
        expected = np.stack([rope(e, positions, rotary_dim, 10000.0, traditional) for e in expected])
    assert out.shape == (2, heads, tokens, head_dim)
    assert relative_error(out, expected.transpose(0, 2, 1, 3)) <= 1e-6


def test_ops_split_heads_runs_the_compiled_heads_on_the_cpu(rng, monkeypatch):
    calls = []
    real = cpu_ext.norm_rope_heads
    monkeypatch.setattr(cpu_ext, "norm_rope_heads", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = mx.array(rng.standard_normal((1, 5, 128)).astype(np.float32))
    rope_args = dict(dims=64, base=10000.0, traditional=False)
    fused = np.array(ops.split_heads(y, 2, 64, mx.ones((64,)), 1e-6, rope_args, 7))
    assert calls == [1]
    monkeypatch.setattr(cpu_ext, "available", lambda: False)  # MLX's ops: the same heads
    plain = np.array(ops.split_heads(y, 2, 64, mx.ones((64,)), 1e-6, rope_args, 7))
    assert relative_error(fused, plain) <= 1e-5


@pytest.mark.parametrize("shape, heads, head_dim, rotary_dim, norm_shape, message", [
    ((1, 4, 100), 2, 64, 64, None, "2 heads of 64"),
    ((1, 4, 128), 2, 64, 33, None, "even rotary_dim"),
    ((1, 4, 128), 2, 64, 128, None, "even rotary_dim"),
    ((1, 4, 128), 2, 64, 64, (32,), "norm"),
    ((4, 128), 2, 64, 64, None, "batch, tokens, width"),
])
def test_norm_rope_heads_refuses_what_does_not_fit(shape, heads, head_dim, rotary_dim, norm_shape, message):
    from muser_mlx import _cpu_kernels

    norm = mx.ones(norm_shape) if norm_shape else None
    with pytest.raises(ValueError, match=message):
        _cpu_kernels.norm_rope_heads(mx.zeros(shape), norm, heads, head_dim, 0, 1e-6, 0, rotary_dim, 10000.0, False)
