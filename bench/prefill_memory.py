"""GPU prefill's peak memory and speed against the pacer's memory headroom.

Loads (writing it first if absent) the full-scale random-weight Muse Glimmer file
bench/decode.py writes, then, for --rounds rounds, for each headroom in turn
(Settings.prefill_headroom, the model rebuilt with it; "none": no bound):
- prefill: --chunks 512-row chunks from context 0 (decode.py's prefill figure: tokens/s, the
  median over all chunks but the first; each chunk's own rate) and MLX's peak memory;
- filling a --context cache in 512-row chunks, one evaluation a chunk (decode.py's
  fill_context): tokens/s, the peak, and each chunk's peak;
- the host's share of each prefill chunk: the time building its graph (products queued as
  they are built), of it the pacer's waits for queued products and the time handing products
  to MLX (mx.async_eval: MLX encoding the ops built since the last one), and the evaluation
  after the build. The host's own work is the first less the waits (the rest of it less the
  encoding is Python building the graph; the encoding may also hold MLX's own waits while
  more than 10 of its graph commits are in flight): a chunk whose GPU work takes less than
  that waits on the host (the gaps between kernels `timeline.py --prefill` shows).
Peaks are MLX's own count (the model's arrays included), also as a multiple of the file.

    python bench/prefill_memory.py [--dir /dev/shm] [--headrooms none,300,500,800] [--rounds 3]
                                   [--chunks 6] [--context 8192] [--layers 52]
                                   [--set field=value ...] [--variant NAME:field=value,... ...]

--set gives every case these muser_mlx.settings.Settings; each --variant (decode.py's form,
bench/settings_cli.py) runs in every round after the default, with its settings, so that
settings are compared within one process (the figures moved 6,156-7,197 tokens/s between
processes of the same code). Each case's model is rebuilt over the same file with its settings
(its stacked projections copied anew) and the one before it freed, so that one model's arrays
count in each peak.

(headrooms in MB.) On a CPU the products are not paced: the figures do not depend on the headroom.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode  # noqa: E402
from muser_mlx.generate import load  # noqa: E402
from settings_cli import HELP, parse_variant, rebuilt, settings_from  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--headrooms", default="none,300,500,800", help="MB, or none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=decode.LAYERS, help="fewer layers: a quick smoke run")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"every case with these settings: {HELP}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="also run in every round with these settings")
    args = parser.parse_args()
    if args.chunks < 2:
        parser.error(f"--chunks: at least 2 (the first is not timed), got {args.chunks}")
    headrooms = [None if h.strip() == "none" else int(float(h) * 1e6) for h in args.headrooms.split(",")]
    settings = settings_from(args.set)
    variants = [("default", settings)]
    for variant in args.variant:
        name, changes = parse_variant(variant)
        variants.append((name, settings_from(changes, settings)))
    rng = np.random.default_rng(0)
    path = Path(args.dir) / f"muse-glimmer-random-{args.layers}.gguf"
    if not path.exists():
        decode.write_file(path, rng, args.layers)
    file_bytes = path.stat().st_size
    model, _ = load(path, settings=settings)
    for tensor in model.file.tensors.values():
        mx.eval(tensor.data)
    print(f"device: {mx.default_device()}; file {file_bytes / 1e9:.2f} GB; active after loading "
          f"{mx.get_active_memory() / 1e9:.2f} GB", flush=True)
    decode.prefill_times(model, rng, 3)  # builds the kernels
    for _, variant_settings in variants[1:]:  # each variant's shapes built before the timed rounds
        model = rebuilt(model, variant_settings)
        gc.collect()
        decode.prefill_times(model, rng, 3)
    for round_, headroom, (name, variant_settings) in itertools.product(range(args.rounds), headrooms, variants):
        model = rebuilt(model, variant_settings.replace(prefill_headroom=headroom))
        gc.collect()  # the model replaced (and its stacked projections) freed before the peaks
        mx.reset_peak_memory()
        host = []
        times = decode.prefill_times(model, rng, args.chunks, host=host)[1:]
        host = host[1:]
        rate, rates, peak = 512 / statistics.median(times), [512 / t for t in times], mx.get_peak_memory()
        tic = time.perf_counter()
        peaks = decode.fill_context(model, model.make_cache(), args.context, rng)
        fill_rate = args.context / (time.perf_counter() - tic)
        label = "none" if headroom is None else f"{headroom / 1e6:.0f} MB"
        if len(variants) > 1:
            label += f", {name}"
        print(f"round {round_}, headroom {label}: prefill {rate:,.0f} tokens/s (chunks "
              f"{', '.join(f'{r:,.0f}' for r in rates)}), peak {peak / 1e9:.2f} GB "
              f"({peak / file_bytes:.3f}x); filling {args.context}: {fill_rate:,.0f} tokens/s, peak "
              f"{max(peaks) / 1e9:.2f} GB ({max(peaks) / file_bytes:.3f}x); chunk peaks "
              f"{' '.join(f'{p / 1e9:.2f}' for p in peaks)}", flush=True)
        print("  host a prefill chunk (ms: building its graph, of it the pacer's waits (count) and "
              "MLX encoding (async_eval), evaluating after the build): "
              + "; ".join(f"{1e3 * b:.1f}, {1e3 * w:.1f} ({n}) {1e3 * q:.1f}, {1e3 * e:.1f}"
                          for b, w, n, e, q in host),
              flush=True)


if __name__ == "__main__":
    main()
