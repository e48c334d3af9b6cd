"""`muser serve` under load and bad input: many streaming clients at once (some hanging up),
the queue, body and max_tokens limits, /health while a huge body is read, per-user prompt
caches, memory after load. Real server processes on 127.0.0.1, the official openai client."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")  # the server's web stack ([serve] extra)
openai = pytest.importorskip("openai")

from muser_mlx.generate import generate, load  # noqa: E402
from muser_mlx.testing import tiny_model  # noqa: E402
from test_server import serving  # noqa: E402

CLIENTS, HANGING_UP = 16, (3, 7, 12)  # 16 streams; these three go away after a few chunks
PROMPTS = [f"{word} the quick brown fox number {n}" for n, word in
           zip(range(CLIENTS), ["in", "def", "paris", "the", "was", "a", "so", "we"] * 2)]
SYSTEM = "you are a patient assistant who answers every question about the old city in detail. " * 12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("load") / "tiny.gguf", "llama", np.random.default_rng(0),
                      weights="Q8_0", context=4096)


@pytest.fixture(scope="module")
def busy(model_path, tmp_path_factory):
    """A server of four slots and a queue long enough for the 16 clients (default body limit)."""
    with serving(model_path, tmp_path_factory.mktemp("busy"), "--parallel", "4", "--max-queue", "16") as running:
        yield running


@pytest.fixture(scope="module")
def tight(model_path, tmp_path_factory):
    """A server of one slot, one waiting place and small bodies."""
    with serving(model_path, tmp_path_factory.mktemp("tight"), "--parallel", "1", "--max-queue", "1",
                 "--max-body-bytes", "4KiB") as running:
        yield running


@pytest.fixture(scope="module")
def capped(model_path, tmp_path_factory):
    """A server that generates at most 5 tokens a request."""
    with serving(model_path, tmp_path_factory.mktemp("capped"), "--max-tokens-limit", "5") as running:
        yield running


@pytest.fixture(scope="module")
def local(model_path):
    return load(model_path)


def test_sixteen_streams_at_once_each_get_their_answer_alone(busy, local):
    """16 streamed completions at once, four slots: the three that hang up mid-stream free
    their slots (their log lines end "client gone" long before their 3,000 tokens), and every
    other stream's text is the greedy answer its prompt gets alone."""
    model, tokenizer = local
    client = busy.client()
    wanted = {i: generate(model, tokenizer, prompt, 24) for i, prompt in enumerate(PROMPTS) if i not in HANGING_UP}

    def stream(i: int):
        if i in HANGING_UP:
            chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=3000, stream=True)
            first = [chunk for chunk, _ in zip(chunks, range(3))]
            chunks.close()
            return first[0].id
        chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=24, stream=True,
                                           extra_body={"cache_prompt": False})
        return "".join(chunk.choices[0].text for chunk in chunks)

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = dict(zip(range(CLIENTS), pool.map(stream, range(CLIENTS))))
    assert {i: answers[i] for i in wanted} == wanted
    assert len(set(wanted.values())) > 1
    for i in HANGING_UP:
        line = rf"{answers[i]}: \d+ prompt \+ (\d+) generated tokens, client gone"
        deadline = time.monotonic() + 30
        while not (ended := re.search(line, busy.log.read_text())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended, busy.log.read_text()[-3000:]
        assert int(ended.group(1)) < 1500


def test_health_answers_within_50_ms_while_a_10_mb_body_is_handled(busy):
    """A 10 MB prompt (under the default 16 MiB body limit, far beyond the context) is read,
    parsed and refused off the event loop: /health answers meanwhile. The bound asserted is
    4x the 50 ms target, so that a loaded 2-core machine does not fail it; reading and
    tokenizing on the event loop took 10-13 s."""
    body = json.dumps({"prompt": "The history of the city begins on the river. " * 230_000,
                       "max_tokens": 4}).encode()
    assert len(body) > 10_000_000
    host, port = busy.url.removeprefix("http://").removesuffix("/v1").split(":")
    outcome = {}

    def big():
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        outcome["status"], outcome["answer"] = response.status, json.loads(response.read())

    sender = threading.Thread(target=big)
    health = http.client.HTTPConnection(host, int(port), timeout=30)
    waits = []  # of the /health requests sent while the big one was in flight
    sender.start()
    while sender.is_alive():
        tic = time.perf_counter()
        health.request("GET", "/health")
        assert health.getresponse().read() == b'{"status":"ok"}'
        waits.append(time.perf_counter() - tic)
    sender.join()
    assert outcome["status"] == 400 and outcome["answer"]["error"]["code"] == "context_length_exceeded"
    assert len(waits) >= 5 and max(waits) < 0.2, (len(waits), sorted(waits)[-5:])


def test_two_users_alternating_chats_each_read_their_own_history(busy, local):
    """Two conversations with the same long system message, turns interleaved: each second
    turn reads its own first turn (prompt and answer) from the prompt caches, where one shared
    cache gave it only the system message."""
    _, tokenizer = local
    client = busy.client()
    users = {name: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"I am {name}. hello"}]
             for name in ("ada", "bob")}
    firsts = {}
    for name, messages in users.items():
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        firsts[name] = reply.usage.prompt_tokens
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    system_only = len(tokenizer.apply_chat_template(users["ada"][:1], add_generation_prompt=False, tokenize=True))
    for name, messages in users.items():
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert firsts[name] <= cached < reply.usage.prompt_tokens, (name, cached, system_only)


def test_beyond_the_queue_a_request_gets_429_with_retry_after(tight):
    """One slot and one waiting place, both taken by long streams: a third request is refused
    at once (OpenAI's error body, Retry-After), and served once the others are gone."""
    client = tight.client()
    streams = []
    for _ in range(2):  # a chat stream's first chunk (the role) comes as soon as it is admitted
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4000, stream=True)
        next(iter(stream))
        streams.append(stream)
    status, answer, headers = tight.request("/completions", b'{"prompt": "the", "max_tokens": 2}')
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert int(headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="the", max_tokens=2)
    for stream in streams:
        stream.close()
    deadline = time.monotonic() + 30
    while (status := tight.post("/completions", b'{"prompt": "the", "max_tokens": 2}')[0]) == 429:
        assert time.monotonic() < deadline, "the slots were not given back"
        time.sleep(0.05)
    assert status == 200


def test_a_plain_request_whose_client_goes_away_frees_its_slot(tight):
    """A non-streamed request for 4,000 tokens whose client hangs up at once: its sequence is
    removed (its log line ends "client gone" with fewer tokens) and the one slot serves the next."""
    before = tight.log.read_text().count("client gone")
    host, port = tight.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 4000}).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while tight.log.read_text().count("client gone") == before:
        assert time.monotonic() < deadline, tight.log.read_text()[-2000:]
        time.sleep(0.05)
    ended = re.findall(r"text_completion \S+: (?:no tokens|\d+ prompt \+ (\d+) generated tokens), client gone",
                       tight.log.read_text())
    assert ended and int(ended[-1] or 0) < 4000
    assert tight.post("/completions", b'{"prompt": "the", "max_tokens": 2}')[0] == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_beyond_the_limit_gets_413(tight, chunked):
    """A 4 KiB limit: a larger body is refused whether it declares its length or is chunked."""
    body = json.dumps({"prompt": "word " * 1000, "max_tokens": 2}).encode()
    host, port = tight.url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    if chunked:
        connection.request("POST", "/v1/completions", iter([body[:3000], body[3000:]]),
                           {"Content-Type": "application/json"}, encode_chunked=True)
    else:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == 413 and answer["error"]["code"] == "request_too_large"
    assert "4,096 bytes" in answer["error"]["message"]
    assert tight.post("/completions", b'{"prompt": "the", "max_tokens": 2}')[0] == 200


def test_max_tokens_is_capped_by_the_server_limit_and_the_context(capped, local):
    model, tokenizer = local
    client = capped.client()
    reply = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=10**9)
    assert reply.usage.completion_tokens <= 5 and reply.choices[0].text == generate(model, tokenizer,
                                                                                      "the quick brown", 5)
    near_the_end = tokenizer.encode("the quick brown fox " * 2000)[: model.config.context - 2]
    reply = client.completions.create(model="tiny", prompt=near_the_end, max_tokens=5)
    assert reply.usage.completion_tokens <= 3


def _rss(pid: int) -> int:
    """Resident bytes of a process (Linux)."""
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


def test_memory_returns_after_load(model_path, tmp_path):
    """16 prompts of ~1,650 tokens at once (~55 MB of KV cache beside a ~75 MB process): once
    they are answered the process is back within 10 % of its size before them (finished
    caches are not kept here: --prompt-cache-memory 0; it went from 73 to 240 MB before
    the idle model thread gave memory back)."""
    long = "the quick brown fox jumps over the lazy dog " * 75
    with serving(model_path, tmp_path, "--parallel", "16", "--prompt-cache-memory", "0") as server:
        client = server.client()
        client.completions.create(model="tiny", prompt="warm up", max_tokens=4)
        before = _rss(server.pid)

        def ask(i):
            return client.completions.create(model="tiny", prompt=f"{i} {long}", max_tokens=16).usage

        peak = before
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = [pool.submit(ask, i) for i in range(CLIENTS)]
            while not all(answer.done() for answer in answers):
                peak = max(peak, _rss(server.pid))
                time.sleep(0.01)
        assert all(answer.result().completion_tokens > 0 for answer in answers)
        assert peak > 1.3 * before  # the load did take memory
        deadline = time.monotonic() + 10  # the model thread gives memory back as it goes idle
        while (after := _rss(server.pid)) > 1.1 * before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert after <= 1.1 * before, (before, peak, after)
