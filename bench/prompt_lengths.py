"""Time to first token for prompts of lengths a process has not seen, on full-scale Muse Glimmer.

A GPU prefill chunk's attention is MLX's fused attention, which on CUDA builds a cuDNN graph for
each shape it has not seen (38-62 ms each on the H200: bench/prefill_attention.py). A prompt's
last chunk has its own row and key counts, so a process serving prompts of many lengths pays
that again and again unless the shapes are bucketed (Settings.attention_key_bucket).
This loads (writing it first if absent) the random-weight file bench/decode.py writes, runs a
warm-up prompt (the process's first attention pays cuDNN's own start), then each length of
--lengths in turn as generate() starts a reply: prefill in 512-row chunks plus the last token's
decode step, into a fresh cache, until the first token is on the host. It prints each prompt's
time and how many attention shapes (q, keys, mask) the process met for the first time in it.

    python bench/prompt_lengths.py [--dir /dev/shm] [--lengths 300,301,...] [--warm 512]
                                   [--set field=value ...]

Run once as it is and once with `--set attention_key_bucket=0` (the model loaded with those
muser_mlx.settings.Settings; each process starts with no cuDNN graphs: compare processes, not
prompts within one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode  # noqa: E402
from muser_mlx.generate import feed, load  # noqa: E402
from muser_mlx.generate import decode as decode_token  # noqa: E402
from settings_cli import HELP, settings_from  # noqa: E402

LENGTHS = "5,9,300,301,777,1000,1234,1500,2047,2300,3001,3500,4100,300,1000,3001,302,1001,3002,4000"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--lengths", default=LENGTHS)
    parser.add_argument("--warm", type=int, default=512, help="the warm-up prompt's length (0: none)")
    parser.add_argument("--layers", type=int, default=decode.LAYERS, help="fewer layers: a quick smoke run")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"load the model with these settings: {HELP}")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n < 2 for n in lengths) or args.warm == 1:
        parser.error("prompts need at least 2 tokens")
    settings = settings_from(args.set)

    shapes, met = set(), []
    real_attention = mx.fast.scaled_dot_product_attention

    def counted(q, k, v, *, scale, mask=None, **kwargs):
        kind = mask if isinstance(mask, str) or mask is None else tuple(mask.shape)
        key = (tuple(q.shape), tuple(k.shape), kind)
        if key not in shapes:
            shapes.add(key)
            met.append(key)
        return real_attention(q, k, v, scale=scale, mask=mask, **kwargs)

    mx.fast.scaled_dot_product_attention = counted
    rng = np.random.default_rng(0)
    path = Path(args.dir) / f"muse-glimmer-random-{args.layers}.gguf"
    if not path.exists():
        decode.write_file(path, rng, args.layers)
    model, _ = load(path, settings=settings)
    print(f"device: {mx.default_device()}; {args.layers} layers; settings {args.set or 'none'}", flush=True)

    def first_token(length: int) -> tuple[float, float]:
        """ms of (the whole, of it the last token's step), as generate.prefill runs them."""
        ids = rng.integers(0, decode.VOCAB, size=length).tolist()
        cache = model.make_cache()
        tic = time.perf_counter()
        feed(model, ids[:-1], cache)  # generate.prefill's chunks
        chunks = time.perf_counter()
        logits, greedy = decode_token(model, mx.array([ids[-1:]], dtype=mx.int32), cache, prompt=True)
        (greedy if greedy is not None else mx.argmax(logits)).item()
        end = time.perf_counter()
        return 1e3 * (end - tic), 1e3 * (end - chunks)

    if args.warm:
        print(f"warm-up, {args.warm} tokens: {first_token(args.warm)[0]:.1f} ms", flush=True)
    seen, totals = set(), {"new": [], "again": []}
    print("tokens | ms to the first token (of it the last token's step) | tokens/s | new attention "
          "shapes: q rows x keys, mask")
    for length in lengths:
        met.clear()
        ms, last = first_token(length)
        repeat = length in seen
        seen.add(length)
        totals["again" if repeat else "new"].append(ms)
        new = "; ".join(f"{q[2]}x{k[2]} {mask if isinstance(mask, str) else 'mask'}" for q, k, mask in met)
        print(f"{length}{' (again)' if repeat else ''} | {ms:.1f} ({last:.1f}) | {length / ms * 1e3:,.0f} | "
              f"{len(met)}: {new or '-'}", flush=True)
    for kind, times in totals.items():
        if times:
            print(f"{kind} lengths: {len(times)} prompts, {sum(times):.0f} ms in all", flush=True)
    mx.fast.scaled_dot_product_attention = real_attention


if __name__ == "__main__":
    main()
