"""`muser serve` under load, and its prompt cache.

`load` (the default): the server (default model: the packaged SmolLM2-135M-Instruct) on a free
port; at each concurrency (1, 8, 16, 64) that many clients stream greedy chat answers at once,
each taking the next of `--requests` requests (64) from a shared pool as its last one ends.
Per request: time to the first token (TTFT) and the gaps between streamed tokens (inter-token
latency); per level: their p50 / p95, the aggregate generated tokens/s (all requests' tokens
over the level's wall time, ramp and tail included), the steady tokens/s (while all clients
were at work) and the server's resident memory before, at peak and after (idle again).

    python bench/serve.py load [--model FILE] [--concurrency 1,8,16,64] [--max-tokens 256] [-- SERVE OPTIONS]

`cache`: a chat's next turn with and without the prompt cache. A conversation whose system
message is long (--history tokens of text; plain-text turns through /v1/completions where the
file has no chat template): turn 1, then turn 2 (turn 1's answer and a new question appended)
twice in alternation, with `"cache_prompt": false` (the whole prompt read again) and with the
cache (turn 1's prompt and answer read from it); turn 1 is asked again before each so the
cache holds what a chat's second turn would find. Each request streams 16 tokens; the figures
are the best of --runs: time to the first token and the whole request, with the usage counts.

    python bench/serve.py cache [--model FILE] [--history 1500] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import packaged  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "from the north and the south met to exchange salt, grain and cloth. ")


def start(model: Path, folder: Path, options=()):
    out, err = open(folder / "stdout.txt", "w"), open(folder / "stderr.txt", "w")
    process = subprocess.Popen([sys.executable, "-m", "muser_mlx.cli", "serve", "--model", str(model),
                                "--port", "0", *options], stdout=out, stderr=err)
    deadline = time.monotonic() + 300
    while not (found := re.search(r"at (http://\S+/v1)", (folder / "stdout.txt").read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"muser serve did not start: {(folder / 'stderr.txt').read_text()[-2000:]}")
        time.sleep(0.1)
    return process, found.group(1)


def ask(url: str, turn, cache_prompt: bool, max_tokens: int = 16):
    """(seconds to the first text, seconds in all, answer, usage) of one streamed request: a chat
    (turn: messages) or a plain completion (turn: text)."""
    chat = isinstance(turn, list)
    body = json.dumps({"messages" if chat else "prompt": turn, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0, "stream_options": {"include_usage": True},
                       "cache_prompt": cache_prompt}).encode()
    request = urllib.request.Request(url + ("/chat/completions" if chat else "/completions"), data=body,
                                     headers={"Content-Type": "application/json"})
    tic = time.perf_counter()
    first, text, usage = None, "", None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                piece = choice["delta"].get("content") if chat else choice.get("text")
                if piece:
                    first = first or time.perf_counter() - tic
                    text += piece
    return first, time.perf_counter() - tic, text, usage


def cache(args) -> None:
    model = args.model or packaged.model_path()
    words = len(TEXT.split())
    system = TEXT * max(1, args.history * 3 // (4 * words))  # ~0.75 words a token
    questions = ["Where did the traders meet?", "What did they exchange?"]
    with tempfile.TemporaryDirectory() as folder:
        process, url = start(model, Path(folder))
        try:
            turn1 = [{"role": "system", "content": system}, {"role": "user", "content": questions[0]}]
            try:
                _, _, answer, usage1 = ask(url, turn1, cache_prompt=False)  # warm-up
                turn2 = turn1 + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": questions[1]}]
                kind = "chat"
            except urllib.error.HTTPError:  # no chat template in the file: plain text turns
                turn1 = f"{system}\nQ: {questions[0]}\nA:"
                _, _, answer, usage1 = ask(url, turn1, cache_prompt=False)
                turn2 = f"{turn1}{answer}\nQ: {questions[1]}\nA:"
                kind = "completion"
            best = {}
            for _ in range(args.runs):
                for cached in (False, True):
                    ask(url, turn1, cache_prompt=False)  # the cache as a second turn finds it
                    first, whole, _, usage = ask(url, turn2, cache_prompt=cached)
                    old = best.get(cached)
                    if old is None or first < old[0]:
                        best[cached] = (first, whole, usage)
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"{model.name} ({kind}s): turn 1 prompt {usage1['prompt_tokens']} tokens; turn 2 (16 tokens "
          f"streamed), best of {args.runs}")
    for cached in (False, True):
        first, whole, usage = best[cached]
        print(f"  cache_prompt={str(cached).lower():5}  prompt {usage['prompt_tokens']} tokens, "
              f"{usage['prompt_tokens_details']['cached_tokens']} cached: first token {first * 1e3:7.1f} ms, "
              f"request {whole * 1e3:7.1f} ms")
    print(f"  first token {best[False][0] / best[True][0]:.1f}x sooner with the cache")



# --- load -----------------------------------------------------------------------------------------

QUESTIONS = ["Name three colours.", "What is the capital of France?", "Write a haiku about rain.",
             "How do plants make food?", "Explain what a prime number is.", "Give me a tip for sleeping well.",
             "What is the tallest mountain?", "Why is the sky blue?", "Describe a cat in one sentence.",
             "What does a compiler do?", "Suggest a name for a dog.", "How far away is the moon?",
             "What is photosynthesis?", "Tell me a fun fact about octopuses.", "What is 17 times 3?",
             "Translate 'good morning' into Spanish."]


def rss(pid: int) -> int:
    """Resident bytes of a process (Linux)."""
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


def stream_chat(url: str, question: str, max_tokens: int) -> tuple[float, list[float], int, list[float]]:
    """(seconds to the first token, seconds between successive tokens' events, tokens generated,
    the clock times of the token events) of one streamed chat request."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "stream": True, "temperature": 0, "stream_options": {"include_usage": True},
                       "cache_prompt": False}).encode()
    request = urllib.request.Request(url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    tic = time.perf_counter()
    times, tokens = [], 0
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return times[0] - tic, list(np.diff(times)), tokens, times


def level(url: str, pid: int, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` clients at once, each taking the next of `requests` requests from a shared pool
    as soon as its last one ends. Steady tokens/s: the token events while all `clients` were
    still at work (from the last client's first token to the first client finding the pool
    empty) over that window; the whole level's figure also holds the ramp and the tail, where
    fewer requests run than there are clients."""
    peak, done = [rss(pid)], threading.Event()
    pool, lock = iter(range(requests)), threading.Lock()
    firsts, empties = [], []

    def watch():
        while not done.wait(0.02):
            peak.append(rss(pid))

    def client(i: int):
        out = []
        while True:
            with lock:
                r = next(pool, None)
            if r is None:
                empties.append(time.perf_counter())
                return out
            out.append(stream_chat(url, QUESTIONS[r % len(QUESTIONS)], max_tokens))
            if len(out) == 1:
                firsts.append(out[0][3][0])

    before = rss(pid)
    watcher = threading.Thread(target=watch)
    watcher.start()
    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as executor:
        results = [one for many in executor.map(client, range(clients)) for one in many]
    wall = time.perf_counter() - tic
    done.set()
    watcher.join()
    time.sleep(1.0)  # the model thread gives memory back once idle
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    start, end = max(firsts), min(empties)
    # A window shorter than a quarter of the level (one request a client) says nothing steady.
    steady = sum(start <= t < end for r in results for t in r[3]) / (end - start) \
        if end - start > wall / 4 else float("nan")
    return {"clients": clients, "requests": len(results), "tokens": sum(r[2] for r in results), "wall": wall,
            "ttft": np.percentile(ttft, [50, 95]), "itl": np.percentile(gaps, [50, 95]), "steady": steady,
            "rss": (before, max(peak), rss(pid))}


def load(args, serve_options: list[str]) -> None:
    model = args.model or packaged.model_path()
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        process, url = start(model, Path(folder), serve_options)
        try:
            stream_chat(url, "Hello!", 8)  # warm-up: the first step builds what later ones reuse
            rows = [level(url, process.pid, c, max(args.requests, c), args.max_tokens) for c in levels]
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"{model.name}: streamed chats of up to {args.max_tokens} tokens (greedy), "
          f"muser serve {' '.join(serve_options) or '(defaults)'}")
    print("| clients | requests | TTFT p50 / p95 (ms) | inter-token p50 / p95 (ms) | aggregate tokens/s | "
          "steady tokens/s (x one client) | RSS before / peak / after (MB) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    one = next((row["steady"] for row in rows if row["clients"] == 1), None)
    for row in rows:
        before, peak, after = (value / 1e6 for value in row["rss"])
        steady = row["steady"]
        ratio = f" ({steady / one:.2f}x)" if one and steady == steady else ""
        steady = f"{steady:.1f}" if steady == steady else "-"
        print(f"| {row['clients']} | {row['requests']} | {row['ttft'][0] * 1e3:,.0f} / {row['ttft'][1] * 1e3:,.0f} | "
              f"{row['itl'][0] * 1e3:.1f} / {row['itl'][1] * 1e3:.1f} | {row['tokens'] / row['wall']:.1f} | "
              f"{steady}{ratio} | {before:.0f} / {peak:.0f} / {after:.0f} |")


def main() -> None:
    argv = sys.argv[1:]
    serve_options = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode")
    load_parser = modes.add_parser("load", help="TTFT, inter-token latency and tokens/s at several concurrencies")
    load_parser.add_argument("--concurrency", default="1,8,16,64")
    load_parser.add_argument("--max-tokens", type=int, default=256)
    load_parser.add_argument("--requests", type=int, default=64, help="requests a level (at least one a client)")
    cache_parser = modes.add_parser("cache", help="a chat's second turn with and without the prompt cache")
    cache_parser.add_argument("--history", type=int, default=1500, help="about this many tokens of system text")
    cache_parser.add_argument("--runs", type=int, default=3)
    for mode in (load_parser, cache_parser):
        mode.add_argument("--model", type=Path, default=None)
    args = parser.parse_args(argv if argv and argv[0] in ("load", "cache") else ["load", *argv])
    if args.mode == "cache":
        cache(args)
    else:
        load(args, serve_options)


if __name__ == "__main__":
    main()
