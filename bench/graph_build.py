"""Host cost of building one decode step's graph as the GPU path builds it, on any machine.

A decode step on a GPU is a few hundred launches; Python builds their graph before MLX encodes
and runs it, so the build time is part of a step (all of it when one step waits for the last).
Here every kernel launch is recorded and answered with zeros, so only the building is timed: a
52-layer Muse Glimmer-shaped model (small widths: the build cost does not depend on them), with
- the fused step (Transformer.decode_step) without mx.compile (Settings(compile_decode=False)):
  every step runs its Python;
- the general step it replaced (model(...): MLX ops around float32-x matvec kernels).
A GPU compiles the fused step (mx.compile: its Python runs once per cache shape, then MLX
replays the recorded graph). That cannot be timed here (zeros answered for launches are
constants to mx.compile, which folds them away): bench/decode.py prints the build time of the
compiled step on the GPU machine, with MLX's real kernels.

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

from muser_mlx import testing  # noqa: E402
from muser_mlx.generate import load  # noqa: E402
from muser_mlx.settings import Settings  # noqa: E402


def build_ms(step, steps: int) -> float:
    token = mx.array([[3]], dtype=mx.int32)
    times = []
    for _ in range(steps + 10):
        tic = time.perf_counter()
        out = step(token)
        times.append(time.perf_counter() - tic)
        mx.eval(out)
    return 1e3 * statistics.median(times[10:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=52)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = testing.tiny_model(Path(folder) / "m.gguf", "muse-glimmer", np.random.default_rng(0),
                                  weights="Q4_K_M", layers=args.layers, hidden=256, heads=4, kv_heads=2,
                                  head_dim=64, ff=512, window=8, context=4096)
        with mx.stream(mx.cpu):
            model, _ = load(path, settings=Settings(compile_decode=False))
    print(f"{args.layers}-layer step, median of {args.steps} builds (GPU launches recorded, not run)")
    with mx.stream(mx.cpu), testing.recorded_launches():
        cache = model.make_cache()
        ms = build_ms(lambda token: model.decode_step(token, cache), args.steps)
        print(f"{'fused step, no compile':28s} {ms:6.2f} ms to build", flush=True)
        cache = model.make_cache()
        ms = build_ms(lambda token: model.logits(model.hidden_unchecked(token, cache)), args.steps)
        print(f"{'general step':28s} {ms:6.2f} ms to build", flush=True)


if __name__ == "__main__":
    main()
