"""`muser serve`'s prompt cache: a chat's next turn with and without it.

Starts `muser serve` on a model (default: the packaged SmolLM2-135M-Instruct) on a free port,
then runs a conversation whose system message is long (--history tokens of text; plain-text
turns through /v1/completions where the file has no chat template): turn 1, then
turn 2 (turn 1's answer and a new question appended) twice in alternation, with
`"cache_prompt": false` (the whole prompt read again) and with the cache (turn 1's prompt and
answer read from it); turn 1 is asked again before each so the cache holds what a chat's
second turn would find. Each request streams 16 tokens; the figures are the best of --runs:
time to the first token (what a user waits for) and the whole request, with the server's
usage counts.

    python bench/serve.py [--model FILE] [--history 1500] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import packaged  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "from the north and the south met to exchange salt, grain and cloth. ")


def start(model: Path, folder: Path):
    out, err = open(folder / "stdout.txt", "w"), open(folder / "stderr.txt", "w")
    process = subprocess.Popen([sys.executable, "-m", "muser_mlx.cli", "serve", "--model", str(model),
                                "--port", "0"], stdout=out, stderr=err)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--history", type=int, default=1500, help="about this many tokens of system text")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
