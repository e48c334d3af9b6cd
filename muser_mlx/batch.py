"""Many sequences at once: `BatchGenerator` (what the server runs) and `batch_generate` (mlx-lm's
name and shape).

Sequences join and leave at step boundaries. Each `next()` reads at most one prefill chunk's
worth of prompt tokens (prefill_step_size) of the waiting sequences, in order: several short
prompts, or one chunk of a long one (each in its own cache, as generate() does: generate.feed /
decode), and then one decode step for every running sequence: one sequence alone runs generate()'s own step
(the fused GPU step, the compiled CPU step) in its own cache; two or more share one batched
step (models/batch_decode.py), their caches copied into its slotted store when they join it
and out again when they leave. So a running stream waits for at most one chunk of someone
else's prompt between two of its tokens.

Each sequence has its own sampling settings, seed, stop strings and max_tokens; its tokens
are those it would get alone up to the batched step's rounding (tests/test_batch.py: greedy
tokens equal on tiny models).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from muser_mlx.generate import (DEFAULT_PREFILL_STEP, MODEL_LOCK, Sampling, _prompt_ids, decode, feed,
                                prefill_chunks, stop_overlap)
from muser_mlx.models import cpu_decode
from muser_mlx.models.batch_decode import BatchKV, BatchStep
from muser_mlx.ops import check_token_ids
from muser_mlx.tokenizer import StreamingDetokenizer


@dataclass
class BatchResponse:
    """One token of one sequence. cache / cached_ids: set on a finished sequence's last
    response (keep_caches): its cache, holding cached_ids (the prompt and every generated token
    but the last), for a later prompt that continues it (generate.continue_cache)."""
    uid: int
    token: int
    text: str
    logprobs: mx.array
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    cache: list | None = None
    cached_ids: list | None = None


@dataclass
class _Sequence:
    uid: int
    ids: list[int]
    kept: int  # positions its cache held when inserted
    max_tokens: int
    sampler: Sampling
    key: mx.array
    stops: list[str]
    detokenizer: StreamingDetokenizer
    cache: list | None  # its own cache while it is prefilled or runs alone
    chunks: list = field(default_factory=list)  # prefill chunks (start, end) of ids[kept:-1] still to run
    recent: mx.array | None = None  # the repetition penalty's window
    tokens: list = field(default_factory=list)  # generated so far
    emitted: int = 0  # characters of the detokenizer's text already given out
    pending: mx.array | None = None  # the token to feed next (the last one chosen; maybe still on the device)
    logprobs_queue: list = field(default_factory=list)  # logprobs of tokens chosen, not yet given out
    launched: int = 0  # decode steps queued for it
    row: int | None = None  # its row in the batch's store, when it runs batched

    @property
    def end(self) -> int:
        """The most positions its cache can come to hold."""
        return len(self.ids) + self.max_tokens - 1


class BatchGenerator:
    """Runs up to `max_batch` sequences at once (see the module docstring).

    insert(prompt, max_tokens, stop=, seed=, cache=, cached_ids=, **sampling) -> uid: prompt is
    text or ids, the whole prompt: a `cache` given holds its first positions (cached_ids, if
    given, are those ids). remove(uid) drops a sequence (its memory goes at once). next() ->
    list[BatchResponse]: one response per sequence that got a token. kv_memory: bytes of KV
    cache the running sequences may hold together; a sequence that would pass it waits (one
    alone always runs). keep_caches: a finished sequence's response carries its cache."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                 kv_memory: int | None = None, keep_caches: bool = True):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.step_size, self.kv_memory, self.keep_caches = max_batch, prefill_step_size, kv_memory, keep_caches
        self.batch_step = BatchStep(model)
        self._cache_dtype = cpu_decode.generation_cache(model)[0].dtype
        self._kv = BatchKV(model, self._cache_dtype)
        self._waiting: dict[int, _Sequence] = {}
        self._running: dict[int, _Sequence] = {}
        self._rows: list[_Sequence] = []  # the sequences of the store's rows, in order
        self._flight = None  # (members, chosen tokens): the step queued, not yet read
        self._uid = 0

    # --- joining and leaving

    def insert(self, prompt, max_tokens: int = 256, *, stop=None, seed: int | None = None, cache=None,
               cached_ids=None, **sampling) -> int:
        sampler = Sampling(**sampling)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        ids = _prompt_ids(self.tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty (and the tokenizer adds no BOS): nothing to condition on")
        context = self.model.config.context
        if len(ids) > context:
            raise ValueError(f"the prompt is {len(ids)} tokens; the model's context is {context} tokens")
        check_token_ids(ids, self.model.config.vocab)
        kept = 0
        if cache is not None:
            if len(cache) != self.model.config.layers:
                raise ValueError(f"cache has {len(cache)} layers; the model has {self.model.config.layers}")
            kept = cache[0].offset
            if kept >= len(ids):
                raise ValueError(f"the cache holds {kept} positions; the prompt has {len(ids)} ids and its last "
                                 f"must be read by this sequence's own step")
            if cached_ids is not None and list(cached_ids) != ids[:kept]:
                raise ValueError(f"cached_ids ({len(cached_ids)} ids) are not the first {kept} ids of the prompt")
        else:
            cache = cpu_decode.generation_cache(self.model)
        self._uid += 1
        history = ids[-sampler.repetition_context_size :]
        sequence = _Sequence(
            uid=self._uid, ids=ids, kept=kept, max_tokens=min(max_tokens, context - len(ids) + 1), sampler=sampler,
            key=mx.random.key(seed if seed is not None else time.time_ns() % 2**63), stops=stops,
            detokenizer=StreamingDetokenizer(self.tokenizer), cache=cache,
            chunks=prefill_chunks(len(ids) - 1 - kept, self.step_size) if len(ids) - 1 > kept else [],
            recent=mx.array(history, dtype=mx.int32) if sampler.repetition_penalty != 1.0 else None)
        self._waiting[sequence.uid] = sequence
        return sequence.uid

    def remove(self, uid: int) -> None:
        """Forget sequence `uid` (waiting or running; unknown uids are ignored)."""
        self._waiting.pop(uid, None)
        sequence = self._running.get(uid)
        if sequence is not None:
            self._finish(sequence, keep=False)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    def _join_batch(self, sequence: _Sequence) -> None:
        sequence.row = self._kv.add(sequence.cache)
        sequence.cache = None
        self._rows.append(sequence)

    def _leave_batch(self, sequence: _Sequence, keep: bool = False) -> list | None:
        """Take `sequence` out of the store (its cache back, if `keep`)."""
        row = sequence.row
        cache = self._kv.take(row) if keep else None
        self._kv.remove(row)
        last = self._rows.pop()
        if last is not sequence:
            self._rows[row] = last
            last.row = row
        sequence.row = None
        return cache

    def _fits(self, sequence: _Sequence) -> bool:
        """Whether `sequence` may start beside the running ones within kv_memory."""
        if self.kv_memory is None or not self._running:
            return True
        config = self.model.config
        rows = len(self._running) + 1
        end = max([s.end for s in self._running.values()] + [sequence.end])
        per_position = 2 * config.kv_heads * config.head_dim * np.dtype(
            "float16" if self._cache_dtype == mx.float16 else "float32").itemsize
        positions = sum(end if w is None else min(end, w) for w in self._kv.windows)
        return (1 << (rows - 1).bit_length()) * positions * per_position <= self.kv_memory

    # --- steps

    def next(self) -> list[BatchResponse]:
        """Prompt chunks of the waiting sequences, in order, while places are free, up to one
        chunk's worth of tokens in all (prefill_step_size: several short prompts, or one chunk
        of a long one; a running sequence never waits for more), then one token for every
        running sequence.

        Pipelined as generate()'s loop and mlx-lm's BatchGenerator: the step that gives the
        running sequences' next tokens is built and queued, from the tokens still on the device,
        before the tokens of the step queued last time are read; a sequence that those tokens
        end had a step too many, which its cache gives back (`_finish`)."""
        out = []
        with MODEL_LOCK:
            budget = self.step_size  # prompt tokens read this iteration: one chunk's worth
            while self._waiting and len(self._running) < self.max_batch:
                sequence = next(iter(self._waiting.values()))
                size = sequence.chunks[0][1] - sequence.chunks[0][0] if sequence.chunks else 1
                if not self._fits(sequence) or (budget < self.step_size and size > budget):
                    break
                self._prefill_chunk(sequence, out)
                budget -= size
            flight, self._flight = self._flight, None
            unread = set(id(s) for s in flight[0]) if flight else set()
            members = []
            for sequence in self._running.values():
                if len(sequence.tokens) + (id(sequence) in unread) < sequence.max_tokens:
                    members.append(sequence)
                elif sequence.row is not None:  # its last token is on the way: out of the batch now
                    sequence.cache = self._leave_batch(sequence, keep=self.keep_caches)
            if members:
                self._flight = self._launch(members)
            if flight is not None:
                self._read(*flight, out)
        return out

    def _launch(self, members: list) -> tuple:
        """Queue one decode step for `members` (each fed its pending token, which may still be
        on the device). Returns (members, their chosen tokens, lazy)."""
        if len(members) == 1:  # alone: its own cache and generate()'s step
            sequence = members[0]
            if sequence.row is not None:
                sequence.cache = self._leave_batch(sequence, keep=True)
            self._feed_recent(sequence)
            logits, greedy = decode(self.model, sequence.pending.reshape(1, 1), sequence.cache)
            logits = logits[None]
        else:
            for sequence in members:
                if sequence.row is None:
                    self._join_batch(sequence)
                self._feed_recent(sequence)
            members = list(self._rows)
            tokens = mx.concatenate([s.pending.reshape(1) for s in members]).astype(mx.int32)
            logits, greedy = self.batch_step(tokens, self._kv), None
        chosen = self._choose(members, logits, greedy)
        for sequence in members:
            sequence.launched += 1
        mx.async_eval(chosen)
        return members, chosen

    def _feed_recent(self, sequence: _Sequence) -> None:
        """The repetition penalty's window, with the token this step feeds."""
        if sequence.recent is not None:
            size = sequence.sampler.repetition_context_size
            sequence.recent = mx.concatenate([sequence.recent, sequence.pending.reshape(1)])[-size:]

    def _read(self, members: list, chosen: mx.array, out: list) -> None:
        """The tokens of a queued step, as responses (for the members still running)."""
        values = chosen.tolist()
        for b, sequence in enumerate(members):
            if self._running.get(sequence.uid) is sequence:
                out.append(self._respond(sequence, values[b], sequence.logprobs_queue.pop(0)))

    def _prefill_chunk(self, sequence: _Sequence, out: list) -> None:
        """One chunk of `sequence`'s prompt; after its last, its first token (it starts running)."""
        if sequence.chunks:
            start, end = sequence.chunks.pop(0)
            first = sequence.kept
            feed(self.model, sequence.ids[first + start : first + end], sequence.cache, self.step_size)
            return
        del self._waiting[sequence.uid]
        self._running[sequence.uid] = sequence
        logits, greedy = decode(self.model, mx.array([sequence.ids[-1:]], dtype=mx.int32), sequence.cache,
                                prompt=True)
        chosen = self._choose([sequence], logits[None], greedy)
        out.append(self._respond(sequence, chosen.tolist()[0], sequence.logprobs_queue.pop(0)))

    def _choose(self, sequences: list, logits: mx.array, greedy) -> mx.array:
        """Each sequence's next token from its row of logits [B, vocab] (lazy): int32 [B]; each
        one's own token (`pending`) and logprobs (queued) set. greedy: the LM head's own argmax
        (one sequence alone), or None."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        argmax = greedy.reshape(-1) if greedy is not None else mx.argmax(logits, axis=-1)
        tokens, rows_logprobs = [], []
        for b, sequence in enumerate(sequences):
            if sequence.sampler.temperature == 0 and sequence.recent is None:
                tokens.append(argmax[b])
                rows_logprobs.append(logprobs[b])
                continue
            sequence.key, draw = mx.random.split(sequence.key)
            row = logits[b]
            if sequence.recent is not None:
                row = sequence.sampler.penalise(row, sequence.recent)
            row_logprobs = row - mx.logsumexp(row)
            rows_logprobs.append(row_logprobs)
            tokens.append(mx.argmax(row) if sequence.sampler.temperature == 0
                          else sequence.sampler.sample(row_logprobs, draw))
        chosen = mx.stack(tokens).astype(mx.int32)
        for b, sequence in enumerate(sequences):
            sequence.pending = chosen[b]
            sequence.logprobs_queue.append(rows_logprobs[b])
        return chosen

    def _respond(self, sequence: _Sequence, token: int, logprobs: mx.array) -> BatchResponse:
        sequence.tokens.append(token)
        n = len(sequence.tokens)
        finish = None
        detokenizer = sequence.detokenizer
        if token in self.tokenizer.eos_token_ids:
            finish = "stop"
            detokenizer.finalize()
        else:
            detokenizer.add_token(token)
        if finish is None and n >= sequence.max_tokens:
            finish = "length"
            detokenizer.finalize()
        full = detokenizer.text
        end = len(full)
        found = [(i, s) for s in sequence.stops if (i := full.find(s, max(sequence.emitted - len(s), 0))) >= 0]
        if found:
            end, finish = min(found)[0], "stop"
        elif finish is None:
            end -= max((stop_overlap(full, s) for s in sequence.stops), default=0)
        text = full[sequence.emitted : max(end, sequence.emitted)]
        sequence.emitted = max(end, sequence.emitted)
        response = BatchResponse(sequence.uid, token, text, logprobs, finish, len(sequence.ids), sequence.kept, n)
        if finish is not None:
            cache = self._finish(sequence)
            if self.keep_caches:
                response.cache, response.cached_ids = cache, sequence.ids + sequence.tokens[:-1]
        return response

    def _finish(self, sequence: _Sequence, keep: bool | None = None) -> list | None:
        """`sequence` stops running; returns its cache holding its prompt and every token given
        out but the last (if kept): a step queued past that token is taken back."""
        keep = self.keep_caches if keep is None else keep
        self._running.pop(sequence.uid, None)
        ahead = sequence.launched - (len(sequence.tokens) - 1)  # steps queued whose tokens were not given out
        cache = sequence.cache
        if sequence.row is not None:
            cache = self._leave_batch(sequence, keep=keep)
        sequence.cache = None
        if not keep or cache is None:
            return None
        if ahead > 0:
            for layer_cache in cache:
                layer_cache.trim(ahead)
        return cache


def batch_generate(model, tokenizer, prompts, max_tokens=256, *, max_batch: int | None = None,
                   prefill_step_size: int = DEFAULT_PREFILL_STEP, verbose: bool = False, **sampling) -> list[str]:
    """The generated text of each prompt (text or ids), run together (mlx-lm's batch_generate).
    max_tokens: one for all or one per prompt; sampling (temperature, top_p, ..., seed, stop):
    one setting for all, or a list with one per prompt. max_batch: sequences at once (default:
    all of them, at most 64)."""
    prompts = list(prompts)
    count = len(prompts)

    def each(value, name):
        if isinstance(value, (list, tuple)) and name != "stop" or (name == "stop" and isinstance(value, list)
                                                                  and value and isinstance(value[0], list)):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} values for {count} prompts")
            return list(value)
        return [value] * count

    limits = each(max_tokens, "max_tokens")
    options = {name: each(value, name) for name, value in sampling.items()}
    generator = BatchGenerator(model, tokenizer, max_batch=max_batch or min(max(count, 1), 64),
                               prefill_step_size=prefill_step_size, keep_caches=False)
    uids = [generator.insert(prompt, limits[i], **{name: values[i] for name, values in options.items()})
            for i, prompt in enumerate(prompts)]
    texts = {uid: "" for uid in uids}
    tic, generated = time.perf_counter(), 0
    while generator.has_work:
        for response in generator.next():
            texts[response.uid] += response.text
            generated += 1
    if verbose:
        elapsed = time.perf_counter() - tic
        print(f"{count} prompts, {generated} tokens in {elapsed:.2f} s: {generated / max(elapsed, 1e-9):.1f} tokens/s")
    return [texts[uid] for uid in uids]
