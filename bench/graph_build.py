"""Host cost of building one decode step's graph as the GPU path builds it, on any machine.

A decode step on a GPU is ~1,000 small ops; Python builds their graph before MLX encodes and
runs it, so the build time is part of a step (all of it when one step waits for the last).
Here every kernel launch is recorded and answered with zeros, so only the building is timed:
a 52-layer Muse Glimmer-shaped model (small widths: the build cost does not depend on them),
with `qk_norm_rope` fused (one launch) and as MLX ops (split, transpose, rms_norm, rope for q
and for k).

    python bench/graph_build.py [--layers 52] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import ops, testing  # noqa: E402
from muser_mlx.generate import load  # noqa: E402


def build_ms(model, steps: int) -> float:
    cache = model.make_cache()
    token = mx.array([[3]], dtype=mx.int32)
    times = []
    for _ in range(steps + 10):
        tic = time.perf_counter()
        hidden = model.hidden_unchecked(token, cache)
        times.append(time.perf_counter() - tic)
        mx.eval(hidden)
    return 1e3 * statistics.median(times[10:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=52)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = testing.tiny_model(Path(folder) / "m.gguf", "muse-glimmer", np.random.default_rng(0),
                                  weights="Q4_K", layers=args.layers, hidden=256, heads=4, kv_heads=2,
                                  head_dim=64, ff=512, window=8)
        with mx.stream(mx.cpu):
            model, _ = load(path)
    fused = ops.qk_norm_rope
    print(f"{args.layers}-layer step, median of {args.steps} builds (GPU launches recorded, not run)")
    with mx.stream(mx.cpu), testing.recorded_launches():
        for _ in range(2):
            for label, qk in (("qk_norm_rope fused", fused), ("qk_norm_rope as MLX ops", ops.qk_norm_rope_mlx)):
                ops.qk_norm_rope = qk
                print(f"{label:26s} {build_ms(model, args.steps):6.2f} ms to build", flush=True)


if __name__ == "__main__":
    main()
