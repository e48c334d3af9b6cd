"""`muser serve`: an OpenAI-compatible HTTP server over one model (mlx-lm's routes and fields).

GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions and POST /v1/completions, and
llama.cpp's GET /health, POST /tokenize and /detokenize; `"stream": true` answers
with server-sent events; logprobs (chat: logprobs/top_logprobs; completions: logprobs, echo);
a chat's tools through its template, tool calls in the answer as `tool_calls`. One model per process: requests take their turn in arrival order, and
one thread runs the model (MLX evaluation is not made for concurrent threads). A client that
goes away stops its generation at the next token, which frees the model for the next request.
The last request's cache is kept: a request that starts with what it holds runs only the rest
(`usage.prompt_tokens_details.cached_tokens`; `"cache_prompt": false` reads it all again).
A bad request gets a 4xx with OpenAI's error body, {"error": {"message", "type", "param",
"code"}}, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from muser_mlx.generate import (DEFAULT_PREFILL_STEP, MODEL_LOCK, Sampling, continue_cache, load, stop_overlap,
                                prefill_chunks, stream_generate)
from muser_mlx.tokenizer import TokenizerError

DEFAULT_MAX_TOKENS = 512  # mlx-lm's default; a request may ask for up to the context
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one stream, one format


class RequestError(Exception):
    """A request the server refuses (a 4xx): becomes an OpenAI-style error response."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def response(self) -> JSONResponse:
        return error_response(str(self), self.status, "invalid_request_error", self.param, self.code)


def error_response(message: str, status: int, kind: str, param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


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


def generation_options(body: dict, context: int, least: int = 1) -> dict:
    """stream_generate's keywords from a request body: max_tokens (at least `least`), stop, seed
    and sampling."""
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    max_tokens = _typed(body, "max_tokens", (int,), "an integer") if max_tokens is None else max_tokens
    max_tokens = min(DEFAULT_MAX_TOKENS, context) if max_tokens is None else max_tokens
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


class ModelService:
    """The one model of this process, lent to one request at a time, in arrival order. One
    thread loads it and runs every step: MLX streams belong to the thread that made them, and
    a loaded model still holds lazy arrays built on the loading thread's stream."""

    def __init__(self, path=None):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muser-model")
        self.model, self.tokenizer = self._thread.submit(load, path).result()
        self.model_id = Path(self.model.file.path).stem
        self.created = int(time.time())
        self._turn = asyncio.Lock()  # fair: waiters are served first come, first served
        # The prompt cache: the last request's cache and the ids it holds (its prompt and the
        # tokens it generated but the last). A request that starts with some of them feeds
        # only the rest (llama.cpp's `cache_prompt`, mlx-lm's prompt cache). Model thread only.
        self._cache, self._cached = None, []

    def checked_prompt(self, ids: list[int], param: str) -> list[int]:
        context = self.model.config.context
        if not ids:
            raise RequestError("the prompt is empty (and the tokenizer adds no BOS): nothing to "
                               "condition on", param)
        if len(ids) > context:
            raise RequestError(f"the prompt is {len(ids)} tokens; the model's context is {context} "
                               f"tokens", param, code="context_length_exceeded")
        return ids

    async def responses(self, ids: list[int], options: dict, reuse: bool = True, top: int | None = None):
        """(response, cached, logprob) triples: stream_generate's responses, one model-thread
        step each; how many of the prompt's ids came from the prompt cache (reuse=False: none);
        the token's TokenLogprob with `top` alternatives (None: not asked for).
        Closing this generator (the client went away) stops the generation: its close is queued
        behind the step in flight, and the next request's steps behind that."""
        loop = asyncio.get_running_loop()
        async with self._turn:
            steps, kept = await loop.run_in_executor(self._thread, self._begin, ids, options, reuse)
            tokens, failed = [], True
            try:
                while (step := await loop.run_in_executor(self._thread, self._next, steps, top)) is not None:
                    tokens.append(step[0].token)
                    yield step[0], kept, step[1]
                failed = False
            except GeneratorExit:  # closed by its reader: the generation stops cleanly
                failed = False
                raise
            finally:
                self._thread.submit(self._end, steps, ids + tokens[:-1], failed)

    def _begin(self, ids: list[int], options: dict, reuse: bool):
        """On the model thread: the generator of a request's steps, fed the part of its prompt
        the prompt cache does not hold, and the length of the part it does."""
        cache, kept = continue_cache(self.model, self._cache if reuse else None, self._cached, ids)
        self._cache, self._cached = cache, ids[:kept]
        steps = stream_generate(self.model, self.tokenizer, ids[kept:], cache=cache, cached_ids=ids[:kept],
                                **options)
        return steps, kept

    def _next(self, steps, top: int | None):
        """On the model thread: the next response and, if asked for, its token's logprob."""
        response = next(steps, None)
        if response is None:
            return None
        if top is None:
            return response, None
        with MODEL_LOCK:
            return response, token_logprobs(response.logprobs[None], [response.token], top)[0]

    async def prompt_logprobs(self, ids: list[int], top: int) -> list:
        """Each prompt token's TokenLogprob given the tokens before it (None for the first),
        from a forward pass of its own (prefill chunks, every row through the LM head)."""
        loop = asyncio.get_running_loop()
        async with self._turn:
            return await loop.run_in_executor(self._thread, self._score, ids, top)

    def _score(self, ids: list[int], top: int, chunk: int = DEFAULT_PREFILL_STEP) -> list:
        entries, cache = [None], self.model.make_cache()
        with MODEL_LOCK:
            for start, end in prefill_chunks(len(ids) - 1, chunk):
                piece = ids[start:end]
                logits = self.model(mx.array([piece], dtype=mx.int32), cache)[0]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                entries += token_logprobs(logprobs, ids[start + 1 : start + 1 + len(piece)], top)
        return entries

    def _end(self, steps, fed: list[int], failed: bool) -> None:
        """On the model thread: close the steps (the one fed ahead of the last token is taken
        back) and keep the cache for the next request, if it holds exactly `fed`."""
        steps.close()
        if failed or any(c.offset != len(fed) for c in self._cache):
            self._cache, self._cached = None, []
        else:
            self._cached = fed


# --- routes -----------------------------------------------------------------------------------------

class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends: Starlette cancels
    a stream whose client disconnects but leaves its iterator suspended."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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
        return JSONResponse({"tokens": tokenizer.encode(content, add_special_tokens=bool(add_special))})

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
        return JSONResponse({"content": tokenizer.decode(ids)})

    async def chat_completions(request: Request):
        body = await _body(request)
        options = generation_options(body, model.config.context)
        top, _ = logprob_options(body, chat=True)
        tools = chat_tools(body)
        try:
            ids = tokenizer.apply_chat_template(chat_messages(body), tokenize=True,
                                                **({"tools": tools} if tools else {}))
        except TokenizerError as error:
            raise RequestError(str(error), "messages") from None
        return await _complete(request, body, service.checked_prompt(ids, "messages"), options, True, top,
                               tools=tools is not None)

    async def completions(request: Request):
        body = await _body(request)
        top, echo = logprob_options(body, chat=False)
        options = generation_options(body, model.config.context, least=0 if echo else 1)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
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
        if echo:  # the prompt's text, and its tokens' logprobs if asked for
            echoed = (prompt if isinstance(prompt, str) else tokenizer.decode(ids), None)
        ids = service.checked_prompt(ids, "prompt")
        if echo and top is not None:
            echoed = (echoed[0], completion_logprobs(tokenizer, ids, await service.prompt_logprobs(ids, top)))
        return await _complete(request, body, ids, options, False, top, echoed)

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        name = _typed(body, "model", (str,), "a string")
        if name is not None:
            served(name)
        return body

    async def _complete(request: Request, body: dict, ids: list[int], options: dict, chat: bool,
                        top: int | None, echoed: tuple | None = None, tools: bool = False):
        """Run a request and answer it. top: logprobs with that many alternatives (None: none);
        echoed: (text, logprobs or None) of a completion's prompt to put before its answer;
        tools: a chat with tools, whose answer's tool calls become `tool_calls`."""
        kind = "chat.completion" if chat else "text_completion"
        reuse = _typed(body, "cache_prompt", (bool,), "true or false") is not False
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": model_id}
        if _typed(body, "stream", (bool,), "true or false"):
            stream_options = _typed(body, "stream_options", (dict,), "an object") or {}
            usage = _typed(stream_options, "include_usage", (bool,), "true or false")
            events = _stream(head, ids, options, reuse, chat, usage, top, echoed, tools)
            return EventStream(events, headers={"Cache-Control": "no-cache"})
        text, last, cached, tokens, entries = "", None, 0, [], []
        if options["max_tokens"] > 0:
            async with aclosing(service.responses(ids, options, reuse, top)) as responses:
                async for last, cached, entry in responses:
                    text += last.text
                    tokens.append(last.token)
                    entries.append(entry)
                    if await request.is_disconnected():
                        _log(head, len(ids), last, "client gone")
                        return JSONResponse({})  # nobody to read it
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

def serve(path=None, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Load the model, listen on host:port (0: any free port) and serve until interrupted.
    The address is printed once the socket listens (connections wait until uvicorn runs)."""
    import uvicorn

    service = ModelService(path)
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    host, port = listener.getsockname()[:2]
    print(f"muser serve: {service.model_id} at http://{host}:{port}/v1", flush=True)
    config = uvicorn.Config(create_app(service), log_level="info")
    uvicorn.Server(config).run(sockets=[listener])
