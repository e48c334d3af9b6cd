"""Aggregate decode tokens/s of B sequences at once (muser_mlx.batch's steps), the shape of
llama.cpp's `llama-batched-bench -npp P -ntg N -npl B...`: B sequences of a P-token prompt each,
then N decode steps of all B, timed (S_TG = B * N / time). Each step is what BatchGenerator.next()
runs: B = 1 generate()'s own step for one sequence, B >= 2 the batched step; pipelined as the
generator and generate() run them (the next step built and queued from the tokens still on the
device, then the last step's tokens read back), so the host's build overlaps the device's step.

Floor = bytes one step reads (every weight once, plus each row's keys and values up to its
position, mid-run) / copy bandwidth measured in the same run.

    python bench/batch.py [--model FILE | --dir /dev/shm --keep] [--batches 1,8,32,64] [--prompt 128] [--steps 128]
      (no --model: the full-scale random-weight Muse Glimmer file of bench/decode.py, written once)
    python bench/batch.py --model default   # the packaged SmolLM2 (the CPU)
    --parts: the products alone a step; --each: each product of layer 0 and the head alone (ms,
    floor, GB/s, int8 multiply-adds a second); --both: the other product form too, same run;
    --set field=value: the model's Settings; --variant NAME:field=value,...: each B >= 2 also with
    the model rebuilt with those settings, same run (bench/settings_cli.py), e.g.
    --set batch_tiles_from=1 --variant w8:tile_warps=8 --variant t1k:tile_threadgroups=1024
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from muser_mlx import kernels, packaged  # noqa: E402
from muser_mlx.generate import decode, feed, load  # noqa: E402
from muser_mlx.models import cpu_decode  # noqa: E402
from muser_mlx.models.batch_decode import BatchKV, BatchStep  # noqa: E402
from settings_cli import HELP, parse_variant, rebuilt, settings_from  # noqa: E402


def copy_rate() -> float:
    if kernels.backend() == "cpu":  # a 256 MB memcpy (numpy), read + write bytes counted
        a, b = np.ones(64 << 20, dtype=np.float32), np.empty(64 << 20, dtype=np.float32)
        runs = []
        for _ in range(5):
            tic = time.perf_counter()
            np.copyto(b, a)
            runs.append(time.perf_counter() - tic)
        return 2 * a.nbytes / min(runs)
    from ceiling import copy_bandwidth
    return copy_bandwidth(4 << 30)


def kv_bytes_read(model, positions: int, dtype_bytes: int) -> int:
    """Keys and values one row's step reads at `positions` positions (windows capped)."""
    c = model.config
    per = 2 * c.kv_heads * c.head_dim * dtype_bytes
    return sum(per * (positions if not s else min(positions, c.sliding_window)) for s in c.swa_layers)


BUILD_MS = {}  # B -> the host's ms a step to build the batched step's graph


def run_batch(model, prompt_cache, batch: int, prompt: int, steps: int, rng, tiles: bool | None = None,
              timed=contextlib.nullcontext, launch_settings=None) -> float:
    """Seconds for `steps` steps of `batch` sequences that each hold `prompt` positions (tiles,
    launch_settings: BatchStep's). timed: a context manager made around the timed steps alone (a
    profiler's mark: bench/timeline.py leaves out the batch's setup and warm-up steps by it)."""
    vocab = model.config.vocab
    if batch == 1:
        copy = BatchKV(model, prompt_cache[0].dtype)
        copy.add(prompt_cache)
        cache = copy.take(0)  # the prompt's cache stays as it is for the next B
        token = mx.array([[int(rng.integers(vocab))]], dtype=mx.int32)
        for _ in range(3):  # warm-up (the cache grows by these; timed steps start at prompt + 3)
            logits, greedy = decode(model, token, cache)
            token = (greedy if greedy is not None else mx.argmax(logits)).reshape(1, 1).astype(mx.int32)
            token.item()
        tic = time.perf_counter()
        for _ in range(steps):  # pipelined: the next step queued before the last one's token is read
            logits, greedy = decode(model, token, cache)
            queued = (greedy if greedy is not None else mx.argmax(logits)).reshape(1, 1).astype(mx.int32)
            mx.async_eval(queued)
            token.item()
            token = queued
        token.item()
        return time.perf_counter() - tic
    step = BatchStep(model, tiles=tiles, launch_settings=launch_settings)
    kv = BatchKV(model, prompt_cache[0].dtype)
    for _ in range(batch):
        kv.add(prompt_cache)
    tokens = mx.array(rng.integers(0, vocab, size=batch), dtype=mx.int32)
    for _ in range(3):
        tokens = mx.argmax(step(tokens, kv), axis=-1).astype(mx.int32)
        tokens.tolist()
    with timed():
        tic, built = time.perf_counter(), 0.0
        for _ in range(steps):  # pipelined as BatchGenerator.next(): queue, then read the last step's tokens
            start = time.perf_counter()
            queued = mx.argmax(step(tokens, kv), axis=-1).astype(mx.int32)
            built += time.perf_counter() - start
            mx.async_eval(queued)
            tokens.tolist()
            tokens = queued
        tokens.tolist()
        seconds = time.perf_counter() - tic
    BUILD_MS[batch] = 1e3 * built / steps
    return seconds


def median_seconds(run, runs: int) -> float:
    """The median of `runs` timings of run()."""
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return sorted(times)[runs // 2]


def products_ms(model, batch: int, runs: int = 3, tiles: bool | None = None) -> float:
    """ms for the batched step's products alone (every layer's grouped launches and the head) on
    fixed q8x x of the step's padded rows, evaluated once: what the weights' reads and the
    products' arithmetic cost without attention and the seams."""
    from muser_mlx import ops
    from muser_mlx.models.batch_decode import GROUP
    step = BatchStep(model)
    if not step.q8x:
        return float("nan")
    layers, head = step.launches(step.uses_tiles(batch) if tiles is None else tiles)
    rows = -(-batch // GROUP) * GROUP
    cache = {}

    def x(n):
        if n not in cache:
            cache[n] = ops.quantize_rows(mx.random.normal((rows, n)))
            mx.eval(*cache[n])
        return cache[n]
    outs = []

    def run():
        outs.clear()
        for launches in layers:
            outs.extend(p(x(p.in_features)) for p in launches["inputs"])
            outs.append(launches["output"](x(launches["output"].in_features)))
            outs.append(step.feed_forward(launches, x(launches["gate_up"].in_features)))
        outs.append(head(x(head.in_features)))
        mx.eval(outs)
    run()
    return 1e3 * median_seconds(run, runs)


def each_product(model, batch: int, bandwidth: float, tiles: bool | None = None, runs: int = 5) -> list[str]:
    """One line for each product of layer 0 and the LM head, each alone (20 launches evaluated
    together, the median of `runs`): ms a launch, its weight bytes over the copy rate (its floor)
    and its int8 multiply-adds a second, for a product's share of the step."""
    from muser_mlx import ops
    from muser_mlx.models.batch_decode import GROUP
    step = BatchStep(model)
    if not step.q8x:
        return []
    layers, head = step.launches(step.uses_tiles(batch) if tiles is None else tiles)
    rows = -(-batch // GROUP) * GROUP
    named = [(f"inputs {i}", p) for i, p in enumerate(layers[0]["inputs"])]
    named += [("output", layers[0]["output"]), ("gate_up", layers[0]["gate_up"]), ("down", layers[0]["down"]),
              ("head", head)]
    lines = []
    for name, product in named:
        x = ops.quantize_rows(mx.random.normal((rows, product.in_features)))
        mx.eval(*x)
        if hasattr(product, "gate"):  # a grouped gated product
            weights = [product.gate, product.up]
        else:
            weights = [product.weight] + ([product.second] if product.second is not None else [])
        nbytes = sum(w.data.nbytes for w in weights)
        values = sum(w.shape[0] * w.shape[1] for w in weights)
        ms = 1e3 * median_seconds(lambda: mx.eval([product(x) for _ in range(20)]), runs) / 20
        lines.append(f"    {name:<9} {ms:8.3f} ms  floor {1e3 * nbytes / bandwidth:7.3f} ms  "
                     f"{nbytes / (ms / 1e3) / 1e9:7.1f} GB/s  {rows * values / (ms / 1e3) / 1e12:6.1f} T int8 MAC/s")
        if isinstance(product, ops.TileProduct):  # what bounds it: its loads alone, a plain read (tile_read.py)
            try:
                lines.append(_read_line(product, rows, weights, nbytes, runs))
            except Exception as error:  # a diagnostic: the run goes on without it
                lines.append(f"      read probes failed: {type(error).__name__}: {error}")
    return lines


def _read_line(product, rows: int, weights: list, nbytes: int, runs: int) -> str:
    """A tile product's weight loads alone in its pattern, and a plain read of its weights."""
    import tile_read
    tiles = 1e3 * median_seconds(lambda: mx.eval([tile_read.tiles_read(product, rows) for _ in range(20)]), runs) / 20
    flat = 1e3 * median_seconds(lambda: mx.eval([tile_read.flat_read(w) for w in weights for _ in range(20)]), runs) / 20
    return (f"      read: its loads alone {tiles:8.3f} ms {nbytes / (tiles / 1e3) / 1e9:7.1f} GB/s;  "
            f"plain read {flat:8.3f} ms {nbytes / (flat / 1e3) / 1e9:7.1f} GB/s")


def llama_speeds(path) -> dict:
    """B -> S_TG (decode tokens/s) from llama-batched-bench's jsonl output; {} without one."""
    import json
    if not path or not os.path.exists(path):
        return {}
    speeds = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            if "pl" in row and "speed_tg" in row:
                speeds[int(row["pl"])] = float(row["speed_tg"])
    return speeds


def form(step) -> str:
    if step.q8x:
        return f"q8x products, grouped below B = {step.model.settings.batch_tiles_from}, tiles from there"
    return "one node a layer (CPUDecodeStep.rows)" if step.layer_nodes else "float rows (ops.linear)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file, or 'default' (the packaged SmolLM2)")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--keep", action="store_true", help="keep the written Muse Glimmer file")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--parts", action="store_true", help="also the products alone at each B >= 2")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"load the model with these settings: {HELP}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="also each B >= 2 with the model rebuilt with these settings, same run")
    parser.add_argument("--each", action="store_true",
                        help="also each product of layer 0 and the head alone at each B >= 2, the settings' form "
                             "(both forms with --both; not the variants)")
    parser.add_argument("--llama-jsonl", default=None,
                        help="llama-batched-bench's --output-format jsonl of the same run: its S_TG beside ours")
    parser.add_argument("--both", action="store_true",
                        help="also each B >= 2 with the other product form (the one Settings.batch_tiles_from "
                             "does not pick), same run")
    args = parser.parse_args()
    written = None
    if args.model == "default":
        path = packaged.smollm2_path()
    elif args.model:
        path = Path(args.model)
    else:
        from decode import write_file
        path = Path(args.dir) / "muse-glimmer-random-52.gguf"
        if not path.exists():
            tic = time.perf_counter()
            write_file(path, np.random.default_rng(0))
            written = path
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - tic:.1f} s", flush=True)
    try:
        settings = settings_from(args.set)
        model, _ = load(path, settings=settings)
        variants = dict(parse_variant(variant) for variant in args.variant)  # built one at a time, below
        rng = np.random.default_rng(0)
        bandwidth = copy_rate()
        print(f"device {kernels.backend()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s; {path.name}; "
              f"batched step form: {form(BatchStep(model))}",
              flush=True)
        if args.set or variants:
            print(f"settings: {', '.join(args.set) or 'the defaults'}; variants: {', '.join(args.variant) or 'none'}",
                  flush=True)
        prompt_cache = cpu_decode.generation_cache(model)
        feed(model, rng.integers(0, model.config.vocab, size=args.prompt).tolist(), prompt_cache)
        dtype_bytes = 2 if prompt_cache[0].dtype == mx.float16 else 4
        weights = model.weight_bytes()
        print(f"{'B':>3} {'ms/step':>8} {'tokens/s':>9} {'floor ms':>8} {'floor tok/s':>11} {'build ms':>8}  "
              f"(prompt {args.prompt}, {args.steps} steps)")
        llama = llama_speeds(args.llama_jsonl)
        batches = [int(b) for b in args.batches.split(",")]
        for batch in batches:
            seconds = run_batch(model, prompt_cache, batch, args.prompt, args.steps, rng)
            middle = args.prompt + 3 + args.steps // 2
            floor = (weights + batch * kv_bytes_read(model, middle, dtype_bytes)) / bandwidth
            ms = 1e3 * seconds / args.steps
            line = (f"{batch:>3} {ms:>8.2f} {batch * args.steps / seconds:>9.1f} {1e3 * floor:>8.2f} "
                    f"{batch / floor:>11.1f} {BUILD_MS.get(batch, float('nan')):>8.2f}")
            step = BatchStep(model)
            picked = step.uses_tiles(batch)  # the form the step runs at this B
            if step.q8x and batch > 1:
                line += f"  ({'tiles' if picked else 'grouped'})"
            if batch in llama:
                line += f"  llama.cpp S_TG {llama[batch]:.1f} ({batch * args.steps / seconds / llama[batch]:.2f}x)"
            if args.parts and batch > 1:
                line += f"  products alone {products_ms(model, batch):.2f} ms"
            if args.both and batch > 1:
                other = not picked
                seconds = run_batch(model, prompt_cache, batch, args.prompt, args.steps, rng, tiles=other)
                line += f"  {'tiles' if other else 'grouped'} {1e3 * seconds / args.steps:.2f} ms/step"
                if args.parts:
                    line += f" (products alone {products_ms(model, batch, tiles=other):.2f} ms)"
            print(line, flush=True)
            if args.each and batch > 1:
                for tiles in ([picked, not picked] if args.both else [picked]):
                    print(f"  each product alone, {'tiles' if tiles else 'grouped'}:", flush=True)
                    for each in each_product(model, batch, bandwidth, tiles=tiles):
                        print(each, flush=True)
        for name, changes in variants.items():  # one variant's model at a time: each holds its own stacked tables
            try:  # a variant that fails (a kernel that does not compile) is reported; the others still run
                changed = settings_from(changes, settings)
                # a variant of the batched step's launches alone (tile_* and batch_* fields) runs on
                # this model, every weight shared: a rebuilt model's step ran slower even where its
                # settings did not apply (bench/history/session-48.md)
                launches_only = all(field.startswith(("tile_", "batch_"))
                                    for field, value in vars(changed).items() if getattr(settings, field) != value)
                variant = model if launches_only else rebuilt(model, changed)
                launch_settings = changed if launches_only else None
            except Exception as error:
                print(f"  {name}: failed to build: {type(error).__name__}: {str(error)[:400]}", flush=True)
                continue
            for batch in [b for b in batches if b > 1]:
                try:
                    seconds = run_batch(variant, prompt_cache, batch, args.prompt, args.steps, rng,
                                        launch_settings=launch_settings)
                    line = f"{batch:>3}   {name}: {1e3 * seconds / args.steps:.2f} ms/step, {batch * args.steps / seconds:.1f} tokens/s"
                    if batch in llama:
                        line += f" ({batch * args.steps / seconds / llama[batch]:.2f}x llama.cpp)"
                    if args.parts and not launches_only:
                        line += f" (products alone {products_ms(variant, batch):.2f} ms)"
                except Exception as error:
                    line = f"{batch:>3}   {name}: failed: {type(error).__name__}: {str(error)[:400]}"
                print(line, flush=True)
            del variant
            gc.collect()
            mx.clear_cache()
    finally:
        if written is not None and not args.keep:
            written.unlink()


if __name__ == "__main__":
    main()
