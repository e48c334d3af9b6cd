"""Does where x lies change a decode product's time? The same kernel, the same weights, x's
three q8x arrays placed differently.

Session 15 packed x's codes, sums and scales into one array (branch `packed-q8x`): the kernels'
PTX was the same, yet product_glu took 10-20 % longer, alone and in the step. This times
ops.product_glu (Muse Glimmer's gate/up: two Q4_K 19968 x 6656 weights) and ops.product
(ffn_down, Q4_K 6656 x 19968) with x all zeros (the kernels take no branch on x's values) as:
- apart: three arrays of their own (main's layout);
- packed: slices of one buffer, codes at byte 0, sums at IN, scales at 1.5 IN (the branch's
  layout, main's kernels);
- packed+4K: the same, each part starting on a 4 KB boundary;
- packed@+N: the packed layout starting N bytes into its buffer.
Each row: µs per call (median of --repeats evaluations of --calls calls, weights rotating
through copies that exceed the L2) and % of the copy ceiling.

    python bench/placement.py [--calls 16] [--repeats 7] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceiling import copy_bandwidth  # noqa: E402
from linear import STREAM_BYTES, Weight, per_call_seconds, valid_weight  # noqa: E402
from muser_mlx import formats, kernels, ops  # noqa: E402
from muser_mlx.formats import GGMLType  # noqa: E402


def placed(n: int, layout: str):
    """x's q8x (codes int8 [1, n], scales f32 [1, n/32], sums f32 [1, n/8]), all zeros, placed
    as `layout` says."""
    if layout == "apart":
        return ops.Q8X(mx.zeros((1, n), mx.int8), mx.zeros((1, n // 32)), mx.zeros((1, n // 8)))
    skip, sums_at, scales_at = 0, n, n + n // 2  # bytes
    if layout == "packed+4K":
        sums_at = -(-n // 4096) * 4096
        scales_at = sums_at + -(-(n // 2) // 4096) * 4096
    elif layout.startswith("packed@+"):
        skip = int(layout[len("packed@+"):])
        sums_at, scales_at = skip + n, skip + n + n // 2
    floats = -(-(scales_at + n // 8) // 4) + 64
    buffer = mx.zeros((floats,), mx.float32)
    codes = buffer.view(mx.int8)[skip : skip + n].reshape(1, n)
    sums = buffer[sums_at // 4 : sums_at // 4 + n // 8].reshape(1, n // 8)
    scales = buffer[scales_at // 4 : scales_at // 4 + n // 32].reshape(1, n // 32)
    return ops.Q8X(codes, scales, sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="every layout this many times, in turn")
    args = parser.parse_args()
    if kernels.backend() == "cpu":
        sys.exit("placement.py times GPU kernels; this machine's default device is the CPU")
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth(4 << 30, 5)
    print(f"ceiling: elementwise copy {bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
    layouts = ["apart", "packed", "packed+4K", "packed@+64", "packed@+4096"]
    cases = []
    for label, (out_features, in_features), glu in [("gate/up GLU Q4_K", (19968, 6656), True),
                                                    ("ffn_down Q4_K", (6656, 19968), False)]:
        nbytes = out_features * formats.FORMATS[GGMLType.Q4_K].row_bytes(in_features) * (2 if glu else 1)
        copies = max(1, math.ceil(STREAM_BYTES / nbytes))
        make = lambda: Weight(valid_weight(rng, GGMLType.Q4_K, out_features, in_features), GGMLType.Q4_K,  # noqa: E731
                              in_features, out_features)
        weights = [(make(), make() if glu else None) for _ in range(copies)]
        cases.append((label, in_features, glu, nbytes, weights))
    print("| product | x | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in range(args.rounds)) + " |")
    for label, n, glu, nbytes, weights in cases:
        results = {layout: [] for layout in layouts}
        for _ in range(args.rounds):
            for layout in layouts:
                xs = [placed(n, layout) for _ in range(4)]
                mx.eval(xs)

                def call(i):
                    first, second = weights[i % len(weights)]
                    x = xs[i % 4]
                    return list(ops.product_glu(x, first, second)) if glu else ops.product(x, first)

                seconds = per_call_seconds(lambda: [call(i) for i in range(args.calls)], args.repeats)
                results[layout].append(f"{seconds * 1e6:,.1f} ({100 * nbytes / seconds / bandwidth:.0f}%)")
        for layout in layouts:
            print(f"| {label} | {layout} | " + " | ".join(results[layout]) + " |", flush=True)


if __name__ == "__main__":
    main()
