"""The model graph (muser_mlx/models) against the float64 numpy reference, on tiny files."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import cache as cache_module
from muser_mlx import gguf, kernels, ops
from muser_mlx.models import build_model, config_for, transformer
from muser_mlx.models.config import MissingKeyError, MissingTensorError, ModelConfigError, TensorShapeError
from muser_mlx.reference import Reference
from muser_mlx.settings import DEFAULT
from muser_mlx.testing import tiny_model

from tests.conftest import random_ids, relative_error, tiny_models

ARCHITECTURES = ["muse-glimmer", "llama", "gemma3", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma2",
                 "olmo2"]
WEIGHTS = ["F32", "F16", "Q8_0", "Q4_K", "Q4_K_M"]
WINDOW = 8
# CPU: the graph is float32 and the reference float64 over the same decoded weights, so only
# float32 rounding separates them. GPU: prefill rows (T > 8) multiply in float16.
TOLERANCE = {"cpu": 1e-4, "gpu": 5e-3}


@pytest.fixture
def tiny(tmp_path, rng):
    return tiny_models(tmp_path, rng, WINDOW, "F32")


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_match_the_reference(tiny, rng, backend, architecture, weights):
    file, model = tiny(architecture, weights)
    ids = random_ids(rng, model, 5 * WINDOW + 3)  # long enough that window layers drop keys
    logits = model(ids[None])
    mx.eval(logits)
    expected = Reference(model.config, file.tensors).forward(ids)
    assert logits.shape == (1, ids.size, model.config.vocab)
    assert relative_error(logits[0], expected) <= TOLERANCE[backend]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_prefill_decode_and_a_mix_give_the_same_logits(tiny, rng, backend, architecture):
    _, model = tiny(architecture, "Q8_0")
    ids = random_ids(rng, model, 4 * WINDOW + 5)
    whole = np.array(model(ids[None]))

    def run(bounds):
        cache = model.make_cache()
        pieces = [model(ids[None, a:b], cache) for a, b in zip(bounds, bounds[1:])]
        return np.array(mx.concatenate(pieces, axis=1))

    one_by_one = run(list(range(ids.size + 1)))
    chunks_of_7 = run(list(range(0, ids.size, 7)) + [ids.size])
    mixed = run([0, 11, 12, 13, 30, 31, ids.size])
    for logits in (one_by_one, chunks_of_7, mixed):
        assert relative_error(logits, whole) <= TOLERANCE[backend]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_match_the_reference_for_32_steps(tiny, rng, architecture):
    # Each step's token is the reference's greedy one, fed the same tokens, unless the two
    # logits are a near-tie the step's own measured difference explains: a token b picked over
    # the reference's best a needs ref[a] - ref[b] <= |diff[a]| + |diff[b]| <= 2 max|diff|. On a
    # GPU the cache holds float16 and tiny random models have such ties: an exact comparison of
    # the tokens failed once in the H200's suite.
    file, model = tiny(architecture, "Q4_K_M")
    reference = Reference(model.config, file.tensors)
    tolerance = TOLERANCE["cpu" if kernels.backend() == "cpu" else "gpu"]
    tokens = list(random_ids(rng, model, 5))
    cache = model.make_cache()
    logits = model(np.array(tokens)[None], cache)
    for _ in range(32):
        ours = np.array(logits[0, -1]).astype(np.float64)
        expected = reference.forward(np.array(tokens))[-1]
        assert relative_error(ours, expected) <= tolerance
        pick, best = int(np.argmax(ours)), int(np.argmax(expected))
        assert pick == best or expected[best] - expected[pick] <= 2 * np.abs(ours - expected).max()
        tokens.append(pick)
        logits = model(np.array(tokens[-1:])[None], cache)


@pytest.mark.parametrize("step", [None, 3])  # 3: window caches grow (3, 6, then 8 slots) before they wrap
@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3", "gemma2"])
def test_sliding_window_layers_see_exactly_window_keys(tiny, rng, monkeypatch, architecture, step):
    """The model must match a reference with the file's window and clearly differ from
    references whose window is one key wider or narrower."""
    if step:
        monkeypatch.setattr(cache_module, "STEP", step)
    file, model = tiny(architecture, "F32")
    ids = random_ids(rng, model, 5 * WINDOW)
    cache = model.make_cache()
    model(ids[None, :WINDOW], cache)
    decoded = np.array(mx.concatenate([model(ids[None, t : t + 1], cache)
                                       for t in range(WINDOW, ids.size)], axis=1))[0]

    def reference(window):
        config = dataclasses.replace(model.config, sliding_window=window)
        return Reference(config, file.tensors).forward(ids)[WINDOW:]

    backend = "cpu" if mx.default_device() == mx.cpu else "gpu"
    right = relative_error(decoded, reference(WINDOW))
    assert right <= TOLERANCE[backend]
    # A window one key wider or narrower is at least ten times further away.
    assert relative_error(decoded, reference(WINDOW + 1)) > max(10 * right, 1e-3)
    assert relative_error(decoded, reference(WINDOW - 1)) > max(10 * right, 1e-3)


@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3"])
def test_prefill_chunks_within_a_wide_window_match_the_reference(tmp_path, rng, backend, architecture):
    """Chunks of more than MATVEC_MAX_TOKENS rows that end inside a 48-key window: the window
    caches give attention their filled slots in order (on a GPU, cuDNN's attention with a
    causal mask), then a chunk that crosses the window and one-token steps."""
    path = tiny_model(tmp_path / f"{architecture}-wide.gguf", architecture, rng, weights="Q8_0", window=48)
    file = gguf.read(path)
    model = build_model(file)
    ids = random_ids(rng, model, 70)
    cache = model.make_cache()
    pieces = [model(ids[None, a:b], cache) for a, b in [(0, 20), (20, 45), (45, 60), (60, 61), (61, 70)]]
    logits = np.array(mx.concatenate(pieces, axis=1))[0]
    expected = Reference(model.config, file.tensors).forward(ids)
    assert relative_error(logits, expected) <= TOLERANCE[backend]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3"])
def test_a_chunk_past_the_window_builds_one_mask_in_the_form_attention_takes(tiny, rng, monkeypatch,
                                                                            architecture, dtype):
    """A chunk past the window: its window layers share one mask (cache.attention_mask reuses
    the one it made for the same key positions array), boolean for float32 attention and
    additive (0 / -inf) float16 for float16 attention (a GPU prefill chunk: MLX's attention on
    CUDA would broadcast a boolean mask to every head before converting it). Either way the
    chunk's logits are the reference's. Attention itself runs in float32 here; on a GPU the
    chunk's products multiply in float16 (TOLERANCE["gpu"])."""
    file, model = tiny(architecture, "F32")
    ids = random_ids(rng, model, 3 * WINDOW + 2)
    original = ops.attention
    masks = []

    def recording(q, keys, values, scale, mask=None, keep_float16=False, softcap=None):
        masks.append(mask)
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            assert mask.dtype == mx.float16
            visible = mask == 0
            assert bool(mx.all(visible | (mask == -np.inf)))  # 0 or -inf, nothing else
            mask = visible
        return original(q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), scale, mask,
                        keep_float16=keep_float16, softcap=softcap)

    monkeypatch.setattr(ops, "attention", recording)
    monkeypatch.setattr(ops, "attention_dtype", lambda tokens, head_dim, backend=None: dtype)
    cache = model.make_cache()
    mx.eval(model(ids[None, :WINDOW], cache))
    masks.clear()
    logits = np.array(model(ids[None, WINDOW:], cache))[0]  # the window caches wrap in this chunk
    sliding = model.config.swa_layers
    window_masks = [mask for mask, is_window in zip(masks, sliding) if is_window]
    assert len(masks) == len(sliding) and len(window_masks) >= 2
    assert all(mask is window_masks[0] for mask in window_masks)
    assert window_masks[0].dtype == (mx.float16 if dtype == mx.float16 else mx.bool_)
    rows, keys = ids.size - WINDOW, WINDOW + ids.size - WINDOW
    if dtype == mx.float16:  # a GPU prefill chunk's shapes, padded (transformer.bucketed)
        rows, keys = (-(-n // step) * step for n, step in ((rows, DEFAULT.attention_row_bucket),
                                                          (keys, DEFAULT.attention_key_bucket)))
    assert window_masks[0].shape == (rows, keys)
    expected = Reference(model.config, file.tensors).forward(ids)[WINDOW:]
    on_cpu = mx.default_device() == mx.cpu and dtype == mx.float32
    assert relative_error(logits, expected) <= TOLERANCE["cpu" if on_cpu else "gpu"]


def attention_reference(q, keys, values, scale, visible) -> np.ndarray:
    """float64 softmax(q keys^T scale, where visible [T, S]) values, kv heads shared by groups."""
    q, keys, values = (np.asarray(a, dtype=np.float64) for a in (q, keys, values))
    group = q.shape[1] // keys.shape[1]
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    scores = np.where(visible, np.einsum("bhtd,bhsd->bhts", q, keys) * scale, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", weights / weights.sum(axis=-1, keepdims=True), values)


@pytest.mark.parametrize("causal", [True, False])
def test_bucketed_attention_keeps_each_row_of_the_chunk(rng, causal):
    """transformer.bucketed pads a GPU prefill chunk's q, keys and values (float16) to its
    buckets; the attention over the padded arrays (MLX's, on the CPU), rows front .. front + T
    - 1, is the unpadded attention of the chunk's queries (float64 reference): with the causal
    mask (keys in order, positions 0 .. S-1), and with an additive mask made from key positions
    in a ring's order, a sliding window, as a window layer past its window takes it. The
    padding rows of keys and values are filled with large values first: a real query that saw
    one would be off by far more than the tolerance (float16 inputs and output: 2e-3)."""
    heads, kv_heads, head_dim, window, scale = 4, 2, 16, 300, 0.25
    key_bucket, row_bucket = DEFAULT.attention_key_bucket, DEFAULT.attention_row_bucket
    for _ in range(3):
        start, tokens = int(rng.integers(0, 700)), int(rng.integers(9, 600))
        if causal:
            positions = np.arange(start + tokens, dtype=np.int32)
            visible = positions[None, :] <= np.arange(start, start + tokens)[:, None]
        else:
            ring = rng.permutation(np.arange(start - window, start)).astype(np.int32)
            positions = np.concatenate([ring, np.arange(start, start + tokens, dtype=np.int32)])
            query = np.arange(start, start + tokens)[:, None]
            visible = (positions[None, :] <= query) & (positions[None, :] > query - window)
        seen = positions.size
        q, keys, values = (rng.standard_normal((1, h, n, head_dim)).astype(np.float16)
                           for h, n in ((heads, tokens), (kv_heads, seen), (kv_heads, seen)))
        expected = attention_reference(q, keys, values, scale, visible)
        padded_q, padded_keys, padded_values, padded_positions, front = transformer.bucketed(
            mx.array(q), mx.array(keys), mx.array(values), mx.array(positions), causal, key_bucket, row_bucket)
        rows, count = padded_q.shape[2], padded_keys.shape[2]
        assert count % key_bucket == 0 and count - seen < key_bucket
        assert rows % row_bucket == 0 or (causal and rows == count)
        assert rows <= count and 0 <= front and front + tokens <= rows
        # Poison the padding keys and values: the mask must hide them from every real query.
        poison = mx.full((1, kv_heads, count - seen, head_dim), 60.0, dtype=mx.float16)
        padded_keys = mx.concatenate([padded_keys[:, :, :seen], poison], axis=2)
        padded_values = mx.concatenate([padded_values[:, :, :seen], poison], axis=2)
        if causal:
            mask = "causal"
        else:
            assert np.array_equal(np.array(padded_positions)[:seen], positions)
            assert np.all(np.array(padded_positions)[seen:] == cache_module.NOWHERE)
            mask = cache_module.attention_mask(start, rows, padded_positions, window, additive=mx.float16)
        out = mx.fast.scaled_dot_product_attention(padded_q, padded_keys, padded_values, scale=scale, mask=mask)
        assert relative_error(np.array(out[:, :, front : front + tokens].astype(mx.float32)), expected) <= 2e-3


def test_bucketed_chunks_of_a_prompt_take_few_attention_shapes():
    """The shapes transformer.bucketed gives the chunks of fresh prompts (512-row chunks from
    context 0, the last one shorter), for every last-chunk length: two a chunk position at
    most (a 512-row chunk's own and one of 256 rows), where unpadded every length had its own;
    and a chunk continuing a cache at any context stays within the buckets."""
    def shapes(start, tokens, causal=True):
        q = mx.zeros((1, 2, tokens, 8), dtype=mx.float16)
        keys = mx.zeros((1, 1, start + tokens, 8), dtype=mx.float16)
        padded_q, padded_keys, *_ = transformer.bucketed(q, keys, keys, mx.arange(start + tokens), causal, 256, 128)
        return padded_q.shape[2], padded_keys.shape[2]

    for start in (0, 512, 3072):
        met = {shapes(start, tokens) for tokens in range(9, 513)}
        assert met <= {(512, start + 512), (256, start + 256)}, (start, met)
    for start, tokens in ((1, 9), (777, 300), (1000, 512), (4095, 511)):
        rows, count = shapes(start, tokens)
        assert count % 256 == 0 and count - (start + tokens) < 256 and rows % 128 == 0 and rows <= count


def test_attention_mask_forms_and_reuse(rng):
    """cache.attention_mask against numpy, in both forms, on keys in ring order; asked again
    with the same positions array, start and tokens it returns its mask, and never for another
    array of the same values or another start."""
    positions = mx.array(rng.permutation(40).astype(np.int32) - 3)  # a ring's order; some never visible
    start, tokens, window = 30, 10, 8
    query = np.arange(start, start + tokens)[:, None]
    key = np.array(positions)[None, :]
    expected = (key <= query) & (key > query - window)
    visible = cache_module.attention_mask(start, tokens, positions, window)
    np.testing.assert_array_equal(np.array(visible), expected)
    additive = cache_module.attention_mask(start, tokens, positions, window, additive=mx.float16)
    assert additive.dtype == mx.float16
    np.testing.assert_array_equal(np.array(additive.astype(mx.float32)), np.where(expected, 0.0, -np.inf))
    assert cache_module.attention_mask(start, tokens, positions, window, additive=mx.float16) is additive
    assert cache_module.attention_mask(start, tokens, positions, window) is visible  # each form its own
    copy = mx.array(np.array(positions))
    assert cache_module.attention_mask(start, tokens, copy, window, additive=mx.float16) is not additive
    later = cache_module.attention_mask(start + 1, tokens, positions, window)
    np.testing.assert_array_equal(np.array(later), (key <= query + 1) & (key > query + 1 - window))
    full = cache_module.attention_mask(start, tokens, positions, None)
    np.testing.assert_array_equal(np.array(full), key <= query)


def test_sliding_window_caches_hold_at_most_the_window(tiny, rng):
    _, model = tiny("muse-glimmer", "Q8_0")
    cache = model.make_cache()
    tokens = 6 * WINDOW + 1
    model(random_ids(rng, model, 3 * WINDOW)[None], cache)
    for t in range(3 * WINDOW, tokens):
        model(random_ids(rng, model, 1)[None], cache)
    for sliding, layer_cache in zip(model.config.swa_layers, cache):
        assert layer_cache.size == (WINDOW if sliding else tokens)
        assert layer_cache.offset == tokens


@pytest.mark.parametrize("steps", [WINDOW // 2, 3 * WINDOW + 1])  # windows not yet full; wrapped
@pytest.mark.parametrize("then", [1, 3])  # go on with one token, or with a chunk
@pytest.mark.parametrize("step", [None, 3])  # 3: window caches still growing when trimmed
def test_a_trimmed_last_position_is_forgotten(tiny, rng, monkeypatch, backend, steps, then, step):
    # What a pipelined generation does when it stops: the step it fed ahead is trimmed away.
    if step:
        monkeypatch.setattr(cache_module, "STEP", step)
    _, model = tiny("muse-glimmer", "F32")
    ids = random_ids(rng, model, steps + then)
    cache = model.make_cache()
    model(ids[None, :2], cache)
    for t in range(2, steps):
        model(ids[None, t : t + 1], cache)
    mx.eval(model(random_ids(rng, model, 1)[None], cache))  # fed ahead, then trimmed
    for layer_cache in cache:
        layer_cache.trim(1)
    got = np.array(model(ids[None, steps:], cache))
    fresh = model.make_cache()
    model(ids[None, :steps], fresh)
    expected = np.array(model(ids[None, steps:], fresh))
    assert relative_error(got, expected) <= TOLERANCE[backend]


@pytest.mark.parametrize("back", [2, WINDOW - 1])
@pytest.mark.parametrize("step", [None, 3])  # 3: window caches still growing
def test_a_window_cache_steps_back_any_number_of_positions_until_it_wraps(tiny, rng, monkeypatch, backend,
                                                                          back, step):
    # A prompt cache continued from a shared prefix (generate.continue_cache): the general path.
    if step:
        monkeypatch.setattr(cache_module, "STEP", step)
    _, model = tiny("muse-glimmer", "F32")
    ids = random_ids(rng, model, WINDOW + 5)
    kept = WINDOW - back
    cache = model.make_cache()
    other = np.concatenate([ids[:kept], random_ids(rng, model, back)])  # the ring full, not wrapped
    mx.eval(model(other[None], cache))
    assert cache_module.step_back(cache, kept)
    assert all(c.offset == kept for c in cache)
    got = np.array(model(ids[None, kept:], cache))  # past the window: the ring wraps in this chunk
    fresh = model.make_cache()
    mx.eval(model(ids[None, :kept], fresh))
    expected = np.array(model(ids[None, kept:], fresh))
    assert relative_error(got, expected) <= TOLERANCE[backend]


def test_a_wrapped_window_cache_refuses_to_step_back_more_than_once(tiny, rng):
    _, model = tiny("muse-glimmer", "F32")
    cache = model.make_cache()
    mx.eval(model(random_ids(rng, model, WINDOW + 3)[None], cache))
    window = next(c for c in cache if isinstance(c, cache_module.SlidingWindowCache))
    assert window.can_trim(1) and not window.can_trim(2)
    assert not cache_module.step_back(cache, WINDOW)
    assert all(c.offset == WINDOW + 3 for c in cache)  # nothing changed
    with pytest.raises(ValueError, match=r"window 8 that has held 11 positions cannot trim 2 of its 11"):
        window.trim(2)
    assert cache_module.step_back(cache, WINDOW + 2)
    assert not window.can_trim(1)  # its slot is stale until the next token
    with pytest.raises(ValueError, match="only its last position, once"):
        window.trim(1)


@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3"])
def test_fused_decode_follows_a_window_cache_stepped_back(tiny, rng, architecture):
    # The server's prompt cache on a GPU: positions taken back in a window that has not wrapped,
    # then fused steps from there.
    file, model = tiny(architecture, "Q4_K_M")
    ids = random_ids(rng, model, 2 * WINDOW)
    cache = model.make_cache(mx.float16)
    mx.eval(model(ids[None, :3], cache))
    decode_one_by_one(model, random_ids(rng, model, WINDOW - 3), cache)  # the ring is full
    assert cache_module.step_back(cache, 3)
    logits, _ = decode_one_by_one(model, ids[3:], cache)
    expected = Reference(model.config, file.tensors).forward(ids)[3:]
    assert relative_error(logits, expected) <= FUSED_BOUND


def test_both_forms_of_the_window_pattern_give_the_same_layers(tiny):
    _, listed = tiny("muse-glimmer", pattern="list", layers=8)
    _, periodic = tiny("muse-glimmer", pattern="period", layers=8)
    assert listed.config.swa_layers == periodic.config.swa_layers
    assert listed.config.swa_layers == (True, True, True, False) * 2


# --- scaled RoPE (llama.cpp's rope_freqs and rope.scaling.*) --------------------------------------

def scaled_rope(kind: str, rng) -> dict:
    """tiny_model keywords of a llama whose RoPE is scaled: Llama 3's frequency factors (fresh
    random ones), linear or YaRN scaling of its frequencies."""
    if kind == "rope_freqs":
        return dict(extra_tensors={"rope_freqs.weight": rng.uniform(1.0, 8.0, 32)})
    return dict(extra_metadata={"llama.rope.scaling.type": kind, "llama.rope.scaling.factor": 4.0,
                                "llama.rope.scaling.original_context_length": ("u32", 16)})


@pytest.mark.parametrize("kind", ["rope_freqs", "linear", "yarn"])
def test_scaled_rope_logits_match_the_reference_and_differ_from_plain_rope(tiny, rng, backend, kind):
    file, model = tiny("llama", "Q8_0", **scaled_rope(kind, rng))
    assert model.config.rope_freqs is not None
    ids = random_ids(rng, model, 3 * WINDOW)
    logits = np.array(model(ids[None]))[0]
    expected = Reference(model.config, file.tensors).forward(ids)
    assert relative_error(logits, expected) <= TOLERANCE[backend]
    plain = dataclasses.replace(model.config, rope_freqs=None, attention_scale=model.config.head_dim**-0.5)
    assert relative_error(logits, Reference(plain, file.tensors).forward(ids)) > 10 * TOLERANCE["gpu"]


@pytest.mark.parametrize("kind", ["rope_freqs", "yarn"])
def test_fused_decode_steps_follow_scaled_rope(tiny, rng, kind):
    file, model = tiny("llama", "Q4_K_M", **scaled_rope(kind, rng))
    ids = random_ids(rng, model, 3 * WINDOW + 2)
    logits, greedy = decode_one_by_one(model, ids, model.make_cache(mx.float16))
    assert relative_error(logits, Reference(model.config, file.tensors).forward(ids)) <= FUSED_BOUND
    rounded = Reference(model.config, file.tensors, decode_numerics=True).forward(ids)
    assert relative_error(logits, rounded) <= FUSED_NUMERICS_BOUND
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))


def test_yarn_frequencies_are_llama_cpps_ramp(tiny, rng):
    """YaRN as llama.cpp computes it (ggml_rope_yarn_corr_dims, rope_yarn_ramp) for a 64-dim
    head, base 10000, original context 16, factor 4: pair 0 keeps base^(-2i/64) (the ramp's low
    end is 0, the floor of a negative), pairs from 4 on are divided by 4 (its high end: the ceil
    of 64 ln(16 / 2π) / (2 ln 10000) = 3.25), pairs 1 .. 3 between, falling; YaRN's mscale
    1 + 0.1 ln 4 scales both q and k."""
    _, model = tiny("llama", "Q8_0", **scaled_rope("yarn", rng))
    plain = 10000.0 ** (-np.arange(32) / 32)
    ratio = np.array(model.config.rope_freqs) / plain
    high = np.ceil(64 * np.log(16 / (2 * np.pi)) / (2 * np.log(10000.0)))
    np.testing.assert_allclose(ratio[:1], 1.0)
    assert high == 4
    np.testing.assert_allclose(ratio[int(high) :], 0.25)
    assert np.all(ratio[1 : int(high)] < 1) and np.all(ratio[1 : int(high)] > 0.25)
    assert np.all(np.diff(ratio) <= 0)
    np.testing.assert_allclose(model.config.attention_scale, 64**-0.5 * (1 + 0.1 * np.log(4.0)) ** 2)


@pytest.mark.parametrize("bad, message", [
    (dict(extra_metadata={"llama.rope.scaling.type": "dynamic"}), r"llama\.rope\.scaling\.type.*'dynamic'"),
    (dict(extra_tensors={"rope_freqs.weight": np.ones(31)}), r"rope_freqs\.weight.*\[31\].*\[32\]"),
    (dict(extra_tensors={"rope_freqs.weight": -np.ones(32)}), r"rope_freqs\.weight.*positive"),
])
def test_rope_scaling_we_cannot_apply_is_refused_by_name(tmp_path, rng, bad, message):
    path = tiny_model(tmp_path / "m.gguf", "llama", rng, **bad)
    with pytest.raises(ModelConfigError, match=message):
        load(path)


@pytest.mark.parametrize("original, chosen", [(128, "long"), (512, "short")])
def test_phi3_takes_the_long_factors_past_its_original_context(tmp_path, rng, original, chosen):
    """As llama.cpp does for a context of the model's size (512 here): long factors when it
    exceeds rope.scaling.original_context_length, else short."""
    factors = {"long": rng.uniform(2.0, 6.0, 32), "short": rng.uniform(1.0, 1.5, 32)}
    path = tiny_model(tmp_path / "m.gguf", "phi3", rng, extra_metadata={
        "phi3.rope.scaling.type": "longrope", "phi3.rope.scaling.original_context_length": ("u32", original)},
        extra_tensors={f"rope_factors_{kind}.weight": values for kind, values in factors.items()})
    config = load(path)
    plain = 10000.0 ** (-np.arange(32) / 32)
    np.testing.assert_allclose(plain / np.array(config.rope_freqs), factors[chosen].astype(np.float32), rtol=1e-6)


def test_a_fused_projection_of_the_wrong_size_is_refused_by_name(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "phi3", rng, ff=384, extra_metadata={"phi3.feed_forward_length": ("u32", 512)})
    with pytest.raises(TensorShapeError, match=r"blk\.0\.ffn_up\.weight.*1024 rows"):
        load(path)


# --- refusals at load -------------------------------------------------------------------------

def load(path):
    file = gguf.read(path)
    return config_for(file.metadata, file.tensors)


def test_an_olmo2_file_with_a_sliding_window_is_refused_by_name(tmp_path, rng):
    # OLMo 3 writes general.architecture olmo2 with sliding-window layers, which we do not run.
    path = tiny_model(tmp_path / "m.gguf", "olmo2", rng, extra_metadata={"olmo2.attention.sliding_window": ("u32", 64)})
    with gguf.read(path) as file, pytest.raises(ModelConfigError, match="olmo2.attention.sliding_window"):
        config_for(file.metadata, file.tensors)


# Values a file may hold but no model can run: a RoPE base <= 0 makes NaN or infinite
# frequencies, a zero scale or softcap divides by zero; each is refused by its key's name.
@pytest.mark.parametrize("architecture, key, value", [
    ("muse-glimmer", "rope.freq_base", -10000.0), ("muse-glimmer", "rope.freq_base_swa", 0.0),
    ("muse-glimmer", "logit_scale", 0.0), ("muse-glimmer", "final_logit_softcapping", -30.0),
    ("llama", "rope.freq_base", 0.0), ("llama", "attention.layer_norm_rms_epsilon", -1e-5),
    ("llama", "rope.scaling.factor", -2.0), ("llama", "rope.scaling.attn_factor", 0.0),
    ("qwen3", "rope.freq_base", -1.0), ("gemma2", "attn_logit_softcapping", 0.0),
    ("granite", "residual_scale", 0.0), ("granite", "logit_scale", 0.0)])
def test_a_value_out_of_range_is_refused_by_name(tmp_path, rng, architecture, key, value):
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, extra_metadata={f"{architecture}.{key}": value})
    with gguf.read(path) as file, pytest.raises(ModelConfigError, match=f"{architecture}.{key}".replace(".", r"\.")):
        config_for(file.metadata, file.tensors)


@pytest.mark.parametrize("metadata, named", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.freq_base": 1.0}, "llama.rope.freq_base"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1e-44}, "llama.rope.scaling"),
    ({"llama.rope.scaling.attn_factor": 1e30}, "llama.rope.scaling"),
    ({"granite.residual_scale": 1e-30}, "granite.residual_scale")])
def test_values_that_overflow_the_graphs_numbers_are_refused_by_name(tmp_path, rng, metadata, named):
    # Each value alone is a positive finite number; what the graph computes from it is not
    # (YaRN's ramp divides by ln(base); a denormal factor's inverse; mscale squared; eps / s²).
    architecture = named.split(".")[0]
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, extra_metadata=metadata)
    with gguf.read(path) as file, pytest.raises(ModelConfigError, match=named.replace(".", r"\.")):
        config_for(file.metadata, file.tensors)


@pytest.mark.parametrize("key", ["muse-glimmer.attention.sliding_window_pattern",
                                 "muse-glimmer.logit_scale",
                                 "muse-glimmer.attention.layer_norm_rms_epsilon",
                                 "muse-glimmer.attention.sliding_window"])
def test_a_missing_required_key_is_refused_by_name(tmp_path, rng, key):
    path = tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, drop=(key,))
    with pytest.raises(MissingKeyError, match=key.replace(".", r"\.")):
        load(path)


@pytest.mark.parametrize("tensor", ["output.weight", "blk.2.attn_gate.weight", "blk.0.attn_q_norm.weight"])
def test_a_missing_tensor_is_refused_by_name(tmp_path, rng, tensor):
    path = tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, drop=(tensor,))
    with pytest.raises(MissingTensorError, match=tensor.replace(".", r"\.")):
        load(path)


def test_head_counts_that_contradict_the_projections_are_refused(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "llama", rng,
                      extra_metadata={"llama.attention.head_count": ("u32", 8)})
    with pytest.raises(TensorShapeError, match=r"blk\.0\.attn_q\.weight"):
        load(path)


def test_a_window_pattern_of_the_wrong_length_is_refused(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, extra_metadata={
        "muse-glimmer.attention.sliding_window_pattern": [True, False, True]})
    with pytest.raises(ModelConfigError, match="one bool per layer"):
        load(path)


def test_an_unknown_architecture_is_refused(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "llama", rng,
                      extra_metadata={"general.architecture": "mamba9"})
    with pytest.raises(ModelConfigError, match="mamba9"):
        load(path)


def test_positions_past_the_context_are_refused(tiny, rng):
    _, model = tiny("llama", context=32)
    cache = model.make_cache()
    model(random_ids(rng, model, 30)[None], cache)
    with pytest.raises(ValueError, match="context of 32"):
        model(random_ids(rng, model, 3)[None], cache)


def test_token_ids_outside_the_vocabulary_are_refused(tiny):
    _, model = tiny("qwen2")
    with pytest.raises(ValueError, match=f"vocabulary \\(size {model.config.vocab}"):
        model(np.array([[1, model.config.vocab]]))


@pytest.mark.parametrize("layers, message", [(2**40, r"no tensor 'blk\.1099511627775\.attn_norm\.weight'"),
                                             (2, r"tensor 'blk\.2\.attn_norm\.weight' for a layer beyond")])
def test_a_block_count_that_contradicts_the_tensors_is_refused_at_once(tmp_path, rng, layers, message):
    path = tiny_model(tmp_path / "m.gguf", "llama", rng, layers=4,
                      extra_metadata={"llama.block_count": ("u64", layers)})
    with pytest.raises(ModelConfigError, match=message):
        load(path)


# --- the fused decode step (Transformer.decode_step) --------------------------------------------
# Every product reads its input as q8x and keys and values are stored as float16 (ops.Q8X,
# reference.Reference(decode_numerics=True)). A q8x value is off by at most half a code step,
# max|x| / 254 of its block: ~0.5 % of a vector's norm for Gaussian-like activations, and each
# product passes that on. Through four layers of these tiny random models the logits move by
# 0.5-2.5 % (measured over the four architectures); FUSED_BOUND doubles the worst seen. Against
# the reference that rounds the same way, what is left is float32's drift moving a few codes
# across a rounding boundary (a code is 1/127 of a block's range, and these rows are short).
FUSED_BOUND = 5e-2
FUSED_NUMERICS_BOUND = 2.5e-2


def decode_one_by_one(model, ids, cache):
    logits, greedy = [], []
    for token in ids:
        step_logits, step_greedy = model.decode_step(mx.array([[int(token)]], dtype=mx.int32), cache)
        logits.append(step_logits[0, 0])
        greedy.append(step_greedy[0])
    return np.array(mx.stack(logits)), np.array(mx.stack(greedy))


@pytest.mark.parametrize("weights", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_decode_steps_match_the_reference(tiny, rng, architecture, weights):
    file, model = tiny(architecture, weights)
    assert model.decodes_fused()
    ids = random_ids(rng, model, 3 * WINDOW + 2)
    logits, greedy = decode_one_by_one(model, ids, model.make_cache(mx.float16))
    exact = Reference(model.config, file.tensors).forward(ids)
    rounded = Reference(model.config, file.tensors, decode_numerics=True).forward(ids)
    assert relative_error(logits, exact) <= FUSED_BOUND
    assert relative_error(logits, rounded) <= FUSED_NUMERICS_BOUND
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_greedy_decoding_stays_within_the_bound_for_32_steps(tiny, rng, architecture):
    # The reference is fed the fused path's own tokens, so one near-tie (two logits closer than
    # the bound; common in these tiny random models) does not derail the comparison of the rest.
    file, model = tiny(architecture, "Q4_K_M")
    reference = Reference(model.config, file.tensors)
    tokens = list(random_ids(rng, model, 5))
    cache = model.make_cache(mx.float16)
    logits, greedy = decode_one_by_one(model, tokens, cache)
    for _ in range(32):
        tokens.append(int(greedy[-1]))
        expected = reference.forward(np.array(tokens[:-1]))[-1]
        assert relative_error(logits[-1], expected) <= FUSED_BOUND
        logits, greedy = decode_one_by_one(model, tokens[-1:], cache)


@pytest.mark.parametrize("step", [None, 3])  # 3: window caches grow (3, 6, then 8 slots) before they wrap
@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3", "gemma2"])
def test_fused_sliding_window_layers_see_exactly_window_keys(tiny, rng, monkeypatch, architecture, step):
    if step:
        monkeypatch.setattr(cache_module, "STEP", step)
    file, model = tiny(architecture, "Q8_0")
    ids = random_ids(rng, model, 5 * WINDOW)
    cache = model.make_cache(mx.float16)
    first = decode_one_by_one(model, ids[:2], cache)[0]
    if step:  # every cache holds 3 slots, then the window caches stop at the window
        assert [layer_cache.keys.shape[2] for layer_cache in cache] == [step] * len(cache)
    decoded = np.concatenate([first, decode_one_by_one(model, ids[2:], cache)[0]])[WINDOW:]
    if step:
        grown = -(-ids.size // step) * step
        assert [layer_cache.keys.shape[2] for layer_cache in cache] == [
            WINDOW if sliding else grown for sliding in model.config.swa_layers]

    def reference(window):
        config = dataclasses.replace(model.config, sliding_window=window)
        return Reference(config, file.tensors, decode_numerics=True).forward(ids)[WINDOW:]

    right = relative_error(decoded, reference(WINDOW))
    assert right <= FUSED_NUMERICS_BOUND
    assert relative_error(decoded, reference(WINDOW + 1)) > 4 * right
    assert relative_error(decoded, reference(WINDOW - 1)) > 4 * right


@pytest.mark.parametrize("architecture", ["muse-glimmer", "qwen2"])
def test_fused_decode_follows_a_prefill_chunk_and_a_trimmed_step(tiny, rng, architecture):
    # generate()'s order: a chunk through the general path, then fused steps; the step fed ahead
    # of a stop is trimmed and the next token takes its position.
    file, model = tiny(architecture, "Q4_K_M")
    ids = random_ids(rng, model, 3 * WINDOW)
    cache = model.make_cache(mx.float16)
    chunk = 2 * WINDOW + 3
    mx.eval(model(ids[None, :chunk], cache))
    decode_one_by_one(model, random_ids(rng, model, 1), cache)  # fed ahead, then trimmed
    for layer_cache in cache:
        layer_cache.trim(1)
    logits, _ = decode_one_by_one(model, ids[chunk:], cache)
    expected = Reference(model.config, file.tensors).forward(ids)[chunk:]
    assert relative_error(logits, expected) <= FUSED_BOUND


def test_decode_steps_take_the_position_the_last_step_computed(tiny, rng, monkeypatch):
    # Only the first step's position comes from the host; the trimmed-cache case is the test above.
    from muser_mlx import kernels

    file, model = tiny("muse-glimmer", "Q4_K_M")
    made, real = [], kernels.padded_array
    monkeypatch.setattr(kernels, "padded_array", lambda values, dtype: (
        made.append(list(values)) if dtype == mx.int32 else None) or real(values, dtype))
    ids = random_ids(rng, model, WINDOW + 3)
    logits, _ = decode_one_by_one(model, ids, model.make_cache(mx.float16))
    assert made == [[0]]
    assert relative_error(logits, Reference(model.config, file.tensors).forward(ids)) <= FUSED_BOUND


def test_decode_step_refuses_a_float32_cache(tiny):
    _, model = tiny("llama", "Q8_0")
    with pytest.raises(ValueError, match="float16"):
        model.decode_step(mx.array([[1]], dtype=mx.int32), model.make_cache(mx.float32))


def test_every_step_caps_gemma2s_attention_scores(tiny, rng):
    """Gemma 2 with a cap that bites (0.25: the reference without it is 7-8 % off, as far as
    these tiny models' final softcap lets it): the general step, the fused decode step and the
    CPU decode step all softcap the scores."""
    from muser_mlx.models.cpu_decode import CPUDecodeStep
    from tests.test_cpu_decode import STEP_BOUND, run_steps

    file, model = tiny("gemma2", "Q8_0", extra_metadata={"gemma2.attn_logit_softcapping": 0.25})
    assert model.config.attn_softcap == 0.25 and model.decodes_fused()
    ids = random_ids(rng, model, 2 * WINDOW)
    uncapped_config = dataclasses.replace(model.config, attn_softcap=None)
    capped = Reference(model.config, file.tensors).forward(ids)
    assert relative_error(Reference(uncapped_config, file.tensors).forward(ids), capped) > 2e-2
    general = np.array(model(ids[None]))[0]
    assert relative_error(general, capped) <= TOLERANCE["cpu" if mx.default_device() == mx.cpu else "gpu"]
    fused, _ = decode_one_by_one(model, ids, model.make_cache(mx.float16))
    rounded = relative_error(fused, Reference(model.config, file.tensors, decode_numerics=True).forward(ids))
    assert rounded <= FUSED_NUMERICS_BOUND
    assert relative_error(fused, Reference(uncapped_config, file.tensors, decode_numerics=True).forward(ids)) > 2 * rounded
    with mx.stream(mx.cpu):
        stepped = run_steps(CPUDecodeStep(model, rounded=False), ids, model.make_cache())
    assert relative_error(stepped, capped) <= STEP_BOUND


def test_every_step_norms_olmo2s_whole_q_and_k_projections(tiny, rng):
    """OLMo 2: q and k RMS-normed each over its whole projection (weights [heads * head_dim],
    [kv_heads * head_dim]) and no norm before a branch (tests/test_llama_cpp_logits.py holds the
    form to llama.cpp's). The reference without the q/k norm is far off; the general step, the
    fused decode step and the CPU decode step all follow the one with it."""
    from muser_mlx.models.cpu_decode import CPUDecodeStep
    from tests.test_cpu_decode import STEP_BOUND, run_steps

    file, model = tiny("olmo2", "Q8_0")
    c = model.config
    assert c.qk_norm_whole and not c.pre_norms and model.layers[0].attn_norm is None and model.decodes_fused()
    ids = random_ids(rng, model, 2 * WINDOW)
    right = Reference(c, file.tensors).forward(ids)
    unnormed = Reference(dataclasses.replace(c, qk_norm=False, qk_norm_whole=False), file.tensors).forward(ids)
    # Without the norm the logits move by 0.47-0.58 (40 seeds; median 0.52): far past every
    # bound below (the largest, FUSED_BOUND, is 0.05).
    assert relative_error(unnormed, right) > 4 * FUSED_BOUND
    general = np.array(model(ids[None]))[0]
    assert relative_error(general, right) <= TOLERANCE["cpu" if mx.default_device() == mx.cpu else "gpu"]
    fused, _ = decode_one_by_one(model, ids, model.make_cache(mx.float16))
    assert relative_error(fused, Reference(c, file.tensors, decode_numerics=True).forward(ids)) <= FUSED_NUMERICS_BOUND
    with mx.stream(mx.cpu):
        stepped = run_steps(CPUDecodeStep(model, rounded=False), ids, model.make_cache())
    assert relative_error(stepped, right) <= STEP_BOUND


def test_models_without_q8x_kernels_for_their_formats_do_not_decode_fused(tiny):
    _, model = tiny("llama", "F16")
    assert not model.decodes_fused() and not model.fused
