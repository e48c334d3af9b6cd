"""`muser serve`: an OpenAI-compatible HTTP server over one model (mlx-lm's routes and fields).

GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions and POST /v1/completions, and
llama.cpp's GET /health, POST /tokenize and /detokenize; `"stream": true` answers
with server-sent events; logprobs (chat: logprobs/top_logprobs; completions: logprobs, echo);
a chat's tools through its template, tool calls in the answer as `tool_calls`.
One model per process and one thread that runs it (MLX evaluation is not made for concurrent
threads): a scheduler loop over the batch generator, up to `Limits.parallel` sequences decoded
together, the others waiting (`Limits.max_queue` of them; then a 429). A client that goes away
frees its slot at the next step. Finished requests' caches are kept (`PromptCaches`): a request
that starts with one's prompt runs only the rest (`usage.prompt_tokens_details.cached_tokens`;
`"cache_prompt": false` reads it all again). JSON, templates and tokenizing run on text
threads, never on the event loop. A bad request gets a 4xx with OpenAI's error body,
{"error": {"message", "type", "param", "code"}}, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from muser_mlx.batch import BatchGenerator
from muser_mlx.cache import common_prefix
from muser_mlx.generate import DEFAULT_PREFILL_STEP, Sampling, continue_cache, load, prefill_chunks, stop_overlap
from muser_mlx.models import cpu_decode
from muser_mlx.tokenizer import TokenizerError

IDLE_SECONDS = 0.5  # the model thread gives memory back once idle this long
DEFAULT_MAX_TOKENS = 512  # mlx-lm's default; a request may ask for more, up to Limits.max_tokens_limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one stream, one format


class RequestError(Exception):
    """A request the server refuses (a 4xx): becomes an OpenAI-style error response."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.code, self.kind, self.headers = param, status, code, kind, headers

    def response(self) -> JSONResponse:
        return error_response(str(self), self.status, self.kind, self.param, self.code, self.headers)


def error_response(message: str, status: int, kind: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


# --- reading requests ---------------------------------------------------------------------------

def _typed(body: dict, name: str, kinds: tuple, what: str):
    """body[name] if it is one of `kinds` (JSON true/false are not numbers here), else None if
    absent or null; anything else is refused naming the field."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def generation_options(body: dict, least: int = 1) -> dict:
    """The generator's keywords from a request body: max_tokens (at least `least`; capped later,
    ModelService.capped), stop, seed and sampling."""
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    max_tokens = _typed(body, "max_tokens", (int,), "an integer") if max_tokens is None else max_tokens
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < least:
        raise RequestError(f"'max_tokens' must be at least {least}{' (0 only with echo)' if least else ''}, "
                           f"got {max_tokens}", "max_tokens")
    n = _typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    stop = _typed(body, "stop", (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(f"'seed' must lie in [0, 2**63), got {seed}", "seed")
    options = dict(max_tokens=max_tokens, stop=stop, seed=seed)
    for name in SAMPLING_FIELDS:
        kinds, what = ((int,), "an integer") if name == "top_k" else ((int, float), "a number")
        value = _typed(body, name, kinds, what)
        if value is not None:
            try:
                Sampling(**{name: value})  # the generator's own rule for this setting
            except ValueError as error:
                raise RequestError(str(error), name) from None
            options[name] = value
    return options


def logprob_options(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(top, echo): how many likeliest alternatives to give with each token's logprob (None: no
    logprobs), and whether a completion echoes its prompt (with its tokens' logprobs).
    Chat: "logprobs": true and "top_logprobs": n. Completions: "logprobs": n and "echo"."""
    if chat:
        wanted = _typed(body, "logprobs", (bool,), "true or false")
        top = _typed(body, "top_logprobs", (int,), "an integer")
        if top is not None and not wanted:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        name, echo = "top_logprobs", False
        top = (top or 0) if wanted else None
    else:
        name, top = "logprobs", _typed(body, "logprobs", (int,), "an integer")
        echo = bool(_typed(body, "echo", (bool,), "true or false"))
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'{name}' must lie in 0..{MAX_TOP_LOGPROBS}, got {top}", name)
    return top, echo


def chat_messages(body: dict) -> list[dict]:
    """OpenAI messages as the chat template takes them: content parts of type "text" are
    joined into one string; an assistant message's `tool_calls` (its content may then be null)
    keep their function's arguments as an object (templates write them out with tojson)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'", "messages")
        content = message.get("content")
        calls = message.get("tool_calls")
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls must be a list, in an assistant message", "messages")
            calls = [_template_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
            content = "" if content is None else content
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts "
                               f"({{\"type\": \"text\", \"text\": ...}})", "messages")
        rendered.append({**message, "content": content, **({"tool_calls": calls} if calls is not None else {})})
    return rendered


def _template_call(call, where: str) -> dict:
    """An OpenAI tool call as chat templates read it: its function's arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           f"\"arguments\"}}}}", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"{where}.function.arguments is not JSON: {arguments[:60]!r}", "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


def chat_tools(body: dict) -> list[dict] | None:
    """The request's `tools` (function definitions for the chat template), or None when there
    are none or `tool_choice` is "none"."""
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                           "tools")
    return tools or None


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCallText:
    """A chat answer's text, with the tool calls it makes taken out: Hermes-style blocks,
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the format of Qwen 2.5's and many
    fine-tunes' templates, which mlx-lm's server reads too). add(piece) returns the content
    that can go out now (a possible start of a block is held back); finish() returns the rest
    and the calls, OpenAI's tool_calls. A block that is not such JSON stays in the content."""

    def __init__(self):
        self.pending, self.inside, self.calls = "", False, []

    def add(self, piece: str) -> str:
        self.pending += piece
        out = ""
        while True:
            if self.inside:
                end = self.pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(TOOL_CALL_CLOSE):]
                self.inside = False
                if not self._call(body):
                    out += TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE
                continue
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                cut = len(self.pending) - stop_overlap(self.pending, TOOL_CALL_OPEN)
                out, self.pending = out + self.pending[:cut], self.pending[cut:]
                return out
            out, self.pending = out + self.pending[:start], self.pending[start + len(TOOL_CALL_OPEN):]
            self.inside = True

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.pending = self.pending, ""
        if self.inside:  # an unclosed block (the answer was cut off): a call if it is whole JSON
            self.inside = False
            rest = "" if self._call(rest) else TOOL_CALL_OPEN + rest
        return rest, self.calls

    def _call(self, body: str) -> bool:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                        else json.dumps(arguments)}})
        return True


# --- the model's turns ----------------------------------------------------------------------------

@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the likeliest tokens and their logprobs, best first


def token_logprobs(logprobs: mx.array, chosen: list[int], top: int) -> list[TokenLogprob]:
    """Rows of log-probabilities float32 [n, vocab] and the token each row chose -> each one's
    logprob and its `top` likeliest alternatives (evaluated here)."""
    top = min(top, logprobs.shape[-1])
    picked = mx.take_along_axis(logprobs, mx.array(chosen, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top] if top else mx.zeros((len(chosen), 0), mx.int32)
    values = mx.take_along_axis(logprobs, best, axis=-1)
    mx.eval(picked, best, values)
    picked, best, values = np.array(picked).tolist(), np.array(best), np.array(values)
    order = np.argsort(-values, axis=-1, kind="stable")
    best, values = np.take_along_axis(best, order, -1).tolist(), np.take_along_axis(values, order, -1).tolist()
    return [TokenLogprob(token, logprob, list(zip(ids, lps)))
            for token, logprob, ids, lps in zip(chosen, picked, best, values)]


def _token_text(tokenizer, token: int) -> str:
    """A token's bytes as text (a piece of a character as U+FFFD)."""
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(token: int, logprob: float) -> dict:
        return {"token": _token_text(tokenizer, token), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(tokenizer, tokens: list[int], entries: list, offset: int = 0) -> dict:
    """OpenAI completions' choice.logprobs: tokens, token_logprobs, top_logprobs (a dict per
    token: the likeliest and the chosen one) and text_offset (from `offset`); None where a token
    has none (an echoed prompt's first)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = _token_text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        if entry is None:
            out["top_logprobs"].append(None)
            continue
        alternatives = {_token_text(tokenizer, t): lp for t, lp in entry.top}
        alternatives.setdefault(text, entry.logprob)
        out["top_logprobs"].append(alternatives)
    return out


@dataclass(frozen=True)
class Limits:
    """What one server takes on: `muser serve`'s options."""
    parallel: int = 8  # sequences decoded together (the generator's max_batch)
    max_queue: int = 64  # requests that may wait for a slot; beyond them a 429
    max_body_bytes: int = 16 * 2**20  # a request body beyond this gets a 413
    max_tokens_limit: int = 4096  # no request generates more tokens than this
    kv_memory: int | None = None  # bytes of KV cache the running sequences hold together (None: no bound)
    prompt_cache_memory: int = 256 * 2**20  # bytes of finished sequences' caches kept for later prompts

    def __post_init__(self):
        for name, least in (("parallel", 1), ("max_tokens_limit", 1), ("max_body_bytes", 1), ("max_queue", 0),
                            ("prompt_cache_memory", 0), ("kv_memory", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")


class PromptCaches:
    """Finished sequences' KV caches, each with the ids it holds (a prompt and its answer but
    the last token), kept within `budget` bytes; the least recently used goes first.
    take(ids) hands out, of the entries whose whole prompt a new prompt starts with, the one
    that shares the longest prefix with it (the answer part may differ: a re-rendered answer
    that tokenizes otherwise, text cut at a stop string). So each user's next turn finds their
    own history, and a prompt that shares only a system message with another user's starts
    afresh rather than cutting that user's cache down to it (a cache cannot be copied here; mlx-lm's
    LRU prompt cache reuses only prefixes too). A cache handed out leaves the store (the
    sequence extends it in place); put() brings back the finished one. Model thread only."""

    def __init__(self, budget: int):
        self.budget = budget
        # ids held, prompt tokens among them, cache, bytes; oldest use first
        self._entries: OrderedDict[int, tuple[list[int], int, list, int]] = OrderedDict()
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(entry[3] for entry in self._entries.values())

    def take(self, ids: list[int]) -> tuple[list | None, list[int]]:
        """(cache, the ids it holds) of the best entry for a prompt `ids`, or (None, [])."""
        best, shared = None, 0
        for key, (held, prompt_tokens, _, _) in self._entries.items():
            common = common_prefix(held, ids)
            if common >= prompt_tokens and common > shared:
                best, shared = key, common
        if best is None:
            return None, []
        held, _, cache, _ = self._entries.pop(best)
        return cache, held

    def put(self, ids: list[int], prompt_tokens: int, cache: list) -> None:
        """Keep `cache`, which holds `ids`, the first `prompt_tokens` of them its prompt."""
        nbytes = sum(layer_cache.nbytes for layer_cache in cache)
        if not ids or nbytes > self.budget:
            return
        self._entries[self._next] = (list(ids), prompt_tokens, cache, nbytes)
        self._next += 1
        while self.nbytes > self.budget:
            self._entries.popitem(last=False)


@dataclass
class Sequence:
    """One request's generation as the event loop and the model thread share it: the model
    thread inserts it into the generator (uid) and delivers each step's (response, TokenLogprob
    or None), or the exception that ended it, through `deliver` (thread-safe)."""
    ids: list[int]
    options: dict  # max_tokens, stop, seed and sampling
    reuse: bool  # start from the prompt cache
    top: int | None  # logprobs with this many alternatives (None: none)
    deliver: Callable
    uid: int | None = None


class ModelService:
    """The one model of this process and the thread that runs it. The model thread loads the
    model (MLX streams belong to the thread that made them) and then runs the scheduler loop:
    it takes the event loop's commands (a sequence to insert, one whose client went away), runs
    one generator iteration (at most one prefill chunk's worth of waiting prompts, then one
    batched decode step of the running ones) and hands each sequence's token to its request. When
    nothing has run for IDLE_SECONDS, the memory freed goes back to the system
    (_give_back_memory): after the requests' last objects are gone, on every thread, and not
    between one user's back-to-back requests."""

    def __init__(self, path=None, limits: Limits = Limits()):
        self.limits = limits
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # callables for the model thread; None: stop
        self._running: dict[int, Sequence] = {}  # by uid, model thread only
        self._scoring: list = []  # echo scoring jobs (generators, a chunk a step), model thread only
        self._prompt_caches = PromptCaches(limits.prompt_cache_memory)
        self.active = 0  # requests admitted and not yet answered (event loop only)
        loaded = Future()
        self._thread = threading.Thread(target=self._run, args=(path, loaded), name="muser-model", daemon=True)
        self._thread.start()
        self.model, self.tokenizer, self._generator = loaded.result()
        self.model_id = Path(self.model.file.path).stem
        self.created = int(time.time())
        # A token covers at most this many bytes of text: a text longer than context x this
        # cannot fit and is refused before it is tokenized.
        self.max_token_bytes = max(4, max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size)))
        self.text = ThreadPoolExecutor(max_workers=2, thread_name_prefix="muser-text")  # JSON, tokenizing

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self.text.shutdown(wait=False)

    # --- the event loop's side

    def admit(self) -> "Admission":
        """A request's place among those the server takes on (parallel slots + max_queue
        waiting), or a 429 saying when to try again."""
        if self.active >= self.limits.parallel + self.limits.max_queue:
            raise RequestError(f"the server is busy: {self.active} requests are running or waiting "
                               f"(--parallel {self.limits.parallel}, --max-queue {self.limits.max_queue}); "
                               f"try again shortly", status=429, code="rate_limit_exceeded",
                               kind="requests", headers={"Retry-After": "1"})
        self.active += 1
        return Admission(self)

    def checked_prompt(self, ids: list[int], param: str) -> list[int]:
        context = self.model.config.context
        if not ids:
            raise RequestError("the prompt is empty (and the tokenizer adds no BOS): nothing to "
                               "condition on", param)
        if len(ids) > context:
            raise RequestError(f"the prompt is {len(ids)} tokens; the model's context is {context} "
                               f"tokens", param, code="context_length_exceeded")
        return ids

    def check_text(self, text: str, param: str) -> None:
        """Refuses, before tokenizing, a text too long to fit the context whatever its tokens."""
        context = self.model.config.context
        if len(text) > context * self.max_token_bytes:  # characters <= UTF-8 bytes
            raise RequestError(f"the prompt is {len(text):,} characters: more than the model's context of "
                               f"{context} tokens can hold ({self.max_token_bytes} bytes a token at most)",
                               param, code="context_length_exceeded")

    def capped(self, options: dict, prompt_tokens: int) -> dict:
        """options with max_tokens at most the server's limit and what the context has room for
        after the prompt (its last position's logits choose the first token)."""
        room = self.model.config.context - prompt_tokens + 1
        return {**options, "max_tokens": min(options["max_tokens"], self.limits.max_tokens_limit, room)}

    async def in_text_thread(self, function, *args, **kwargs):
        """function(*args, **kwargs) on a text thread: JSON, tokenizing and templating stay off
        the event loop (the tokenizer's own work releases the GIL)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text, partial(function, *args, **kwargs))

    async def responses(self, ids: list[int], options: dict, reuse: bool = True, top: int | None = None):
        """(response, cached, logprob) triples, one per generated token: the generator's
        BatchResponse, how many of the prompt's ids came from a prompt cache (reuse=False: none)
        and the token's TokenLogprob with `top` alternatives (None: not asked for).
        Closing this generator before the last token (the client went away) removes the
        sequence: its slot is free at the next step."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        sequence = Sequence(ids, options, reuse, top, partial(_deliver, loop, items))
        self._inbox.put(partial(self._insert, sequence))
        finished = False
        try:
            while True:
                item = await items.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                response, entry = item
                finished = response.finish_reason is not None
                yield response, response.cached_tokens, entry
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(partial(self._remove, sequence))

    async def prompt_logprobs(self, ids: list[int], top: int) -> list:
        """Each prompt token's TokenLogprob given the tokens before it (None for the first),
        from a forward pass of its own (prefill chunks, every row through the LM head; a chunk
        a scheduler iteration, between the running sequences' steps)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(partial(self._scoring.append, (self._score(ids, top), loop, done)))
        return await done

    # --- the model thread

    def _run(self, path, loaded: Future) -> None:
        try:
            model, tokenizer = load(path)
            generator = BatchGenerator(model, tokenizer, max_batch=self.limits.parallel,
                                       kv_memory=self.limits.kv_memory)
        except BaseException as error:
            loaded.set_exception(error)
            return
        loaded.set_result((model, tokenizer, generator))
        worked = False  # since memory was last given back
        while True:
            commands = []
            if not (generator.has_work or self._scoring):
                try:
                    commands.append(self._inbox.get(timeout=IDLE_SECONDS if worked else None))
                except queue.Empty:
                    _give_back_memory()
                    worked = False
                    continue
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if None in commands:
                return
            try:
                for command in commands:
                    command()
                worked = worked or bool(commands)
                if self._scoring:
                    self._score_chunk()
                if generator.has_work:
                    self._step()
            except Exception as error:  # the running sequences end with it; the thread goes on serving
                log.exception("the model thread failed a step")
                self._fail_all(error)

    def _insert(self, sequence: Sequence) -> None:
        cache, cached = self._prompt_caches.take(sequence.ids) if sequence.reuse else (None, [])
        kept = 0
        if cache is not None:
            cache, kept = continue_cache(self.model, cache, cached, sequence.ids)
        try:
            sequence.uid = self._generator.insert(sequence.ids, cache=cache if kept else None,
                                                  cached_ids=sequence.ids[:kept] if kept else None,
                                                  **sequence.options)
        except ValueError as error:  # a setting the generator refuses
            sequence.deliver(RequestError(str(error)))
            return
        except Exception as error:
            log.exception("inserting a sequence failed")
            sequence.deliver(error)
            return
        self._running[sequence.uid] = sequence

    def _remove(self, sequence: Sequence) -> None:
        if self._running.pop(sequence.uid, None) is not None:
            self._generator.remove(sequence.uid)

    def _step(self) -> None:
        for response in self._generator.next():
            sequence = self._running.get(response.uid)
            if sequence is None:
                continue
            entry = None
            if sequence.top is not None:
                entry = token_logprobs(response.logprobs[None], [response.token], sequence.top)[0]
            # The event loop gets no MLX arrays: a finished sequence's cache is kept (or freed)
            # here, not when its request has been answered, after the idle model thread has
            # given memory back.
            sequence.deliver((replace(response, logprobs=None, cache=None, cached_ids=None), entry))
            if response.finish_reason is not None:
                del self._running[response.uid]
                if response.cache is not None:
                    self._prompt_caches.put(response.cached_ids, len(sequence.ids), response.cache)

    def _fail_all(self, error: Exception) -> None:
        """End every running sequence and scoring job with `error`."""
        running, self._running = self._running, {}
        for uid, sequence in running.items():
            try:
                self._generator.remove(uid)
            finally:
                sequence.deliver(error)
        for _, loop, done in self._scoring:
            loop.call_soon_threadsafe(lambda done=done: done.cancelled() or done.set_exception(error))
        self._scoring.clear()

    def _score(self, ids: list[int], top: int, chunk: int = DEFAULT_PREFILL_STEP):
        """prompt_logprobs' pass, a generator: each next() runs one prefill chunk; the last
        returns the entries."""
        entries, cache = [None], self.model.make_cache()
        for start, end in prefill_chunks(len(ids) - 1, chunk):
            piece = ids[start:end]
            logits = self.model(mx.array([piece], dtype=mx.int32), cache)[0]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            entries += token_logprobs(logprobs, ids[start + 1 : start + 1 + len(piece)], top)
            yield
        return entries

    def _score_chunk(self) -> None:
        job, loop, done = self._scoring[0]
        try:
            next(job)
            return
        except StopIteration as end:
            result = end.value
        except Exception as error:
            log.exception("scoring a prompt failed")
            result = error
        self._scoring.pop(0)
        setter = done.set_exception if isinstance(result, Exception) else done.set_result
        loop.call_soon_threadsafe(lambda: done.cancelled() or setter(result))


class Admission:
    """A request's place in the server (ModelService.admit): given back once, when its answer
    ends. A streamed answer outlives its route, so the stream takes it over (hand_over())."""

    def __init__(self, service: ModelService):
        self._service, self._held = service, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._service.active -= 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def hand_over(self) -> "Admission":
        """This admission for a stream to release; the route's own exit then leaves it be."""
        taken = Admission(self._service)
        taken._held, self._held = self._held, False
        return taken


def _give_back_memory() -> None:
    """Once the model thread has been idle a while: the buffers MLX keeps for reuse, and the
    free pages of the C heap (glibc keeps freed arrays' pages: a tiny model's process stayed at
    3x its size after 16 long prompts, and came back with malloc_trim), go back to the system."""
    mx.clear_cache()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
MMAP_THRESHOLD = 1 << 20  # bytes: an allocation this large or larger is its own mapping


def _fixed_mmap_threshold() -> None:
    """glibc serves an allocation below its mmap threshold from its heaps, and raises that
    threshold to the size of each mapped block freed (up to 32 MB): after a load the KV caches'
    and products' MB-sized buffers came from the heaps, and a heap page that one small live
    block pins stays after malloc_trim (the tiny-model test kept 28 MB of 103 in about one run
    of six). A fixed threshold keeps such buffers mapped, and freeing them (mx.clear_cache)
    unmaps them; MLX's own buffer cache still reuses them while the server works."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _deliver(loop: asyncio.AbstractEventLoop, items: asyncio.Queue, item) -> None:
    """From the model thread: `item` into a request's queue (nothing once the loop is closed)."""
    try:
        loop.call_soon_threadsafe(items.put_nowait, item)
    except RuntimeError:
        pass


# --- routes -----------------------------------------------------------------------------------------

class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends (Starlette cancels
    a stream whose client disconnects but leaves its iterator suspended), and the request's
    admission given back then."""

    media_type = "text/event-stream"

    def __init__(self, events, admission: Admission, **kwargs):
        super().__init__(events, **kwargs)
        self.admission = admission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self.admission.release()


def _event(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(service: ModelService) -> Starlette:
    model, tokenizer, model_id = service.model, service.tokenizer, service.model_id

    card = {"id": model_id, "object": "model", "created": service.created, "owned_by": "muser_mlx"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card]})

    def served(name: str) -> None:
        """Refuses (404) a model name other than this server's."""
        if name != model_id:
            raise RequestError(f"the model '{name}' does not exist: this server runs '{model_id}'",
                               "model", status=404, code="model_not_found")

    async def one_model(request: Request):
        served(request.path_params["name"])
        return JSONResponse(card)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def tokenize(request: Request):
        """llama.cpp's /tokenize: {"content": text, "add_special": bool} -> {"tokens": ids}."""
        body = await _body(request)
        content = _typed(body, "content", (str,), "a string")
        if content is None:
            raise RequestError("'content' must be a string", "content")
        add_special = _typed(body, "add_special", (bool,), "true or false")
        return JSONResponse({"tokens": await service.in_text_thread(tokenizer.encode, content,
                                                                     add_special_tokens=bool(add_special))})

    async def detokenize(request: Request):
        """llama.cpp's /detokenize: {"tokens": ids} -> {"content": text}."""
        body = await _body(request)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise RequestError("'tokens' must be a list of token ids", "tokens")
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary ({tokenizer.vocab_size} tokens)",
                               "tokens")
        return JSONResponse({"content": await service.in_text_thread(tokenizer.decode, ids)})

    async def chat_completions(request: Request):
        with service.admit() as admission:
            body = await _body(request)
            options = generation_options(body)
            top, _ = logprob_options(body, chat=True)
            tools = chat_tools(body)
            messages = chat_messages(body)

            def rendered() -> list[int]:
                text = tokenizer.apply_chat_template(messages, **({"tools": tools} if tools else {}))
                service.check_text(text, "messages")
                return tokenizer.encode(text, add_special_tokens=False, parse_special=True)

            try:
                ids = await service.in_text_thread(rendered)
            except TokenizerError as error:
                raise RequestError(str(error), "messages") from None
            return await _complete(request, admission, body, service.checked_prompt(ids, "messages"), options,
                                   True, top, tools=tools is not None)

    async def completions(request: Request):
        with service.admit() as admission:
            return await _completion(request, admission)

    async def _completion(request: Request, admission: Admission):
        body = await _body(request)
        top, echo = logprob_options(body, chat=False)
        options = generation_options(body, least=0 if echo else 1)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            service.check_text(prompt, "prompt")
            ids = await service.in_text_thread(tokenizer.encode, prompt)
        elif (isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                               for i in prompt)):
            bad = [i for i in prompt if not 0 <= i < model.config.vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                                   f"({model.config.vocab} tokens)", "prompt")
            ids = prompt
        else:
            raise RequestError("'prompt' must be a string or a list of token ids", "prompt")
        echoed = None
        ids = service.checked_prompt(ids, "prompt")
        if echo:  # the prompt's text, and its tokens' logprobs if asked for
            echoed = (prompt if isinstance(prompt, str) else await service.in_text_thread(tokenizer.decode, ids), None)
        if echo and top is not None:
            echoed = (echoed[0], completion_logprobs(tokenizer, ids, await service.prompt_logprobs(ids, top)))
        return await _complete(request, admission, body, ids, options, False, top, echoed)

    async def _body(request: Request) -> dict:
        """The request's JSON object, read up to the body limit (413 beyond it) and parsed on a
        text thread."""
        limit = service.limits.max_body_bytes
        too_large = RequestError(f"the request body is larger than this server takes ({limit:,} bytes; "
                                 f"muser serve --max-body-bytes)", status=413, code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        try:
            body = await service.in_text_thread(json.loads, b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        name = _typed(body, "model", (str,), "a string")
        if name is not None:
            served(name)
        return body

    async def _complete(request: Request, admission: Admission, body: dict, ids: list[int], options: dict,
                        chat: bool, top: int | None, echoed: tuple | None = None, tools: bool = False):
        """Run a request and answer it. top: logprobs with that many alternatives (None: none);
        echoed: (text, logprobs or None) of a completion's prompt to put before its answer;
        tools: a chat with tools, whose answer's tool calls become `tool_calls`."""
        kind = "chat.completion" if chat else "text_completion"
        options = service.capped(options, len(ids))
        reuse = _typed(body, "cache_prompt", (bool,), "true or false") is not False
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": model_id}
        if _typed(body, "stream", (bool,), "true or false"):
            stream_options = _typed(body, "stream_options", (dict,), "an object") or {}
            usage = _typed(stream_options, "include_usage", (bool,), "true or false")
            events = _stream(head, ids, options, reuse, chat, usage, top, echoed, tools)
            return EventStream(events, admission.hand_over(), headers={"Cache-Control": "no-cache"})
        text, last, cached, tokens, entries = "", None, 0, [], []

        async def collect():
            nonlocal text, last, cached
            async with aclosing(service.responses(ids, options, reuse, top)) as responses:
                async for last, cached, entry in responses:
                    text += last.text
                    tokens.append(last.token)
                    entries.append(entry)

        if options["max_tokens"] > 0:
            # The client may go away while its request waits for a slot or runs: the request
            # ends then (its sequence is removed), not at its last token.
            collector, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({collector, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not collector.done():
                collector.cancel()
                await asyncio.gather(collector, return_exceptions=True)
                _log(head, len(ids), last, "client gone")
                return JSONResponse({})  # nobody to read it
            collector.result()
        finish = last.finish_reason if last else "length"
        _log(head, len(ids), last, finish)
        if chat:
            message = {"role": "assistant", "content": text}
            if tools:
                calls_text = ToolCallText()
                content = calls_text.add(text)
                rest, calls = calls_text.finish()
                message = {"role": "assistant", "content": (content + rest) or (None if calls else "")}
                if calls:
                    message["tool_calls"], finish = calls, "tool_calls"
            choice = {"message": message,
                      "logprobs": chat_logprobs(tokenizer, entries) if top is not None else None}
        else:
            choice = {"text": text, "logprobs": None}
            if echoed is not None:
                choice["text"] = echoed[0] + text
            if top is not None:
                before = echoed[1] if echoed is not None else None
                offset = len(echoed[0]) if echoed is not None else 0
                choice["logprobs"] = _joined(before, completion_logprobs(tokenizer, tokens, entries, offset))
        return JSONResponse({**head, "choices": [{"index": 0, **choice, "finish_reason": finish}],
                             "usage": _usage(len(ids), cached, last)})

    async def _stream(head: dict, ids: list[int], options: dict, reuse: bool, chat: bool, include_usage: bool,
                      top: int | None, echoed: tuple | None, tools: bool = False):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        offset = 0  # characters of a completion's text sent so far (its logprobs' text_offset)

        def chunk(text: str, finish_reason, first=False, tokens=(), entries=(), logprobs=None, calls=None):
            nonlocal offset
            if chat:
                piece = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
                if calls:
                    piece["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                if top is not None:
                    piece["logprobs"] = chat_logprobs(tokenizer, list(entries))
            else:
                if top is not None and logprobs is None:
                    logprobs = completion_logprobs(tokenizer, list(tokens), list(entries), offset)
                piece = {"text": text, "logprobs": logprobs}
                offset += len(text)
            return _event({**head, "choices": [{"index": 0, **piece, "finish_reason": finish_reason}]})

        last, cached, ended = None, 0, None
        try:
            if chat:
                yield chunk("", None, first=True)
            if echoed is not None:
                yield chunk(echoed[0], None if options["max_tokens"] else "length", logprobs=echoed[1])
            tokens, entries = [], []  # those whose chunk is still to be sent (text held back)
            if options["max_tokens"] > 0:
                calls_text = ToolCallText() if tools else None
                async with aclosing(service.responses(ids, options, reuse, top)) as responses:
                    async for last, cached, entry in responses:
                        tokens.append(last.token)
                        entries.append(entry)
                        text, finish, calls = last.text, last.finish_reason, None
                        if calls_text is not None:
                            text = calls_text.add(text)
                            if finish:
                                rest, calls = calls_text.finish()
                                text += rest
                        if calls:
                            if text:
                                yield chunk(text, None, tokens=tokens, entries=entries)
                                tokens, entries = [], []
                            yield chunk("", "tool_calls", tokens=tokens, entries=entries, calls=calls)
                            tokens, entries = [], []
                        elif text or finish:
                            yield chunk(text, finish, tokens=tokens, entries=entries)
                            tokens, entries = [], []
            ended = last.finish_reason if last else "length"
            if include_usage:
                yield _event({**head, "choices": [], "usage": _usage(len(ids), cached, last)})
            yield _event("[DONE]")
        except Exception:
            ended = "failed"
            raise
        finally:
            _log(head, len(ids), last, ended or "client gone")

    async def refused(request: Request, error: RequestError):
        if error.status >= 429:
            log.info("refused %s %s: %d %s", request.method, request.url.path, error.status, error.code)
        return error.response()

    async def http_error(request: Request, error: HTTPException):
        return error_response(error.detail, error.status_code, "invalid_request_error")

    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", one_model, methods=["GET"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/health", health, methods=["GET"]),  # llama.cpp's and mlx-lm's
              Route("/tokenize", tokenize, methods=["POST"]),  # llama.cpp's
              Route("/detokenize", detokenize, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={RequestError: refused, HTTPException: http_error})


async def _disconnected(request: Request) -> None:
    """Returns once the client of a request whose body has been read goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, cached: int, last) -> dict:
    """OpenAI's usage: prompt_tokens counts the whole prompt, cached_tokens the part of it
    read from the prompt cache rather than run again (last: the last response, None if none)."""
    generated = last.generation_tokens if last else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated, "prompt_tokens_details": {"cached_tokens": cached}}


def _joined(before: dict | None, after: dict) -> dict:
    """Two completions logprobs objects one after the other (an echoed prompt's and the answer's)."""
    return after if before is None else {key: before[key] + after[key] for key in after}


def _log(head: dict, prompt_tokens: int, last, ended) -> None:
    tokens = f"{prompt_tokens} prompt + {last.generation_tokens} generated tokens" if last else "no tokens"
    log.info("%s %s: %s, %s", head["object"], head["id"], tokens, ended)


# --- the process ----------------------------------------------------------------------------------

def serve(path=None, host: str = "127.0.0.1", port: int = 8080, limits: Limits = Limits()) -> None:
    """Load the model, listen on host:port (0: any free port) and serve until interrupted.
    The address is printed once the socket listens (connections wait until uvicorn runs)."""
    import uvicorn

    _fixed_mmap_threshold()
    service = ModelService(path, limits)
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    # Accepted connections inherit this: without it a response's second write (its body, an
    # event of a stream) waits for the client's delayed ACK of the first on a kept-alive
    # connection, ~40 ms on Linux, every response of an OpenAI client.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    host, port = listener.getsockname()[:2]
    print(f"muser serve: {service.model_id} at http://{host}:{port}/v1", flush=True)
    config = uvicorn.Config(create_app(service), log_level="info")
    uvicorn.Server(config).run(sockets=[listener])
