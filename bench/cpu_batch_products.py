"""The products of one batched decode step on the CPU: B sequences of one token each, every
weight the step multiplies by (model.matrices(), the LM head included) as ops.linear on x
[B, 1, in] rounded (ops.rounded_products: the compiled tiles up to 8 rows, panels above),
all evaluated together. Per B: ms a step (median and best of --repeats after a warm-up: on a
shared machine the best is the steadier figure), weight GB/s (of the median), and the floor: the matrices' bytes / the memory copy bandwidth
measured in this run (bytes read + written per second of numpy copying 256 MB, one thread;
MLX's CPU elementwise ops, bench/ceiling.py's measure, are compute-bound here), which a
product that reads each weight byte once for all B rows approaches whatever B is.

    python bench/cpu_batch_products.py [--model FILE] [--batch 1,2,4,8,16,32,64] [--repeats 11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import ops  # noqa: E402
from muser_mlx.generate import load  # noqa: E402


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read + written per second by np.copyto over `nbytes`, the best of `repeats`."""
    source = np.ones(nbytes, np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - tic)
    return 2 * nbytes / min(times)


def step_ms(matrices: list, batch: int, repeats: int) -> tuple[float, float]:
    """Median and best ms of one evaluation of every matrix's product with random x [batch, 1, in]."""
    xs = [mx.random.normal((batch, 1, m.shape[0])) for m in matrices]
    mx.eval(xs)

    def products():
        with ops.rounded_products(True):
            return [ops.linear(x, m, rounded=True) for x, m in zip(xs, matrices)]

    mx.eval(products())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(products())
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="GGUF file; default: the default model (SmolLM2-135M)")
    parser.add_argument("--batch", default="1,2,4,8,16,32,64", help="comma-separated B values")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    model, _ = load(args.model)
    matrices = model.matrices()
    weight_bytes = sum(m.nbytes for m in matrices)
    bandwidth = copy_bandwidth()
    floor_ms = weight_bytes / bandwidth * 1e3
    types = sorted({m.ggml_type.name for m in matrices})
    print(f"{len(matrices)} matrices ({', '.join(types)}), {weight_bytes / 1e6:.1f} MB; copy "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s: floor {floor_ms:.1f} ms a step")
    print(f"{'B':>3} {'ms/step':>8} {'best':>6} {'ms/row':>7} {'GB/s':>6} {'x floor':>8}")
    for batch in (int(b) for b in args.batch.split(",")):
        ms, best = step_ms(matrices, batch, args.repeats)
        print(f"{batch:>3} {ms:8.1f} {best:6.1f} {ms / batch:7.2f} {weight_bytes / ms / 1e6:6.1f} "
              f"{ms / floor_ms:8.2f}")


if __name__ == "__main__":
    main()
