"""GPU time of each kernel in a Muse Glimmer decode step, from Nsight Compute.

A decode step's wall time holds the GPU's work and, between kernels, whatever the host does
to launch them. `run` decodes with the fused step (as generate() does; --general: the general
step it replaced). This tool separates the two. `run` decodes a few tokens on a full-width,
few-layer Muse Glimmer file (the shapes of the real one, with fewer layers) and prints the wall
time per step; under ncu the same run records every kernel's duration, and `report` sums them
per kernel and per step:

    python bench/kernel_times.py run [--layers 4] [--context 8192] [--set field=value]  # wall ms per step
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        --csv python bench/kernel_times.py run --steps 4 > times.csv
    python bench/kernel_times.py report times.csv --steps 4 --layers 4 --ceiling-gbs 3600
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python bench/kernel_times.py prefill --layers 2 --steps 2 > prefill.csv   # 512-row chunks
    python bench/kernel_times.py report prefill.csv --steps 1 --layers 2 --whole   # the last chunk
    ncu --clock-control none --section SpeedOfLight ... python bench/kernel_times.py matvec \
        --type Q4_K --rows 39936 --cols 6656      # one ops.linear of one row, a few calls

--set (run, prefill) loads the model with those muser_mlx.settings.Settings, and each --variant
NAME:field=value,... (prefill) times the chunks again with the model rebuilt with them
(bench/settings_cli.py).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gc
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(args) -> None:
    import mlx.core as mx

    from decode import fused_step, general_step, write_file
    from muser_mlx.generate import load
    from settings_cli import settings_from

    path = Path(args.dir) / f"muse-glimmer-random-{args.layers}.gguf"
    if not path.exists():
        write_file(path, np.random.default_rng(0), args.layers)
    model, _ = load(path, settings=settings_from(args.set))  # e.g. --set attention_splits=64
    cache = model.make_cache()
    if args.context:  # caches that hold --context positions (zeros: attention's time does not depend on them)
        c = model.config
        for layer_cache in cache:
            layer_cache.reserve(1, c.kv_heads, c.head_dim, args.context + args.warmup + args.steps + 1)
            layer_cache.offset = args.context
    step = general_step if args.general else fused_step
    token = mx.array([[7]], dtype=mx.int32)
    times = []
    for _ in range(args.warmup + args.steps):
        tic = time.perf_counter()
        token = step(model, token, cache)
        mx.eval(token)
        times.append(time.perf_counter() - tic)
    print(f"{args.layers} layers, context {args.context} {args.set}: {1e3 * statistics.median(times[args.warmup:]):.2f} "
          f"ms per step (median of {args.steps}, one evaluation each)", file=sys.stderr)


def prefill(args) -> None:
    """512-row prefill chunks (model.hidden and the last row's logits, as generation's prompt
    does) from context 0, --steps of them: wall ms per chunk; under ncu, every kernel's time
    (`report --whole` sums them per chunk). --variant NAME:field=value,... (repeatable) times
    the same chunks again with the model rebuilt with those settings."""
    import mlx.core as mx

    from decode import write_file
    from muser_mlx.generate import load
    from settings_cli import parse_variant, rebuilt, settings_from

    path = Path(args.dir) / f"muse-glimmer-random-{args.layers}.gguf"
    if not path.exists():
        write_file(path, np.random.default_rng(0), args.layers)
    settings = settings_from(args.set)  # e.g. --set prefill_slots=0
    variants = [("", [], settings)]
    for variant in args.variant:
        name, changes = parse_variant(variant)
        variants.append((name, changes, settings_from(changes, settings)))

    model, _ = load(path, settings=settings)
    mx.eval(model.make_cache())
    print(f"after load: active {mx.get_active_memory() / 1e9:.2f} GB, file {path.stat().st_size / 1e9:.2f} GB",
          file=sys.stderr, flush=True)
    rng = np.random.default_rng(1)
    for label, changes, variant_settings in variants:
        model = rebuilt(model, variant_settings)
        gc.collect()  # the model replaced (and its stacked projections) freed
        mx.reset_peak_memory()
        times = [prefill_chunk(model, rng) for _ in range(args.steps)]
        print(f"{args.layers} layers {args.set} {label} {changes}: {[round(1e3 * t, 1) for t in times]} ms per "
              f"512-row chunk from context 0 ({512 / statistics.median(times[1:]):,.0f} tokens/s after the first); "
              f"peak {mx.get_peak_memory() / 1e9:.2f} GB", file=sys.stderr, flush=True)


def prefill_chunk(model, rng) -> float:
    """One 512-row prefill chunk of random ids from context 0 into a fresh cache, as a
    prompt's: the hidden states and the last row's logits. Returns its seconds (evaluation
    only)."""
    import mlx.core as mx

    cache = model.make_cache()
    ids = mx.array(rng.integers(0, min(1000, model.config.vocab), size=(1, 512)), dtype=mx.int32)
    tic = time.perf_counter()
    mx.eval(model.logits(model.hidden(ids, cache)[:, -1:]))
    return time.perf_counter() - tic


def matvec(args) -> None:
    """ops.linear of one row (on a GPU the generic matvec kernel, the general step's product),
    called a few times: for `ncu --section ...` on one kernel."""
    import mlx.core as mx

    from linear import Weight, valid_weight
    from muser_mlx import ops
    from muser_mlx.formats import GGMLType

    ggml_type = GGMLType[args.type]
    weight = Weight(valid_weight(np.random.default_rng(0), ggml_type, args.rows, args.cols), ggml_type,
                    args.cols, args.rows)
    x = mx.random.normal((1, args.cols))
    for _ in range(args.steps):
        mx.eval(ops.linear(x, weight))


def report(args) -> None:
    """Kernel durations (and, when ncu measured them, DRAM bytes) from ncu's CSV: the last
    `steps` steps' kernels, summed per name and grid, with GB/s and % of --ceiling."""
    text = Path(args.csv).read_text()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels, metrics = {}, collections.defaultdict(dict)
    for row in rows:
        kernels[int(row["ID"])] = (row["Kernel Name"].split("(")[0], row["Grid Size"])
        metrics[int(row["ID"])][row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    launches = [(*kernels[i], metrics[i]["gpu__time_duration.sum"] / 1e3,
                 metrics[i].get("dram__bytes_read.sum", 0) + metrics[i].get("dram__bytes_write.sum", 0))
                for i in sorted(kernels)]
    if args.whole:  # every launch of the last --steps chunks (each begins with the embedding), summed per name
        starts = [i for i, (name, *_) in enumerate(launches) if "embedding" in name]
        if len(starts) >= args.steps:  # the first chunks pay first touches of every buffer: left out
            launches = launches[starts[-args.steps]:]
        totals = collections.defaultdict(list)
        for name, grid, us, nbytes in launches:
            totals[name[:70]].append((us, nbytes))
        whole = sum(us for _, _, us, _ in launches) / args.steps
        print(f"{len(launches)} launches; GPU time per step {whole:.1f} µs\n")
        print("| kernel | launches per step | µs per step | % of the step |")
        print("| --- | ---: | ---: | ---: |")
        for name, values in sorted(totals.items(), key=lambda kv: -sum(v[0] for v in kv[1])):
            us = sum(v[0] for v in values) / args.steps
            print(f"| {name} | {len(values) / args.steps:g} | {us:,.1f} | {100 * us / whole:.1f} % |")
        return
    names = [name for name, *_ in launches]  # grids of attention kernels grow with the cache
    # The step's length: the shortest period of the last `steps` steps' kernel sequence (a
    # layer repeats within a step, but the embedding and the LM head break that shorter period).
    per_step = next(p for p in range(1, len(names) // args.steps + 1)
                    if all(names[-i] == names[-i - p] for i in range(1, p * (args.steps - 1) + 1)))
    last = launches[-per_step * args.steps:]
    totals = collections.defaultdict(list)
    for name, grid, us, nbytes in last:
        totals[(name[:60], grid)].append((us, nbytes))
    step_us = sum(us for _, _, us, _ in last) / args.steps
    print(f"{per_step} kernels per step ({(per_step - 4) / args.layers:.1f} per layer beside the embedding, "
          f"first seam, LM head and argmax); GPU time per step {step_us:.1f} µs\n")
    print("| kernel | grid | launches per step | µs each (median) | µs per step | MB each | GB/s | % of ceiling |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (name, grid), values in sorted(totals.items(), key=lambda kv: -sum(v[0] for v in kv[1])):
        us = statistics.median(v[0] for v in values)
        nbytes = statistics.median(v[1] for v in values)
        rate = nbytes / us / 1e3 if us else 0.0
        print(f"| {name} | {grid} | {len(values) / args.steps:g} | {us:.1f} | "
              f"{sum(v[0] for v in values) / args.steps:.1f} | {nbytes / 1e6:.2f} | {rate:,.0f} | "
              f"{100 * rate / args.ceiling_gbs:.0f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["run", "report", "matvec", "prefill"])
    parser.add_argument("csv", nargs="?")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--general", action="store_true", help="run: the general step, not the fused one")
    parser.add_argument("--ceiling-gbs", type=float, default=3600.0,
                        help="report: the copy bandwidth of the same machine (bench/decode.py prints it)")
    parser.add_argument("--type", default="Q4_K", help="matvec: the weight format")
    parser.add_argument("--rows", type=int, default=39936, help="matvec: output rows")
    parser.add_argument("--cols", type=int, default=6656, help="matvec: input features")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="run, prefill: load the model with these settings (muser_mlx.settings.Settings; "
                             "bench/settings_cli.py)")
    parser.add_argument("--context", type=int, default=0, help="run: decode at this position (caches filled with zeros)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="prefill: also the chunks with the model rebuilt with these settings")
    parser.add_argument("--whole", action="store_true",
                        help="report: every launch summed per kernel name (prefill), no step detection")
    args = parser.parse_args()
    {"run": run, "report": report, "matvec": matvec, "prefill": prefill}[args.mode](args)


if __name__ == "__main__":
    main()
