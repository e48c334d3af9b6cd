"""The CPU decode step (models/cpu_decode.py) and its primitives (cpu_ext.residual_norm,
cpu_ext.attention_decode), against numpy and the float64 reference, on tiny files.

Unrounded, the step is the general step's float32 math in another order: ~1e-6 measured,
STEP_BOUND 2e-5 (tests/test_cpu_ext.py's). Rounded (generate()'s), every product's input is
rounded to int8: per 32 values for the 32-value formats (formats.quantize_activations), per 256
for the K-quants (formats.quantize_activations_super, llama.cpp's q8_K). Each value is off by at
most max|x| / 254 of its block, ~0.5-0.7 % of each product's output for normal activations, and
through the four layers of these tiny random models 0.5-3.6 % of the logits (measured over the
four architectures, two weight mixes, 30 seeds; the Q4_K_M mix, all K-quants, at the top: with
x per 32 it was 0.5-2.3 %); ROUNDED_BOUND doubles the worst seen, as FUSED_BOUND does for the
GPU's step. Against the reference that rounds the same values (Reference(decode_numerics=True,
float16_cache=False, q8_k=True): the CPU cache stays float32) what is left is float32 against
float64 moving a code across a rounding boundary, and each moved code moving later ones through
the cache: 0 to 1.8 % over the same 240 runs (a moved code of a 256-value block moves its value
by a coarser step than one of 32); ROUNDED_NUMERICS_BOUND doubles that too.
"""

from __future__ import annotations

import dataclasses
import os
import re

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import cpu_ext, ops
from muser_mlx.ops import products
from muser_mlx.generate import decode, prefill
from muser_mlx.models import cpu_decode
from muser_mlx.models.cpu_decode import CPUDecodeStep
from muser_mlx.reference import Reference
from tests.conftest import random_ids, relative_error, tiny_models
from tests.test_cpu_ext import random_byte_blocks

if not cpu_ext.available() and os.environ.get("MUSER_REQUIRE_CPU_EXT") != "1":
    pytest.skip(f"the CPU extension is not built here: {cpu_ext.unavailable()}", allow_module_level=True)

ARCHITECTURES = ["muse-glimmer", "llama", "gemma3", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma2", "olmo2"]
WINDOW = 8
STEP_BOUND = 2e-5
# Float16 caches: the two steps' float32 keys may differ in their last bit (RoPE angles, norms
# computed apart) and then round to float16 values one float16 step (2^-11) apart. Measured
# over six seeds of the four architectures: 0 for most, up to 4e-5 (muse-glimmer's QK norms).
HALF_CACHE_STEP_BOUND = 2e-4
ROUNDED_BOUND = 7.5e-2
ROUNDED_NUMERICS_BOUND = 3.5e-2
PRIMITIVE_BOUND = 2e-5
# One node a layer against the separate nodes: the same functions on the same values.
LAYER_BOUND = 1e-6


@pytest.fixture(autouse=True)
def on_the_cpu():
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


@pytest.fixture
def tiny(tmp_path, rng):
    return tiny_models(tmp_path, rng, WINDOW, "Q4_K_M")


def run_steps(step, ids, cache) -> np.ndarray:
    """Logits [len(ids), vocab] of one step per id."""
    return np.array(mx.stack([step(mx.array([[int(token)]], dtype=mx.int32), cache) for token in ids]))


# --- the step ------------------------------------------------------------------------------------

CACHE_DTYPES = [mx.float32] + ([mx.float16] if cpu_ext.half_cache() else [])  # float16: generate()'s


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_unrounded_steps_match_the_general_step(tiny, rng, architecture, weights, cache_dtype):
    # A float16 cache: both round each key and value as they write it.
    _, model = tiny(architecture, weights)
    ids = random_ids(rng, model, 4 * WINDOW)
    prompt = 2 * WINDOW + 1
    compiled_cache, general_cache = model.make_cache(cache_dtype), model.make_cache(cache_dtype)
    mx.eval(model(ids[None, :prompt], compiled_cache), model(ids[None, :prompt], general_cache))
    logits = run_steps(CPUDecodeStep(model, rounded=False), ids[prompt:], compiled_cache)
    expected = np.array(mx.concatenate([model(ids[None, [i]], general_cache)[0]
                                        for i in range(prompt, ids.size)]))
    assert relative_error(logits, expected) <= (STEP_BOUND if cache_dtype == mx.float32 else HALF_CACHE_STEP_BOUND)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rounded_steps_match_the_reference_within_the_bound(tiny, rng, architecture, weights, cache_dtype):
    # generate()'s numerics on the CPU: products on int8 x, the cache float16 (or float32).
    file, model = tiny(architecture, weights)
    ids = random_ids(rng, model, 3 * WINDOW + 2)
    logits = run_steps(CPUDecodeStep(model, rounded=True), ids, model.make_cache(cache_dtype))
    exact = Reference(model.config, file.tensors).forward(ids)
    rounded = Reference(model.config, file.tensors, decode_numerics=True,
                        float16_cache=cache_dtype == mx.float16, q8_k=True).forward(ids)
    assert relative_error(logits, exact) <= ROUNDED_BOUND
    assert relative_error(logits, rounded) <= ROUNDED_NUMERICS_BOUND


def test_rounded_steps_round(tiny, rng):
    # Fails if the rounded step silently ran the exact products (then ~1e-7 from the exact
    # reference, ~1 % from the rounding one): its first step must sit nearer the reference that
    # rounds. Usually ~1e-7 from it; where float32 moves a code at a tie (these weights are
    # quantized, so ties are common), up to ~2 % measured, once (seed 1543646790) a little
    # nearer the exact one: so 5 first tokens, at least 4 of them nearer. Later steps are left
    # out: moved codes carry on through the cache.
    file, model = tiny("llama", "Q4_K_M")
    exact_reference = Reference(model.config, file.tensors)
    rounding_reference = Reference(model.config, file.tensors, decode_numerics=True, float16_cache=False, q8_k=True)
    nearer = 0
    for ids in random_ids(rng, model, 5).reshape(5, 1):
        logits = run_steps(CPUDecodeStep(model, rounded=True), ids, model.make_cache())
        exact, rounded = exact_reference.forward(ids), rounding_reference.forward(ids)
        nearer += relative_error(logits, exact) > relative_error(logits, rounded)
    assert nearer >= 4


@pytest.mark.parametrize("rounded", [True, False], ids=["rounded", "exact"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_one_node_layers_give_the_separate_nodes_logits(tiny, rng, architecture, weights, cache_dtype, rounded):
    # cpu_ext.decode_layer calls the separate nodes' functions in their order on the same values:
    # equal logits (measured: bit for bit over the four architectures, both mixes, both cache
    # dtypes), LAYER_BOUND allowing only a contraction the compiler may make differently inlined.
    # 3 windows of steps: the sliding layers' rings wrap.
    _, model = tiny(architecture, weights)
    ids = random_ids(rng, model, 3 * WINDOW)
    one_node, separate = (run_steps(CPUDecodeStep(model, rounded=rounded, layer_primitive=primitive), ids,
                                    model.make_cache(cache_dtype)) for primitive in (True, False))
    assert np.isfinite(one_node).all()
    assert relative_error(one_node, separate) <= LAYER_BOUND


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_layer_is_one_node(tiny, rng, architecture, tmp_path):
    # Fails if a layer fell back to its separate nodes (or the step grew nodes elsewhere).
    _, model = tiny(architecture, "Q4_K_M")
    cache = model.make_cache()
    for layer_cache in cache:
        layer_cache.reserve(1, model.config.kv_heads, model.config.head_dim, 1)
        mx.eval(layer_cache.keys, layer_cache.values)  # the step's inputs, not its nodes
    step = CPUDecodeStep(model, rounded=True)
    logits, keys, values = step._graph(mx.array([[1]], dtype=mx.int32), mx.array([0], dtype=mx.int32),
                                       [c.keys for c in cache], [c.values for c in cache])
    mx.export_to_dot(str(tmp_path / "step.dot"), logits, *keys, *values)
    nodes = re.findall(r'label ="(\w+)"', (tmp_path / "step.dot").read_text())
    assert nodes.count("LayerDecode") == model.config.layers
    assert nodes.count("GGUFLinear") <= 1 and nodes.count("ResidualNorm") == 1  # the LM head, the first norm
    assert not {"CacheWrite", "AttentionDecode", "GatedActivation", "Split"} & set(nodes), nodes


@pytest.mark.parametrize("layer_primitive", [True, False], ids=["one node", "separate nodes"])
def test_unrounded_steps_follow_scaled_rope(tiny, rng, layer_primitive):
    """Llama 3's frequency factors and YaRN (the inverse frequencies DecodeHeads carries): the
    exact step against the float64 reference."""
    from tests.test_models import scaled_rope

    for kind in ("rope_freqs", "yarn"):
        file, model = tiny("llama", "Q8_0", **scaled_rope(kind, rng))
        ids = random_ids(rng, model, 2 * WINDOW)
        logits = run_steps(CPUDecodeStep(model, rounded=False, layer_primitive=layer_primitive), ids,
                           model.make_cache())
        assert relative_error(logits, Reference(model.config, file.tensors).forward(ids)) <= STEP_BOUND


@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3"])
def test_sliding_window_layers_see_exactly_window_keys(tiny, rng, architecture):
    file, model = tiny(architecture, "Q8_0")
    ids = random_ids(rng, model, 5 * WINDOW)
    decoded = run_steps(CPUDecodeStep(model, rounded=False), ids, model.make_cache())[WINDOW:]

    def reference(window):
        config = dataclasses.replace(model.config, sliding_window=window)
        return Reference(config, file.tensors).forward(ids)[WINDOW:]

    right = relative_error(decoded, reference(WINDOW))
    assert right <= 1e-4
    assert relative_error(decoded, reference(WINDOW + 1)) > 100 * right
    assert relative_error(decoded, reference(WINDOW - 1)) > 100 * right


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_steps_follow_a_prefill_chunk_a_trimmed_step_and_a_grown_cache(tiny, rng, architecture):
    # generate()'s order: a chunk through the general path, then steps; the step fed ahead of a
    # stop is trimmed and the next token takes its position; the cache grows by 256 slots at 256.
    file, model = tiny(architecture, "Q4_K_M")
    ids = random_ids(rng, model, 262)
    chunk = 250
    cache = model.make_cache()
    mx.eval(model(ids[None, :chunk], cache))
    step = CPUDecodeStep(model, rounded=False)
    run_steps(step, random_ids(rng, model, 1), cache)  # fed ahead, then trimmed
    for layer_cache in cache:
        layer_cache.trim(1)
    logits = run_steps(step, ids[chunk:], cache)
    assert cache[0].keys.shape[2] == 512
    expected = Reference(model.config, file.tensors).forward(ids)[chunk:]
    assert relative_error(logits, expected) <= 1e-4


def test_a_step_past_the_context_is_refused(tiny):
    _, model = tiny("llama", "Q8_0", context=4)
    cache = model.make_cache()
    run_steps(model.cpu_step, [1, 2, 3, 4], cache)
    with pytest.raises(ValueError, match="5 positions exceed the model's context of 4 tokens"):
        model.cpu_step(mx.array([[1]], dtype=mx.int32), cache)


def test_generate_runs_the_rounded_compiled_step_on_the_cpu(tiny, rng, monkeypatch):
    # The general step is made to fail after the prompt: generate()'s one-token steps must be
    # the compiled CPU step's, and its products must be asked to round.
    _, model = tiny("qwen2", "Q4_K_M")
    assert cpu_decode.serves(model) and cpu_decode.rounds(model)
    asked = []
    linear = ops.linear

    def spy(x, weight, rounded=False, **options):
        asked.append(rounded)
        return linear(x, weight, rounded=rounded, **options)

    monkeypatch.setattr(ops, "linear", spy)

    def general_step(ids, cache=None):
        raise AssertionError("a one-token step ran the general step")

    monkeypatch.setattr(model, "hidden_unchecked", general_step)
    cache = cpu_decode.generation_cache(model)
    assert all(c.dtype == (mx.float16 if cpu_ext.half_cache() else mx.float32) for c in cache)
    first, _ = decode(model, mx.array([[3]], dtype=mx.int32), cache)
    ids = [int(np.argmax(np.array(first)))]
    for _ in range(4):
        logits, _ = decode(model, mx.array([ids[-1:]], dtype=mx.int32), cache)
        ids.append(int(np.argmax(np.array(logits))))
    assert asked and all(asked)
    assert cache[0].offset == 5


def test_the_prompts_last_token_takes_the_exact_step(tiny, rng, monkeypatch):
    # prefill()'s chunks round their products (ops.rounded_products); its last token runs the
    # compiled step with exact products (the first token is chosen from exact logits); the
    # generated tokens' steps round. Fails if any of the three is swapped.
    _, model = tiny("llama", "Q4_K_M")
    asked = []
    linear = ops.linear

    def spy(x, weight, rounded=False, **options):
        # The step's x [1, hidden]; the chunk's [1, T, hidden]. Rounded: asked, or in the context.
        asked.append((x.ndim, rounded or products._ROUNDING.get()))
        return linear(x, weight, rounded=rounded, **options)

    monkeypatch.setattr(ops, "linear", spy)
    cache = model.make_cache()
    logits, _ = prefill(model, [int(i) for i in random_ids(rng, model, 5)], cache)
    steps = [rounded for ndim, rounded in asked if ndim == 2]
    chunks = [rounded for ndim, rounded in asked if ndim == 3]
    assert steps and not any(steps)
    assert chunks and all(chunks)
    asked.clear()
    decode(model, mx.array([[int(np.argmax(np.array(logits)))]], dtype=mx.int32), cache)
    assert asked and all(rounded for _, rounded in asked)
    assert cache[0].offset == 6


@pytest.mark.parametrize("tokens", [5, 3 * WINDOW + 2], ids=["tiles", "panels"])  # > 8 rows: integer panels
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rounded_prompt_chunks_match_the_reference_that_rounds(tiny, rng, architecture, tokens):
    # generate()'s prompt chunks on the CPU (ops.rounded_products): every product's input rounded
    # as the steps round it, so within the steps' bounds of the reference that rounds the same
    # values, and of the exact one. Over 40 seeds x 4 architectures (26 tokens): 1.9 % at most
    # from the one that rounds (a code moved at a tie, carried on), 3.6 % from the exact one.
    # That the context rounds: tests/test_linear.py; that prefill() enters it: the test above.
    file, model = tiny(architecture, "Q4_K_M")
    ids = random_ids(rng, model, tokens)
    with ops.rounded_products():
        logits = np.array(model(mx.array(ids[None]), model.make_cache())[0])
    exact = Reference(model.config, file.tensors).forward(ids)
    rounded = Reference(model.config, file.tensors, decode_numerics=True, float16_cache=False, q8_k=True).forward(ids)
    assert np.isfinite(logits).all()
    assert relative_error(logits, rounded) <= ROUNDED_NUMERICS_BOUND
    assert relative_error(logits, exact) <= ROUNDED_BOUND


# --- the primitives ------------------------------------------------------------------------------

def rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_branch_weight", [True, False])
@pytest.mark.parametrize("with_next_weight", [True, False])  # False: OLMo 2's, normed is the sum
def test_residual_norm_matches_numpy(rng, rows, with_residual, with_branch_weight, with_next_weight):
    hidden = 96
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    branch = (rng.standard_normal((rows, hidden)) * 3).astype(np.float32)
    branch_weight = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    next_weight = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    poison = mx.full((2, rows, hidden), float("nan"))
    mx.eval(poison)
    del poison
    # The branch as a transposed view: the primitive reads it in its strides.
    strided_branch = mx.array(np.ascontiguousarray(branch.T)).T
    total, normed = cpu_ext.residual_norm(mx.array(residual) if with_residual else None, strided_branch,
                                          mx.array(branch_weight) if with_branch_weight else None,
                                          mx.array(next_weight) if with_next_weight else None, 1e-6, 1e-5)
    b = branch.astype(np.float64)
    if with_branch_weight:
        b = rms(b, 1e-6) * branch_weight
    expected_total = residual + b if with_residual else b
    expected_normed = rms(expected_total, 1e-5) * next_weight if with_next_weight else expected_total
    assert relative_error(np.array(total), expected_total) <= PRIMITIVE_BOUND
    assert relative_error(np.array(normed), expected_normed) <= PRIMITIVE_BOUND


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["halves of one output", "contiguous", "transposed", "3-d"])
def test_gated_activation_matches_numpy(rng, activation, layout):
    # n = 83: five whole vectors and a tail of 3. Values up to +-90 (exp of either sign past
    # float32's range) and exact zeros.
    rows, n = 7, 83
    y = (rng.standard_normal((rows, 2 * n)) * rng.choice([0.1, 3.0, 30.0], size=(rows, 1))).astype(np.float32)
    y[0, :6] = [-90.0, -40.0, 0.0, 40.0, 90.0, 1e-30]
    if layout == "halves of one output":  # slices read where they lie
        gate, up = mx.split(mx.array(y), 2, axis=-1)
    elif layout == "contiguous":
        gate, up = mx.array(y[:, :n]), mx.array(y[:, n:])
    elif layout == "transposed":  # copied by the primitive
        gate, up = (mx.array(np.ascontiguousarray(half.T)).T for half in (y[:, :n], y[:, n:]))
    else:
        gate, up = (mx.array(half.reshape(1, rows, n)) for half in (y[:, :n], y[:, n:]))
    poison = mx.full((rows, n), float("nan"))
    mx.eval(poison)
    del poison
    out = np.array(cpu_ext.gated_activation(gate, up, activation)).reshape(rows, n)
    g, u = y[:, :n].astype(np.float64), y[:, n:].astype(np.float64)
    if activation == "silu":
        expected = g / (1.0 + np.exp(-g)) * u
    else:
        expected = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * u
    assert np.isfinite(out).all(), "a value left unwritten or overflowed"
    assert relative_error(out, expected) <= PRIMITIVE_BOUND


def test_gated_activation_refuses_unlike_shapes_and_unknown_activations():
    with pytest.raises(ValueError, match="one non-empty shape"):
        cpu_ext.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 9)), "silu")
    with pytest.raises(ValueError, match="no compiled gated activation 'relu'"):
        cpu_ext.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 8)), "relu")


def rope(x, position, dims, base, traditional):
    """x [heads, head_dim] rotated by RoPE at `position` over its first `dims` channels."""
    half = dims // 2
    angles = position * base ** (-2.0 * np.arange(half) / dims)
    cos, sin = np.cos(angles), np.sin(angles)
    out = x.copy()
    if traditional:
        first, second = x[:, 0:dims:2], x[:, 1:dims:2]
        out[:, 0:dims:2], out[:, 1:dims:2] = first * cos - second * sin, first * sin + second * cos
    else:
        first, second = x[:, :half], x[:, half:dims]
        out[:, :half], out[:, half:dims] = first * cos - second * sin, first * sin + second * cos
    return out


# (heads, kv_heads, position, capacity): a ring in the third; the last two long enough that the
# keys are split in parts (PART_MIN_KEYS: 64), with groups of 6 q heads (two chunks of at most
# 4 heads a task) and of 1.
SHAPES = [(4, 2, 0, 16), (4, 2, 5, 16), (4, 2, 21, 8), (12, 2, 1500, 2048), (3, 3, 3000, 1024)]


@pytest.mark.parametrize("heads, kv_heads, position, capacity", SHAPES)
# whole_norm: OLMo 2's q/k norm over each whole projection; softcap: Gemma 2's capped scores.
@pytest.mark.parametrize("variant", ["plain", "bias", "qk_norm+gate", "traditional+partial", "no_rope",
                                     "bias+whole_norm", "softcap"])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])  # float16: generate()'s caches
def test_attention_decode_matches_numpy(rng, heads, kv_heads, position, capacity, variant, cache_dtype):
    if cache_dtype == "float16" and not cpu_ext.half_cache():
        pytest.skip("the extension was built without _Float16")
    head_dim, eps, scale = 32, 1e-6, 0.3
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    offsets = (2 * kv_size, 0, kv_size)  # y holds k, v, q, then the gate: any order will do
    gate = 2 * kv_size + q_size if "gate" in variant else None
    y = rng.standard_normal((1, 2 * kv_size + q_size + (q_size if gate else 0))).astype(np.float32)
    bias = rng.standard_normal(q_size + 2 * kv_size).astype(np.float32) if "bias" in variant else None
    whole = "whole_norm" in variant
    q_norm, k_norm = (rng.uniform(0.5, 1.5, (2, head_dim)).astype(np.float32)
                      if "qk_norm" in variant else (None, None))
    if whole:
        q_norm, k_norm = (rng.uniform(0.5, 1.5, size).astype(np.float32) for size in (q_size, kv_size))
    softcap = 0.5 if variant == "softcap" else None  # it bites: these scores reach ~5
    dims = {"traditional+partial": 16, "no_rope": 0}.get(variant, head_dim)
    rope_settings = None if dims == 0 else dict(dims=dims, base=10000.0, traditional="traditional" in variant)
    keys = rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(cache_dtype)
    values = rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(cache_dtype)

    poison = mx.full((1, q_size), float("nan"))
    mx.eval(poison)
    del poison
    o, new_keys, new_values = cpu_ext.attention_decode(
        mx.array(y), mx.array(keys), mx.array(values), mx.array([position], dtype=mx.int32),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, offsets=offsets, gate=gate,
        bias=None if bias is None else mx.array(bias),
        q_norm=None if q_norm is None else mx.array(q_norm), k_norm=None if k_norm is None else mx.array(k_norm),
        rope=rope_settings, eps=eps, scale=scale, qk_norm_whole=whole, softcap=softcap)

    y64 = y[0].astype(np.float64)
    full_bias = np.zeros(q_size + 2 * kv_size) if bias is None else bias.astype(np.float64)
    q = (y64[2 * kv_size : 2 * kv_size + q_size] + full_bias[:q_size]).reshape(heads, head_dim)
    k = (y64[:kv_size] + full_bias[q_size : q_size + kv_size]).reshape(kv_heads, head_dim)
    v = (y64[kv_size : 2 * kv_size] + full_bias[q_size + kv_size :]).reshape(kv_heads, head_dim)
    if whole:
        q = (rms(q.reshape(-1), eps) * q_norm).reshape(heads, head_dim)
        k = (rms(k.reshape(-1), eps) * k_norm).reshape(kv_heads, head_dim)
    elif q_norm is not None:
        q, k = rms(q, eps) * q_norm, rms(k, eps) * k_norm
    if dims:
        q, k = (rope(a, position, dims, 10000.0, "traditional" in variant) for a in (q, k))
    expected_keys, expected_values = keys[0].astype(np.float64), values[0].astype(np.float64)
    expected_keys[:, position % capacity], expected_values[:, position % capacity] = k, v
    written_keys, written_values = np.array(new_keys)[0], np.array(new_values)[0]
    assert written_keys.dtype == written_values.dtype == np.dtype(cache_dtype)
    if cache_dtype == "float16":
        # The slot holds the float32 key rounded to float16: within one float16 step (2^-10
        # relative) of the exact key, plus float32's own error in computing it, which is
        # relative to the row (a rotated pair can cancel to a float16 subnormal, whose steps
        # are 2^-24 apart). The value is exactly the float32 value rounded. Attention then
        # reads what was written.
        float32_error = 2**-20 * np.abs(k).max(axis=-1, keepdims=True)
        np.testing.assert_array_less(
            np.abs(written_keys[:, position % capacity] - k),
            2**-10 * np.abs(k) + 2**-24 + float32_error)
        untouched = np.arange(capacity) != position % capacity
        np.testing.assert_array_equal(written_keys[:, untouched], keys[0][:, untouched])
        np.testing.assert_array_equal(written_values, expected_values.astype(np.float32).astype(np.float16))
        expected_keys, expected_values = written_keys.astype(np.float64), written_values.astype(np.float64)
    seen = min(position + 1, capacity)
    expected = np.empty((heads, head_dim))
    for head in range(heads):
        kv = head // (heads // kv_heads)
        scores = expected_keys[kv, :seen] @ q[head] * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        probs = np.exp(scores - scores.max())
        expected[head] = probs / probs.sum() @ expected_values[kv, :seen]
    expected = expected.reshape(1, q_size)
    if gate is not None:
        expected = expected / (1 + np.exp(-y64[gate : gate + q_size]))
    out = np.array(o)
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, expected) <= PRIMITIVE_BOUND
    assert relative_error(written_keys, expected_keys) <= PRIMITIVE_BOUND
    np.testing.assert_array_equal(written_values, expected_values.astype(cache_dtype))


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_attention_decode_rows_are_each_rows_own_call(rng, cache_dtype):
    """B rows of y, each at its own position, over the rows of a cache that holds one row
    more (the batched decode step's store): every row's output and written slot equal the
    one-row call on that row alone, bit for bit; the extra row is left as it was."""
    if cache_dtype == "float16" and not cpu_ext.half_cache():
        pytest.skip("the extension was built without _Float16")
    heads, kv_heads, head_dim, capacity = 4, 2, 32, 16
    positions = [0, 15, 3, 40]  # 40 wraps a ring of 16
    width = (heads + 2 * kv_heads) * head_dim
    y = mx.array(rng.standard_normal((len(positions), width)).astype(np.float32))
    keys = mx.array(rng.standard_normal((len(positions) + 1, kv_heads, capacity, head_dim)).astype(cache_dtype))
    values = mx.array(rng.standard_normal(keys.shape).astype(cache_dtype))
    settings = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, offsets=(0, heads * head_dim,
                    (heads + kv_heads) * head_dim), gate=None, bias=None, q_norm=None, k_norm=None,
                    rope=dict(dims=head_dim, base=10000.0, traditional=False), eps=1e-6, scale=0.3)
    o, new_keys, new_values = cpu_ext.attention_decode(y, keys, values, mx.array(positions, dtype=mx.int32),
                                                       **settings)
    o, new_keys, new_values = np.array(o), np.array(new_keys), np.array(new_values)
    assert o.shape == (len(positions), heads * head_dim) and np.isfinite(o).all()
    for b, position in enumerate(positions):
        one, one_keys, one_values = cpu_ext.attention_decode(y[b : b + 1], keys[b : b + 1], values[b : b + 1],
                                                             mx.array([position], dtype=mx.int32), **settings)
        np.testing.assert_array_equal(o[b], np.array(one)[0])
        np.testing.assert_array_equal(new_keys[b], np.array(one_keys)[0])
        np.testing.assert_array_equal(new_values[b], np.array(one_values)[0])
    np.testing.assert_array_equal(new_keys[-1], np.array(keys)[-1])
    with pytest.raises(ValueError, match="one per row"):
        cpu_ext.attention_decode(y, keys, values, mx.array(positions[:2], dtype=mx.int32), **settings)
    with pytest.raises(ValueError, match="at least B"):
        cpu_ext.attention_decode(y, keys[:2], values[:2], mx.array(positions, dtype=mx.int32), **settings)


@pytest.mark.parametrize("change, message", [
    (dict(head_dim=24), "head_dim of 16"),
    (dict(cache_dtype=mx.bfloat16), "a float32 or float16 cache"),
    (dict(position_dtype=mx.float32), "position must be int32"),
    (dict(offsets=(0, 0, 200)), "at their offsets"),
])
def test_attention_decode_refuses_inputs_that_do_not_fit(change, message):
    head_dim = change.get("head_dim", 32)
    cache = mx.zeros((1, 2, 8, head_dim), dtype=change.get("cache_dtype", mx.float32))
    with pytest.raises(ValueError, match=message):
        cpu_ext.attention_decode(mx.zeros((1, 8 * head_dim)), cache, cache,
                                 mx.array([0], dtype=change.get("position_dtype", mx.int32)),
                                 heads=4, kv_heads=2, head_dim=head_dim,
                                 offsets=change.get("offsets", (0, 4 * head_dim, 6 * head_dim)),
                                 gate=None, bias=None, q_norm=None, k_norm=None, rope=None, eps=1e-6,
                                 scale=1.0)


def separate_layer(x, h, keys, values, position, attention_in, attention_out, ffn_in, ffn_out,
                   norms, settings, post_eps, activation, rounded):
    """The layer as the separate nodes (CPUDecodeStep._layer_nodes' calls): (x, h, keys, values)."""
    def linear(rows, weight):
        return cpu_ext.linear(rows, weight[0], weight[1], weight[0].shape[0], rounded=rounded)

    y = mx.concatenate([linear(h, w) for w in attention_in], axis=-1)
    o, keys, values = cpu_ext.attention_decode(y, keys, values, position, q_norm=norms.get("q"),
                                               k_norm=norms.get("k"), **settings)
    x, h = cpu_ext.residual_norm(x, linear(o, attention_out), norms.get("post_attention"), norms["ffn"],
                                 post_eps, settings["eps"])
    gate, up = mx.split(mx.concatenate([linear(h, w) for w in ffn_in], axis=-1), 2, axis=-1)
    f = linear(cpu_ext.gated_activation(gate, up, activation), ffn_out)
    x, h = cpu_ext.residual_norm(x, f, norms.get("post_ffw"), norms["next"], post_eps, settings["eps"])
    return x, h, keys, values


@pytest.mark.parametrize("rounded", [True, False], ids=["rounded", "exact"])
@pytest.mark.parametrize("variant", ["llama", "bias+gelu", "sandwich+qk_norm+gate"])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_decode_layer_matches_the_separate_nodes(rng, variant, cache_dtype, rounded):
    # Two attention input groups and two feed-forward input groups (gate, up) of five formats,
    # a ring cache (position 21, 16 slots), random norms: all four outputs as the separate nodes
    # give them (LAYER_BOUND), every output buffer poisoned first.
    if cache_dtype == "float16" and not cpu_ext.half_cache():
        pytest.skip("the extension was built without _Float16")
    from gguf import GGMLQuantizationType as GGMLType
    hidden, heads, kv_heads, head_dim, ffn, capacity, position = 256, 4, 2, 64, 512, 16, 21
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    gated = "gate" in variant
    first = q_size * (2 if gated else 1)  # q (and the gate) in the first group, k and v in the second

    def weight(ggml_type, rows, row_length):
        return mx.array(random_byte_blocks(rng, ggml_type, rows, row_length)), ggml_type

    attention_in = [weight(GGMLType.Q4_K, first, hidden), weight(GGMLType.Q8_0, 2 * kv_size, hidden)]
    attention_out = weight(GGMLType.Q4_1, hidden, q_size)
    ffn_in = [weight(GGMLType.Q6_K, ffn, hidden), weight(GGMLType.Q5_0, ffn, hidden)]
    ffn_out = weight(GGMLType.Q5_K, hidden, ffn)

    def vector(size):
        return mx.array(rng.uniform(0.5, 1.5, size).astype(np.float32))

    norms = {"ffn": vector(hidden), "next": vector(hidden)}
    if "qk_norm" in variant:
        norms.update(q=vector(head_dim), k=vector(head_dim))
    if "sandwich" in variant:
        norms.update(post_attention=vector(hidden), post_ffw=vector(hidden))
    settings = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, offsets=(0, first, first + kv_size),
                    gate=q_size if gated else None,
                    bias=mx.array(rng.standard_normal(q_size + 2 * kv_size).astype(np.float32))
                    if "bias" in variant else None,
                    rope=dict(dims=head_dim, base=10000.0, traditional=False), eps=1e-6, scale=0.125)
    activation = "gelu_tanh" if "gelu" in variant else "silu"
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    h = rng.standard_normal((1, hidden)).astype(np.float32)
    cache = rng.standard_normal((2, 1, kv_heads, capacity, head_dim)).astype(cache_dtype)
    inputs = lambda: (mx.array(x), mx.array(h), mx.array(cache[0]), mx.array(cache[1]),  # noqa: E731
                      mx.array([position], dtype=mx.int32))
    expected = [np.array(a) for a in separate_layer(*inputs(), attention_in, attention_out, ffn_in, ffn_out,
                                                    norms, settings, 1e-5, activation, rounded)]
    poison = [mx.full((1, hidden), float("nan")) for _ in range(2)]
    mx.eval(poison)
    del poison
    out = cpu_ext.decode_layer(*inputs(), attention_in=attention_in, attention_out=attention_out,
                               ffn_in=ffn_in, ffn_out=ffn_out, norms=norms, post_eps=1e-5,
                               activation=activation, rounded=rounded, **settings)
    out = [np.array(a) for a in out]
    assert out[2].dtype == out[3].dtype == np.dtype(cache_dtype)
    for got, want in zip(out, expected):
        assert np.isfinite(got).all(), "an output left unwritten"
        assert relative_error(got.astype(np.float64), want.astype(np.float64)) <= LAYER_BOUND
    assert not np.array_equal(out[2], cache[0]) and not np.array_equal(out[3], cache[1])  # written


@pytest.mark.parametrize("change, message", [
    (dict(attention_out_type=0), "attention output product needs a uint8 weight"),
    (dict(ffn_in_rows=(64, 32)), "gate and up must be of one width"),
    (dict(x_shape=(64,)), "expected x and h"),
    (dict(x_shape=(2, 64)), r"cache \[at least B"),
    (dict(ffn_in_count=3), "one or two feed-forward input products"),
    (dict(next_norm=32), r"the norm weights must be \[64\]"),
    (dict(offsets=(0, 64, 200)), "at their offsets"),
])
def test_decode_layer_refuses_inputs_that_do_not_fit(change, message):
    from gguf import GGMLQuantizationType as GGMLType
    hidden, head_dim = 64, 16

    def weight(rows, row_length, ggml_type=GGMLType.Q8_0):
        return mx.zeros((rows, row_length // 32 * 34), dtype=mx.uint8), ggml_type

    rows = change.get("ffn_in_rows", (64, 64))
    cache = mx.zeros((1, 2, 8, head_dim))
    with pytest.raises(ValueError, match=message):
        cpu_ext.decode_layer(
            mx.zeros(change.get("x_shape", (1, hidden))), mx.zeros(change.get("x_shape", (1, hidden))),
            cache, cache, mx.array([0], dtype=mx.int32),
            attention_in=[weight(128, hidden)],
            attention_out=weight(hidden, 64, change.get("attention_out_type", GGMLType.Q8_0)),
            ffn_in=[weight(r, hidden) for r in rows] * (2 if change.get("ffn_in_count") == 3 else 1)
            if change.get("ffn_in_count") != 3 else [weight(64, hidden)] * 3,
            ffn_out=weight(hidden, 64),
            norms={"ffn": mx.ones(hidden), "next": mx.ones(change.get("next_norm", hidden))},
            heads=4, kv_heads=2, head_dim=head_dim, offsets=change.get("offsets", (0, 64, 96)), gate=None,
            bias=None, rope=None, eps=1e-6, post_eps=1e-6, scale=1.0, activation="silu", rounded=True)


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_decode_layer_rows_are_each_rows_own_call(rng, cache_dtype):
    """B rows (a batched step's), each at its own position over its own row of caches that hold
    one row more: every row's x, h and written cache row as the one-row call on that row alone
    gives them (the products take the rows together: LAYER_BOUND), the extra row left as it was;
    as the separate nodes over the rows give them too."""
    if cache_dtype == "float16" and not cpu_ext.half_cache():
        pytest.skip("the extension was built without _Float16")
    from gguf import GGMLQuantizationType as GGMLType
    hidden, heads, kv_heads, head_dim, ffn, capacity = 256, 4, 2, 32, 512, 16
    positions = [0, 15, 3, 40]  # 40 wraps a ring of 16
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def weight(ggml_type, rows, row_length):
        return mx.array(random_byte_blocks(rng, ggml_type, rows, row_length)), ggml_type

    layer = dict(attention_in=[weight(GGMLType.Q4_K, q_size, hidden), weight(GGMLType.Q8_0, 2 * kv_size, hidden)],
                 attention_out=weight(GGMLType.Q4_1, hidden, q_size),
                 ffn_in=[weight(GGMLType.Q6_K, ffn, hidden), weight(GGMLType.Q5_0, ffn, hidden)],
                 ffn_out=weight(GGMLType.Q5_K, hidden, ffn),
                 norms={"ffn": mx.array(rng.uniform(0.5, 1.5, hidden).astype(np.float32)),
                        "next": mx.array(rng.uniform(0.5, 1.5, hidden).astype(np.float32))},
                 heads=heads, kv_heads=kv_heads, head_dim=head_dim, offsets=(0, q_size, q_size + kv_size),
                 gate=None, bias=None, rope=dict(dims=head_dim, base=10000.0, traditional=False), eps=1e-6,
                 post_eps=1e-6, scale=0.2, activation="silu", rounded=True)
    x = rng.standard_normal((len(positions), hidden)).astype(np.float32)
    h = rng.standard_normal((len(positions), hidden)).astype(np.float32)
    cache = rng.standard_normal((2, len(positions) + 1, kv_heads, capacity, head_dim)).astype(cache_dtype)
    poison = [mx.full((len(positions), hidden), float("nan")) for _ in range(2)]
    mx.eval(poison)
    del poison
    out = cpu_ext.decode_layer(mx.array(x), mx.array(h), mx.array(cache[0]), mx.array(cache[1]),
                               mx.array(positions, dtype=mx.int32), **layer)
    out = [np.array(a) for a in out]
    assert all(np.isfinite(a).all() for a in out[:2]), "an output row left unwritten"
    for b, position in enumerate(positions):
        one = cpu_ext.decode_layer(mx.array(x[b : b + 1]), mx.array(h[b : b + 1]), mx.array(cache[0, b : b + 1]),
                                   mx.array(cache[1, b : b + 1]), mx.array([position], dtype=mx.int32), **layer)
        for got, want in zip(out, (np.array(a)[0] for a in one)):
            assert relative_error(got[b].astype(np.float64), want.astype(np.float64)) <= LAYER_BOUND, b
    np.testing.assert_array_equal(out[2][-1], cache[0, -1])
    np.testing.assert_array_equal(out[3][-1], cache[1, -1])
    settings = {k: v for k, v in layer.items() if k in ("heads", "kv_heads", "head_dim", "offsets", "gate", "bias",
                                                        "rope", "eps", "scale")}
    separate = separate_layer(mx.array(x), mx.array(h), mx.array(cache[0]), mx.array(cache[1]),
                              mx.array(positions, dtype=mx.int32), layer["attention_in"], layer["attention_out"],
                              layer["ffn_in"], layer["ffn_out"], layer["norms"], settings, 1e-6, "silu", True)
    for got, want in zip(out, separate):
        assert relative_error(got.astype(np.float64), np.array(want).astype(np.float64)) <= LAYER_BOUND


def buffer_address(a: mx.array) -> int:
    return np.frombuffer(memoryview(a), dtype=np.uint8).__array_interface__["data"][0]


def small_layer(rng, keys, values, in_place=False):
    """cpu_ext.decode_layer on one small Q8_0 layer (hidden 64, 4 heads of 32, 2 kv heads) at
    position 3: (x, h, keys, values)."""
    from gguf import GGMLQuantizationType as GGMLType

    def weight(rows, row_length):
        return mx.array(random_byte_blocks(rng, GGMLType.Q8_0, rows, row_length)), GGMLType.Q8_0

    return cpu_ext.decode_layer(
        mx.array(rng.standard_normal((1, 64)).astype(np.float32)),
        mx.array(rng.standard_normal((1, 64)).astype(np.float32)), keys, values,
        mx.array([3], dtype=mx.int32), attention_in=[weight(256, 64)], attention_out=weight(64, 128),
        ffn_in=[weight(128, 64)], ffn_out=weight(64, 64), norms={"ffn": mx.ones(64), "next": mx.ones(64)},
        heads=4, kv_heads=2, head_dim=32, offsets=(0, 128, 192), gate=None, bias=None,
        rope=dict(dims=32, base=10000.0, traditional=False), eps=1e-6, post_eps=1e-6, scale=1.0,
        activation="silu", rounded=True, in_place=in_place)


def test_decode_layer_writes_the_caches_in_their_own_memory(rng):
    # A cache that nothing else holds is donated (a copy of every cache each step otherwise:
    # a multi-output primitive's inputs are held once per output).
    keys, values = mx.zeros((1, 2, 8, 32)), mx.zeros((1, 2, 8, 32))
    mx.eval(keys, values)
    addresses = buffer_address(keys), buffer_address(values)
    _, _, keys, values = small_layer(rng, keys, values)
    mx.eval(keys, values)
    assert (buffer_address(keys), buffer_address(values)) == addresses
    assert np.abs(np.array(keys)[0, :, 3]).min() > 0 and np.abs(np.array(values)[0, :, 3]).min() > 0


def test_decode_layer_in_place_writes_a_cache_held_elsewhere_in_its_memory(rng):
    # in_place (the batched step's store, which no one else reads): the caches' buffers are
    # written even while another array holds them, as a step in flight does; the holder sees it.
    held_keys, held_values = (mx.array(rng.standard_normal((1, 2, 8, 32)).astype(np.float32)) for _ in range(2))
    before = np.array(held_keys), np.array(held_values)
    addresses = buffer_address(held_keys), buffer_address(held_values)
    _, _, keys, values = small_layer(rng, held_keys, held_values, in_place=True)
    mx.eval(keys, values)
    assert (buffer_address(keys), buffer_address(values)) == addresses
    np.testing.assert_array_equal(np.array(held_keys), np.array(keys))
    assert not np.array_equal(np.array(keys)[0, :, 3], before[0][0, :, 3])
    np.testing.assert_array_equal(np.array(keys)[0, :, :3], before[0][0, :, :3])  # the other slots kept


def test_decode_layer_leaves_a_cache_held_elsewhere_as_it_was(rng):
    held_keys, held_values = (mx.array(rng.standard_normal((1, 2, 8, 32)).astype(np.float32)) for _ in range(2))
    before = np.array(held_keys), np.array(held_values)
    _, _, keys, values = small_layer(rng, held_keys, held_values)
    mx.eval(keys, values)
    np.testing.assert_array_equal(np.array(held_keys), before[0])
    np.testing.assert_array_equal(np.array(held_values), before[1])
    assert not np.array_equal(np.array(keys), before[0])
    np.testing.assert_array_equal(np.array(keys)[0, :, :3], before[0][0, :, :3])  # the other slots copied
