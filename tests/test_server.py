"""`muser serve` end to end: the real server process on a free port, called with the official
openai client (and raw HTTP for what that client cannot send): plain, streamed, stop strings,
sampling settings, bad requests, concurrent requests, a client that goes away."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from muser_mlx import cli

pytest.importorskip("starlette")  # the server's web stack ([serve] extra): absent on the GPU machine
from muser_mlx import server as server_module  # noqa: E402
from muser_mlx.generate import continue_cache, generate, load, stream_generate  # noqa: E402
from muser_mlx.models import cpu_decode  # noqa: E402
from muser_mlx.testing import tiny_model  # noqa: E402

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the capital of france?"}]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT/v1
    log: Path  # the server's stderr: one line per request it ends
    model_path: Path
    pid: int

    def client(self):
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def post(self, route: str, body: bytes | None, method="POST", root=False, headers=None) -> tuple[int, dict]:
        """(status, JSON answer) of a request to /v1 + route (root: to route at the server's root)."""
        status, answer, _ = self.request(route, body, method, root, headers)
        return status, answer

    def request(self, route: str, body: bytes | None, method="POST", root=False, headers=None):
        """(status, JSON answer, response headers) of a request to /v1 + route (root: at the root)."""
        base = self.url.removesuffix("/v1") if root else self.url
        request = urllib.request.Request(base + route, data=body, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read()), response.headers
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read()), error.headers


@contextmanager
def serving(model_path: Path, folder: Path, *options: str):
    """`muser serve` on `model_path` with `options`, listening on a port the OS picks; a
    Server until the block ends, then stopped."""
    out, log = folder / "stdout.txt", folder / "stderr.txt"
    with open(out, "w") as stdout, open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "muser_mlx.cli", "serve", "--model", str(model_path),
                                    "--port", "0", *options], stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"at (http://\S+/v1)", out.read_text())):
            assert process.poll() is None, f"muser serve exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"muser serve did not start: {log.read_text()}"
            time.sleep(0.05)
        yield Server(found.group(1), log, model_path, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`muser serve` on a tiny llama model (a real byte-level BPE vocabulary and chat
    template); stopped after the module's tests."""
    folder = tmp_path_factory.mktemp("serve")
    model_path = tiny_model(folder / "tiny.gguf", "llama", np.random.default_rng(0), weights="Q8_0",
                            context=4096)
    with serving(model_path, folder) as running:
        yield running


@pytest.fixture(scope="module")
def local(server):
    """The same model in this process: the answers the server must give."""
    return load(server.model_path)


def test_models_lists_the_one_model_served(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_completion_is_the_greedy_answer_with_usage(server, local):
    model, tokenizer = local
    reply = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=9)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == generate(model, tokenizer, prompt, 9)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 9)
    assert reply.usage.total_tokens == len(prompt) + 9


def test_streamed_chat_adds_up_to_the_plain_answer(server):
    # Neither reads the prompt cache: what a request finds there depends on the one before it
    # (the second would find the first's prompt; the first, whichever test ran before it), and
    # usage counts it (cached_tokens).
    client = server.client()
    fresh = {"cache_prompt": False}
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, extra_body=fresh)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=fresh))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in choices) == plain.choices[0].message.content
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert not chunks[-1].choices and chunks[-1].usage == plain.usage


def test_completion_stops_before_a_stop_string(server, local):
    model, tokenizer = local
    client = server.client()
    plain = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=16).choices[0]
    assert plain.text == generate(model, tokenizer, "the quick brown", 16) and len(plain.text) >= 8
    stop = plain.text[4:7]
    stopped = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=16, stop=[stop, "\0"])
    assert stopped.choices[0].text == plain.text[: plain.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="the quick brown", max_tokens=16, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_settings_and_seed_reach_the_generator(server, local):
    model, tokenizer = local
    settings = dict(temperature=1.0, top_p=0.95, seed=11)
    extra = dict(top_k=40, min_p=0.01, repetition_penalty=3.0)  # mlx-lm's fields beyond OpenAI's
    client = server.client()
    texts = [client.completions.create(model="tiny", prompt="the fox", max_tokens=12, extra_body=extra,
                                       **settings).choices[0].text for _ in range(2)]
    expected = generate(model, tokenizer, "the fox", 12, **settings, **extra)
    assert texts == [expected, expected]
    assert expected != generate(model, tokenizer, "the fox", 12)  # the settings did something


def test_a_prompt_that_extends_the_last_one_is_read_from_the_prompt_cache(server, local):
    """The second request starts with all the first one fed (its prompt and its answer but the
    last token): only the rest is run, and the answer is the one a local generation continued
    from the same cache gives. cache_prompt=false reads the whole prompt again."""
    model, tokenizer = local
    client = server.client()
    first = tokenizer.encode("the quick brown fox")
    plain = client.completions.create(model="tiny", prompt=first, max_tokens=6, extra_body={"cache_prompt": False})
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    cache = cpu_decode.generation_cache(model)  # as the server's
    tokens = [r.token for r in stream_generate(model, tokenizer, first, 6, cache=cache)]
    assert plain.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True) and len(tokens) == 6
    fed = first + tokens[:-1]
    second = fed + tokenizer.encode(" jumps over", add_special_tokens=False)
    reply = client.completions.create(model="tiny", prompt=second, max_tokens=8)
    assert reply.usage.prompt_tokens_details.cached_tokens == len(fed)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(second), 8)
    cache, kept = continue_cache(model, cache, fed, second)
    assert kept == len(fed)
    assert reply.choices[0].text == generate(model, tokenizer, second[kept:], 8, cache=cache, cached_ids=second[:kept])
    again = client.completions.create(model="tiny", prompt=second, max_tokens=8, extra_body={"cache_prompt": False})
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == generate(model, tokenizer, second, 8)


def test_a_continued_chat_reads_its_history_from_the_prompt_cache(server, local):
    model, tokenizer = local
    client = server.client()
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
    messages = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "and of spain?"}]
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, stream=True,
                                                   stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, tokenize=True))
    assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def _local_steps(model, tokenizer, prompt, max_tokens):
    """(token, logprobs [vocab] as numpy) of each step of a local greedy generation."""
    return [(r.token, np.array(r.logprobs)) for r in stream_generate(model, tokenizer, prompt, max_tokens)]


def test_chat_logprobs_are_the_generators_with_the_likeliest_alternatives(server, local):
    model, tokenizer = local
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True,
                                           top_logprobs=3, extra_body={"cache_prompt": False})
    steps = _local_steps(model, tokenizer, tokenizer.apply_chat_template(MESSAGES, tokenize=True), 6)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(steps) == 6
    for entry, (token, logprobs) in zip(content, steps):
        assert bytes(entry.bytes) == tokenizer.token_bytes(token)
        assert abs(entry.logprob - logprobs[token]) <= 1e-5 * max(1.0, abs(logprobs[token]))
        best = np.argsort(-logprobs, kind="stable")[:3]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tokenizer.token_bytes(int(i)) for i in best]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], logprobs[best], rtol=1e-5, atol=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen is the best
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True,
                                                   top_logprobs=3, stream=True, extra_body={"cache_prompt": False}))
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(p.token, p.logprob) for p in pieces] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_an_echoed_prompt_is_scored_token_by_token(server, local):
    """lm-evaluation-harness's way of scoring text: echo, logprobs, max_tokens 0 (or 1)."""
    model, tokenizer = local
    client = server.client()
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    scored = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    logits = np.array(model(np.array(ids[:-1])[None]))[0].astype(np.float64)  # the server's own call
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    wanted = expected[np.arange(len(ids) - 1), ids[1:]]
    assert choice.logprobs.tokens == [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], wanted, rtol=1e-4, atol=1e-4)
    for position, alternatives in enumerate(choice.logprobs.top_logprobs[1:]):
        best = np.argsort(-expected[position])[:2]
        names = [tokenizer.token_bytes(int(i)).decode("utf-8", "replace") for i in best]
        assert set(names) <= set(alternatives) and len(alternatives) <= 3  # the top 2 and the chosen
        assert choice.logprobs.tokens[position + 1] in alternatives
    answered = client.completions.create(model="tiny", prompt=text, max_tokens=3, echo=True, logprobs=0,
                                         extra_body={"cache_prompt": False})
    steps = _local_steps(model, tokenizer, text, 3)
    assert answered.choices[0].text == text + generate(model, tokenizer, text, 3)
    assert answered.choices[0].logprobs.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs
    np.testing.assert_allclose(answered.choices[0].logprobs.token_logprobs[len(ids):],
                               [lp[t] for t, lp in steps], rtol=1e-5, atol=1e-5)
    streamed = list(client.completions.create(model="tiny", prompt=text, max_tokens=3, echo=True, logprobs=0,
                                              stream=True, extra_body={"cache_prompt": False}))
    assert "".join(c.choices[0].text for c in streamed) == answered.choices[0].text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == answered.choices[0].logprobs.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == \
        answered.choices[0].logprobs.text_offset


def test_health_model_card_tokenize_and_detokenize(server, local):
    """llama.cpp's /health, /tokenize and /detokenize, and OpenAI's model retrieval."""
    _, tokenizer = local
    assert server.post("/health", None, method="GET", root=True) == (200, {"status": "ok"})
    status, card = server.post("/models/tiny", None, method="GET")
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
    assert server.client().models.retrieve("tiny").id == "tiny"
    text = "the quick brown fox, 日本語"
    status, answer = server.post("/tokenize", json.dumps({"content": text}).encode(), root=True)
    assert status == 200 and answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    status, with_bos = server.post("/tokenize", json.dumps({"content": text, "add_special": True}).encode(), root=True)
    assert with_bos["tokens"] == tokenizer.encode(text)
    status, answer = server.post("/detokenize", json.dumps({"tokens": answer["tokens"]}).encode(), root=True)
    assert status == 200 and answer["content"] == text


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", b'{"content": 5}', "content"),
    ("/tokenize", b'{}', "content"),
    ("/tokenize", b'{"content": "x", "add_special": "yes"}', "add_special"),
    ("/detokenize", b'{"tokens": [1, 100000]}', "tokens"),
    ("/detokenize", b'{"tokens": "1 2"}', "tokens"),
    ("/tokenize", b'not json', None),
])
def test_bad_tokenize_requests_get_openai_errors(server, route, body, param):
    status, answer = server.post(route, body, root=True)
    assert status == 400 and answer["error"]["param"] == param


def test_an_unknown_model_card_is_not_found(server):
    status, answer = server.post("/models/gpt-4o", None, method="GET")
    assert status == 404 and answer["error"]["code"] == "model_not_found"


BAD_REQUESTS = [  # (route, body, status, param)
    ("/completions", b'{"prompt": "x", "max_tokens": 5', 400, None),  # malformed JSON
    ("/completions", b'["prompt"]', 400, None),
    ("/completions", b'{"prompt": 7}', 400, "prompt"),
    ("/completions", b'{"prompt": [1, 100000]}', 400, "prompt"),
    ("/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/completions", b'{"prompt": "x", "temperature": true}', 400, "temperature"),
    ("/completions", b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("/completions", b'{"prompt": "x", "top_k": 2.5}', 400, "top_k"),
    ("/completions", b'{"prompt": "x", "stop": [3]}', 400, "stop"),
    ("/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("/completions", b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    ("/completions", b'{"prompt": "x", "logprobs": true}', 400, "logprobs"),
    ("/completions", b'{"prompt": "x", "echo": "yes"}', 400, "echo"),
    ("/completions", b'{"prompt": "x", "max_tokens": 0, "echo": false}', 400, "max_tokens"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400,
     "top_logprobs"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
                          b'"top_logprobs": -1}', 400, "top_logprobs"),
    ("/completions", b'{"prompt": "x", "model": "gpt-4o"}', 404, "model"),
    ("/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    ("/nowhere", b"{}", 404, None),
]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, route, body, status, param):
    got, answer = server.post(route, body)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    assert server.client().completions.create(model="tiny", prompt="the", max_tokens=2).choices[0].text


def test_a_prompt_beyond_the_context_is_refused_through_the_client(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().completions.create(model="tiny", prompt="the quick " * 3000, max_tokens=4)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert "context is 4096 tokens" in refused.value.body["message"]


def test_an_unknown_model_name_is_not_found_through_the_client(server):
    with pytest.raises(openai.NotFoundError) as refused:
        server.client().chat.completions.create(model="someone-else", messages=MESSAGES)
    assert refused.value.body["code"] == "model_not_found" and "'tiny'" in refused.value.body["message"]


def test_concurrent_requests_each_get_their_own_answer(server):
    prompts = ["the quick", "in the beginning", "def main", "paris is", "the lazy dog", "was with"]
    client = server.client()

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    assert len(set(alone)) > 1


def test_a_client_that_goes_away_mid_stream_frees_the_model(server):
    """The stream is dropped after three chunks of 4,000 wanted tokens: the server stops that
    generation at once (its log line says how far it got) and answers the next request."""
    client = server.client()
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4000, stream=True)
    chunks = [chunk for chunk, _ in zip(stream, range(3))]
    stream.close()
    assert client.completions.create(model="tiny", prompt="the", max_tokens=3).usage.completion_tokens == 3
    line = rf"{chunks[0].id}: \d+ prompt \+ (\d+) generated tokens, client gone"
    deadline = time.monotonic() + 10
    while not (ended := re.search(line, server.log.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended, server.log.read_text()[-2000:]
    assert int(ended.group(1)) < 400


@pytest.mark.parametrize("option, value", [("--parallel", "0"), ("--max-queue", "-1"), ("--max-tokens-limit", "0"),
                                           ("--max-body-bytes", "0")])
def test_serve_refuses_a_limit_out_of_range_without_a_traceback(option, value, capsys):
    assert cli.main(["serve", option, value, "--port", "0"]) == 1
    assert f"{option} must be at least" in capsys.readouterr().err


def test_serve_reports_a_missing_model_file_without_a_traceback(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path / "missing.gguf"), "--port", "0"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


# --- tools ----------------------------------------------------------------------------------------


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALLS = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
         '<tool_call>{"name": "now", "arguments": "{}"}</tool_call> done')


def test_tool_call_blocks_become_tool_calls_however_the_text_is_split():
    whole = server_module.ToolCallText()
    content = whole.add(CALLS)
    rest, calls = whole.finish()
    assert content + rest == "Let me look. done"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "{}" and calls[0]["type"] == "function"
    assert calls[0]["id"] != calls[1]["id"]
    for size in (1, 2, 3, 7):
        pieces = server_module.ToolCallText()
        out = "".join(pieces.add(CALLS[i : i + size]) for i in range(0, len(CALLS), size))
        rest, split = pieces.finish()
        assert out + rest == "Let me look. done"
        assert [c["function"] for c in split] == [c["function"] for c in calls]


@pytest.mark.parametrize("text", ["a <tool_call>not json</tool_call> b", "a <tool_call>[1, 2]</tool_call>",
                                  "ends with <tool_", 'cut off <tool_call>{"name": "f"'])
def test_text_that_is_not_a_tool_call_stays_content(text):
    calls_text = server_module.ToolCallText()
    out = calls_text.add(text)
    rest, calls = calls_text.finish()
    assert out + rest == text and calls == []


def test_chat_messages_take_tool_calls_and_tool_results():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rendered = server_module.chat_messages({"messages": messages})
    assert rendered[1]["content"] == "" and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == messages[2]
    for bad in ([{"role": "user", "content": "x", "tool_calls": []}],
                [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
                [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]):
        with pytest.raises(server_module.RequestError) as refused:
            server_module.chat_messages({"messages": bad})
        assert refused.value.param == "messages"
    assert server_module.chat_tools({"tools": TOOLS}) == TOOLS
    assert server_module.chat_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    with pytest.raises(server_module.RequestError, match="'tools' must be"):
        server_module.chat_tools({"tools": [{"type": "function"}]})


@dataclass
class _Response:
    """The generator's BatchResponse, as the server reads it."""
    uid: int
    token: int
    text: str
    logprobs: object
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    cache: list | None = None
    cached_ids: list | None = None


TOOLS_TEMPLATE = (
    "{% if tools %}<|start|>system<|message|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|eot|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|eot|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_tools_renders_them_and_answers_tool_calls(tmp_path, monkeypatch, stream):
    """In process (Starlette's test client), the model's answer made up: the tools and the
    earlier calls reach the template, and a tool call in the answer comes back as tool_calls."""
    from starlette.testclient import TestClient

    prompts = []

    class Answering:
        """The generator's interface, its one answer made up: CALLS, five characters a token."""

        def __init__(self, model, tokenizer, **settings):
            self.pieces = {}

        def insert(self, prompt, max_tokens=256, **options):
            prompts.append(list(prompt))
            self.pieces[len(prompts)] = [CALLS[i : i + 5] for i in range(0, len(CALLS), 5)]
            return len(prompts)

        def remove(self, uid):
            self.pieces.pop(uid, None)

        @property
        def has_work(self):
            return bool(self.pieces)

        def next(self):
            out = []
            for uid, pieces in list(self.pieces.items()):
                text = pieces.pop(0)
                out.append(_Response(uid, 7, text, None, None if pieces else "stop", len(prompts[-1]), 0, 1))
                if not pieces:
                    del self.pieces[uid]
            return out

    monkeypatch.setattr(server_module, "BatchGenerator", Answering)
    path = tiny_model(tmp_path / "t.gguf", "llama", np.random.default_rng(1), weights="Q8_0", context=512)
    service = server_module.ModelService(path)
    service.tokenizer.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "weather in paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with TestClient(server_module.create_app(service)) as client:
        reply = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "stream": stream})
    service.close()
    assert reply.status_code == 200
    text = service.tokenizer.decode(prompts[0])
    assert "get_weather;" in text and '<tool_call>get_weather {"city": "Rome"}</tool_call>' in text and "sunny" in text
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
        finishes = [e["choices"][0]["finish_reason"] for e in events]
        assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    else:
        message = reply.json()["choices"][0]["message"]
        content, calls = message["content"], message["tool_calls"]
        assert reply.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert content == "Let me look. done"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("now", {})]


# --- prompt caches --------------------------------------------------------------------------------


@dataclass
class _Layer:
    nbytes: int


def test_prompt_caches_hand_out_the_entry_whose_whole_prompt_a_new_one_starts_with():
    caches = server_module.PromptCaches(budget=10_000)
    system = list(range(100))
    ada, bob = [_Layer(1000)], [_Layer(1000)]
    caches.put(system + [7, 7, 50, 51], 102, ada)  # prompt: system + [7, 7]; answer [50, 51]
    caches.put(system + [8, 8, 60], 102, bob)
    assert caches.take(system + [9, 9]) == (None, [])  # shares only the system part: left alone
    cache, held = caches.take(system + [7, 7, 50, 52, 3])  # ada's prompt, her answer re-tokenized
    assert cache is ada and held == system + [7, 7, 50, 51]
    assert caches.take(system + [7, 7, 50, 52, 3]) == (None, [])  # taken: in use until put back
    assert caches.take(system + [8, 8, 60, 1])[0] is bob


def test_prompt_caches_drop_the_least_recently_used_beyond_the_budget():
    caches = server_module.PromptCaches(budget=2500)
    for user in range(3):
        caches.put([user, 1, 2], 2, [_Layer(1000)])
    assert caches.nbytes == 2000
    assert caches.take([0, 1, 2, 3]) == (None, [])  # the oldest went
    assert caches.take([1, 1, 2, 3])[1] == [1, 1, 2] and caches.take([2, 1, 5])[1] == [2, 1, 2]
    caches.put([5, 5], 1, [_Layer(3000)])  # larger than the whole budget: not kept
    assert caches.nbytes == 0


def test_a_failing_step_ends_its_requests_and_the_server_goes_on(tmp_path, monkeypatch):
    """In process, the generator made up: its first step raises; that request gets a 500, the
    model thread lives on and the next request is answered."""
    from starlette.testclient import TestClient

    class FailingOnce:
        def __init__(self, model, tokenizer, **settings):
            self.waiting, self.failed = [], False

        def insert(self, prompt, max_tokens=256, **options):
            self.waiting.append(len(self.waiting) + 1)
            return self.waiting[-1]

        def remove(self, uid):
            self.waiting.remove(uid)

        @property
        def has_work(self):
            return bool(self.waiting)

        def next(self):
            if not self.failed:
                self.failed = True
                raise RuntimeError("the step broke")
            return [_Response(self.waiting.pop(), 7, "seven", None, "stop", 3, 0, 1)]

    monkeypatch.setattr(server_module, "BatchGenerator", FailingOnce)
    service = server_module.ModelService(tiny_model(tmp_path / "t.gguf", "llama", np.random.default_rng(1),
                                                    weights="Q8_0", context=512))
    with TestClient(server_module.create_app(service), raise_server_exceptions=False) as client:
        failed = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 3})
        answered = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 3})
    service.close()
    assert failed.status_code == 500
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == "seven"
