"""BatchGenerator, batch_generate and the batched decode step (models/batch_decode.py) against
each sequence generated alone, on tiny random models (every backend the suite runs on)."""

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import kernels, ops
from muser_mlx.batch import BatchGenerator, batch_generate
from muser_mlx.generate import continue_cache, stream_generate
from muser_mlx.models.batch_decode import BatchKV, BatchStep
from muser_mlx.tokenizer import GGUFTokenizer
from tests.conftest import random_ids, relative_error, tiny_models

WINDOW = 8  # the tiny models' sliding window: 32 steps wrap it several times

# Each step's logits beside the same sequence's alone (fed the same tokens): the batched step
# sums in another order, and where that moves an int8 code of a rounded input (the CPU step's
# and the GPU's q8x x; tiny random weights have many ties) a step moved by up to 1.1e-3 on the
# CPU (measured, 4 sequences x 32 steps x 6 architectures); float16 attention on a GPU.
STEP_BOUND = {"cpu": 5e-3, "gpu": 2e-2}

ARCHITECTURES = [("llama", "Q8_0"), ("muse-glimmer", "Q4_K_M"), ("gemma3", "Q8_0"), ("qwen2", "Q8_0"),
                 ("gemma2", "F32"), ("phi3", "Q8_0"), ("qwen3", "Q4_K_M"), ("olmo2", "Q8_0"),
                 ("granite", "Q8_0"), ("smollm3", "Q8_0")]


@pytest.fixture
def tiny(tmp_path, rng):
    return tiny_models(tmp_path, rng, WINDOW, "Q8_0")


def load_tiny(tiny, architecture, weights):
    file, model = tiny(architecture, weights)
    return model, GGUFTokenizer(file.metadata)


def alone(model, tokenizer, prompt, steps, **options):
    return [(r.token, np.array(r.logprobs)) for r in stream_generate(model, tokenizer, prompt, steps, **options)]


def run(generator, uids):
    got = {uid: [] for uid in uids}
    while generator.has_work:
        for response in generator.next():
            got[response.uid].append(response)
    return got


def assert_follows(batched, solo, bound):
    """The batched sequence's tokens are its tokens alone, each step's logprobs within `bound`,
    up to a step where the two picks differ: allowed only at a near-tie the step's own
    difference explains (alone's best minus the batched pick <= 2 max|diff|), after which the
    sequences go their own ways. Returns the steps compared."""
    for step, (response, (token, logprobs)) in enumerate(zip(batched, solo)):
        ours = np.array(response.logprobs)
        assert relative_error(ours, logprobs) <= bound, f"step {step}"
        if response.token != token:
            assert logprobs[token] - logprobs[response.token] <= 2 * np.abs(ours - logprobs).max(), f"step {step}"
            return step
    assert len(batched) == len(solo)
    return len(solo)


def backend_name():
    return "cpu" if kernels.backend() == "cpu" else "gpu"


@pytest.mark.parametrize("architecture, weights", ARCHITECTURES, ids=[a for a, _ in ARCHITECTURES])
def test_every_sequence_of_a_batch_is_its_greedy_self_alone(tiny, rng, architecture, weights):
    model, tokenizer = load_tiny(tiny, architecture, weights)
    prompts = [random_ids(rng, model, n).tolist() for n in (5, 12, 3, 20)]
    solos = [alone(model, tokenizer, p, 32, temperature=0) for p in prompts]
    generator = BatchGenerator(model, tokenizer, max_batch=4)
    uids = [generator.insert(p, 32, temperature=0) for p in prompts]
    got = run(generator, uids)
    compared = [assert_follows(got[uid], solo, STEP_BOUND[backend_name()]) for uid, solo in zip(uids, solos)]
    assert sum(compared) >= 32, compared  # not every sequence at a near-tie at once


@pytest.mark.parametrize("tiles", [False, True], ids=["grouped", "tiles"])
def test_the_gpu_form_of_the_batched_step_on_this_backend(tiny, rng, tiles):
    """BatchStep's q8x form (int8 x, grouped or tile products, a float16 store; the GPU's) against the
    same sequences' fused one-token steps (int8 x, float16 caches) and general steps (float x),
    fed the same tokens: on the CPU the products' CPU renderings run it, so its padding to
    groups of 8 rows and its layer wiring are checked here too.

    Bounds: a step of the batched and the fused forms sums in another order, and where that
    moves an int8 code across a rounding boundary (~6 % of these tiny models' row-steps) the
    logits move by up to ~1.6 %, and the cache carries it on. So: a store rebuilt from the
    fused caches each step is as the fused step in most row-steps (median <= 1e-4; 5e-7
    measured) and within FUSED_NUMERICS_BOUND in all; the store that runs on through the
    window holds FUSED_BOUND against both forms (int8 x alone moved logits by up to 3.3 %).
    On a GPU the two forms' attention differs too (the batched step's is MLX's fused attention in
    float16 over the store, the fused step's kernel attention_decode works in float32), and the
    o-projection's int8 input carries that difference across rounding boundaries in most
    row-steps (median 1.9 %, each within 2.5 %, on an H200, seed 3557382145), as int8 x's own rounding
    does: there a store rebuilt from the fused caches holds FUSED_BOUND, and the median is the
    CPU's claim."""
    from tests.test_models import FUSED_BOUND, FUSED_NUMERICS_BOUND

    model, tokenizer = load_tiny(tiny, "muse-glimmer", "Q4_K_M")
    if not model.decodes_fused():
        pytest.skip("no fused kernels for this model")
    step = BatchStep(model, q8x=True, tiles=tiles)
    lengths = [3, 11, 6]
    prompts = [random_ids(rng, model, n) for n in lengths]
    caches = [model.make_cache() for _ in prompts]
    fused_caches = [model.make_cache(mx.float16) for _ in prompts]
    for ids, cache, fused_cache in zip(prompts, caches, fused_caches):
        mx.eval(model.hidden(ids[None], cache), model.hidden(ids[None], fused_cache))
    kv = BatchKV(model, mx.float16)
    for cache in fused_caches:
        kv.add(cache)
    same_start = []
    for _ in range(12):  # past the window of 8
        tokens = random_ids(rng, model, len(prompts))
        rebuilt = BatchKV(model, mx.float16)
        for cache in fused_caches:
            rebuilt.add(cache)
        with kernels.poisoned_outputs():
            batched = np.array(step(mx.array(tokens, dtype=mx.int32), kv))
            from_same = np.array(step(mx.array(tokens, dtype=mx.int32), rebuilt))
        for b, (cache, fused_cache) in enumerate(zip(caches, fused_caches)):
            token = mx.array(tokens[b : b + 1][None], dtype=mx.int32)
            general = np.array(model(token, cache)[0, -1])
            fused = np.array(model.decode_step(token, fused_cache)[0][0, -1])
            same_start.append(relative_error(from_same[b], fused))
            assert same_start[-1] <= (FUSED_NUMERICS_BOUND if kernels.backend() == "cpu" else FUSED_BOUND)
            assert relative_error(batched[b], fused) <= FUSED_BOUND
            assert relative_error(batched[b], general) <= FUSED_BOUND
    if kernels.backend() == "cpu":
        assert np.median(same_start) <= 1e-4, same_start
    assert kv.lengths == [n + 12 for n in lengths]


def test_sequences_join_leave_and_keep_their_own_settings(tiny, rng):
    """max_batch 2 of 5 sequences: the others wait and join as places free; each has its own
    max_tokens, stop string and sampling; a removed one frees its place; the first token of a
    sampled sequence (from its own prefill) equals its first alone."""
    model, tokenizer = load_tiny(tiny, "llama", "Q8_0")
    prompts = [random_ids(rng, model, n).tolist() for n in (4, 9, 2, 7, 5)]
    generator = BatchGenerator(model, tokenizer, max_batch=2)
    limits = [5, 9, 3, 7, 6]
    uids = [generator.insert(p, m, temperature=0) for p, m in zip(prompts[:4], limits)]
    sampled = generator.insert(prompts[4], 6, temperature=0.9, top_p=0.9, seed=7)
    seen_running = 0
    got = {uid: [] for uid in uids + [sampled]}
    removed = None
    while generator.has_work:
        for response in generator.next():
            got[response.uid].append(response)
        seen_running = max(seen_running, generator.running)
        if removed is None and len(got[uids[1]]) == 2:
            removed = uids[1]
            generator.remove(removed)
    assert seen_running == 2
    assert len(got[removed]) == 2 and got[removed][-1].finish_reason is None
    for uid, limit, prompt in zip(uids, limits, prompts):
        if uid == removed:
            continue
        assert len(got[uid]) <= limit and got[uid][-1].finish_reason in ("stop", "length")
        assert [r.generation_tokens for r in got[uid]] == list(range(1, len(got[uid]) + 1))
        assert all(r.prompt_tokens == len(prompt) and r.cached_tokens == 0 for r in got[uid])
    solo = [r.token for r in stream_generate(model, tokenizer, prompts[4], 6, temperature=0.9, top_p=0.9, seed=7)]
    assert got[sampled][0].token == solo[0]
    again = BatchGenerator(model, tokenizer, max_batch=2)
    repeat = [again.insert(prompts[0], 5, temperature=0), again.insert(prompts[4], 6, temperature=0.9, top_p=0.9, seed=7)]
    assert [r.token for r in run(again, repeat)[repeat[1]]] == [r.token for r in got[sampled]]


def test_stop_strings_and_text_match_generation_alone(tiny, rng):
    model, tokenizer = load_tiny(tiny, "llama", "F32")
    prompts = [random_ids(rng, model, n).tolist() for n in (6, 3)]
    # The streamed text leaves special tokens out (as mlx-lm's does): decode the same way.
    texts = [tokenizer.decode([r.token for r in stream_generate(model, tokenizer, p, 16, temperature=0)],
                              skip_special_tokens=True)
             for p in prompts]
    stop = texts[0][len(texts[0]) // 2 : len(texts[0]) // 2 + 2] or None
    expected = [texts[0][: texts[0].find(stop)] if stop else texts[0], texts[1]]
    generator = BatchGenerator(model, tokenizer)
    uids = [generator.insert(prompts[0], 16, temperature=0, stop=stop), generator.insert(prompts[1], 16, temperature=0)]
    got = run(generator, uids)
    alone_texts = ["".join(r.text for r in stream_generate(model, tokenizer, prompts[0], 16, temperature=0, stop=stop)),
                   "".join(r.text for r in stream_generate(model, tokenizer, prompts[1], 16, temperature=0))]
    assert ["".join(r.text for r in got[uid]) for uid in uids] == alone_texts
    assert alone_texts[1] == expected[1]


def test_batch_generate_is_generate_for_each_prompt(tiny, rng):
    model, tokenizer = load_tiny(tiny, "gemma3", "F32")
    prompts = [random_ids(rng, model, n).tolist() for n in (7, 2, 13)]
    texts = batch_generate(model, tokenizer, prompts, max_tokens=[8, 12, 5], temperature=0)
    solo = ["".join(r.text for r in stream_generate(model, tokenizer, p, m, temperature=0))
            for p, m in zip(prompts, [8, 12, 5])]
    assert texts == solo
    with pytest.raises(ValueError, match="max_tokens has 2 values for 3 prompts"):
        batch_generate(model, tokenizer, prompts, max_tokens=[1, 2])


def test_a_finished_sequences_cache_continues_the_conversation(tiny, rng):
    """The last response carries the cache (prompt and generated tokens but the last) that a
    later prompt continues, as stream_generate's own cache would."""
    model, tokenizer = load_tiny(tiny, "muse-glimmer", "F32")
    prompts = [random_ids(rng, model, n).tolist() for n in (5, 9)]
    generator = BatchGenerator(model, tokenizer)
    uids = [generator.insert(p, 10, temperature=0) for p in prompts]
    last = run(generator, uids)[uids[0]][-1]
    assert last.cache is not None and last.cached_ids[: len(prompts[0])] == prompts[0]
    assert last.cache[0].offset == len(last.cached_ids) == len(prompts[0]) + last.generation_tokens - 1
    follow = last.cached_ids + [last.token] + random_ids(rng, model, 3).tolist()
    cache, kept = continue_cache(model, last.cache, last.cached_ids, follow)
    assert kept == min(len(last.cached_ids), WINDOW + 1) or kept == len(last.cached_ids) or kept == 0
    continued = alone(model, tokenizer, follow[kept:], 4, temperature=0, cache=cache, cached_ids=follow[:kept])
    fresh = alone(model, tokenizer, follow, 4, temperature=0)
    assert relative_error(continued[0][1], fresh[0][1]) <= STEP_BOUND[backend_name()]


def test_kept_caches_hold_only_their_own_memory(tiny, rng):
    """A finished sequence's cache is its own copy, not a lazy slice of the batch's store: a
    server keeps such caches for later prompts, and lazy ones held a whole store each (16 kept
    caches counted 100 MB and held 816)."""
    import gc

    model, tokenizer = load_tiny(tiny, "llama", "Q8_0")
    mx.eval(model.parameters())
    generator = BatchGenerator(model, tokenizer, max_batch=8)
    uids = [generator.insert(random_ids(rng, model, n).tolist(), steps, temperature=0)
            for n, steps in zip((5, 12, 3, 20, 7, 9, 4, 15), (3, 9, 5, 12, 4, 7, 6, 10))]
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    got = run(generator, uids)
    caches = [responses[-1].cache for responses in got.values()]
    del generator, got
    gc.collect()
    held = mx.get_active_memory() - before
    counted = sum(layer.nbytes for cache in caches for layer in cache)
    assert counted > 0 and held <= 1.5 * counted, (held, counted)


@pytest.mark.parametrize("architecture, weights", [("llama", "Q8_0"), ("gemma2", "F32")], ids=["one-node-layers", "ops"])
def test_the_batched_step_writes_the_store_in_its_own_memory(tiny, rng, architecture, weights):
    """The store's keys and values stay in their buffers step after step (the writes take them:
    a copy of the whole store a layer a step otherwise), in both CPU forms of the step, with
    each step queued before the last one's tokens are read, as BatchGenerator.next() runs them
    (MLX holds a step's buffers until it has run: without in_place writes every layer whose last
    step had not run when the next was built was copied)."""
    if kernels.backend() != "cpu":
        pytest.skip("buffer addresses read through the host: the CPU forms")
    model, _ = load_tiny(tiny, architecture, weights)
    step = BatchStep(model)
    kv = BatchKV(model, mx.float32)
    for n in (3, 7, 5):
        cache = model.make_cache()
        mx.eval(model.hidden(random_ids(rng, model, n)[None], cache))
        kv.add(cache)

    def addresses():
        return [np.frombuffer(memoryview(a), dtype=np.uint8).__array_interface__["data"][0]
                for a in kv.keys + kv.values]

    tokens = mx.argmax(step(mx.array(random_ids(rng, model, 3), dtype=mx.int32), kv), axis=-1)
    mx.eval(tokens)
    before = addresses()
    for _ in range(4):
        queued = mx.argmax(step(tokens, kv), axis=-1)
        mx.async_eval(queued)
        tokens.tolist()
        tokens = queued
    tokens.tolist()
    assert addresses() == before


def test_an_iteration_reads_at_most_one_chunk_of_prompts(tiny, rng):
    """next() reads waiting prompts up to prefill_step_size tokens in all: four short prompts
    start together in one iteration; a long one goes a chunk an iteration while the running
    sequences get a token each time."""
    model, tokenizer = load_tiny(tiny, "llama", "Q8_0")
    generator = BatchGenerator(model, tokenizer, max_batch=8, prefill_step_size=16)
    short = [generator.insert(random_ids(rng, model, 3).tolist(), 20, temperature=0) for _ in range(4)]
    assert sorted(r.uid for r in generator.next()) == short  # 4 x (2 + 1) prompt tokens <= 16
    long = generator.insert(random_ids(rng, model, 50).tolist(), 4, temperature=0)  # chunks 16, 16, 16, 1, then its last
    for _ in range(3):
        got = generator.next()
        assert sorted(r.uid for r in got) == short  # the running ones each get their token; the long one waits
    got = generator.next()  # its last chunk (1) and its last token (1) fit one budget together
    assert sorted(r.uid for r in got) == sorted(short + [long])


def test_bad_inserts_are_refused_by_name(tiny, rng):
    model, tokenizer = load_tiny(tiny, "llama", "F32")
    generator = BatchGenerator(model, tokenizer)
    prompt = random_ids(rng, model, 4).tolist()
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        generator.insert(prompt, 0)
    with pytest.raises(ValueError, match="context"):
        generator.insert([1] * (model.config.context + 1), 4)
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        generator.insert(prompt, 4, stop=[""])
    with pytest.raises(ValueError, match="outside|vocab"):
        generator.insert([model.config.vocab + 5], 4)
    with pytest.raises(ValueError, match="temperature"):
        generator.insert(prompt, 4, temperature=-1)
    cache = model.make_cache()
    mx.eval(model.hidden(mx.array([prompt[:2]]), cache))
    with pytest.raises(ValueError, match="cached_ids"):
        generator.insert(prompt, 4, cache=cache, cached_ids=[prompt[1], prompt[0]])
    with pytest.raises(ValueError, match="max_batch"):
        BatchGenerator(model, tokenizer, max_batch=0)
    assert not generator.has_work
    with pytest.raises(ValueError, match="one token per row"):
        BatchStep(model)(mx.array([1, 2], dtype=mx.int32), BatchKV(model, mx.float32))


def test_kv_memory_holds_back_a_sequence_that_would_pass_it(tiny, rng):
    model, tokenizer = load_tiny(tiny, "llama", "F32")
    generator = BatchGenerator(model, tokenizer, max_batch=8, kv_memory=1)
    uids = [generator.insert(random_ids(rng, model, 3).tolist(), 4, temperature=0) for _ in range(3)]
    most = 0
    got = {uid: [] for uid in uids}
    while generator.has_work:
        for response in generator.next():
            got[response.uid].append(response)
        most = max(most, generator.running)
    assert most == 1 and all(got[uid][-1].finish_reason is not None for uid in uids)
