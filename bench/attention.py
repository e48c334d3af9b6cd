"""One decode token's attention alone (kernels attention_decode + attention_combine), Muse
Glimmer's shapes: 32 query heads, 2 kv heads, head_dim 128, float16 caches; µs per layer.

A layer is a window layer (RoPE, a ring of at most 2,048 slots) or a full layer (NoPE, every
position): each context c gets the caches decode_step would hold at position c (capacity c + 1
rounded up to cache.STEP, at most the window for a window layer). `--layers` independent layers
(each its own caches and projections) are one compiled graph, as in a step, timed `--repeats`
times after a warm-up; the figure is the median evaluation over the layers, launch gaps
included (uncompiled, Python's ~20 µs a layer hid the kernels' differences).
Bytes: the keys and values read (positions seen x 2 kv heads x 128 x 2 bytes x 2).

    python bench/attention.py [--contexts 5,2048,8192] [--layers 26] [--repeats 20]
                              [--variant NAME:field=value,...]

--variant (repeatable) times the same cases with other attention settings of
muser_mlx.settings.Settings (attention_splits, attention_head_group), e.g.
`--variant hg1:attention_head_group=1` (the base row is "default": Settings()).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from muser_mlx import cache as cache_module  # noqa: E402
from muser_mlx import ops  # noqa: E402
from muser_mlx.settings import DEFAULT, Settings  # noqa: E402
from settings_cli import parse_variant, settings_from  # noqa: E402

FIELDS = ("attention_splits", "attention_head_group")  # what attention_decode takes of Settings

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 2, 128, 2048
Q_OFF, G_OFF, K_OFF, V_OFF, WIDTH = 0, 4096, 8192, 8448, 8704


def layer_inputs(rng, context: int, window: bool) -> dict:
    step = cache_module.STEP
    capacity = -(-(context + 1) // step) * step
    if window:
        capacity = min(capacity, WINDOW)
    cache = rng.standard_normal((2, 1, KV_HEADS, capacity, HEAD_DIM)).astype(np.float16)
    return dict(
        y=mx.array(rng.standard_normal((1, WIDTH)).astype(np.float32)),
        keys=mx.array(cache[0]), values=mx.array(cache[1]),
        position=mx.array([context], dtype=mx.int32),
        q_weight=mx.array((1 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)),
        k_weight=mx.array(np.ones(HEAD_DIM, np.float32)),
        rope=dict(dims=HEAD_DIM, base=500000.0, traditional=True) if window else None,
    )


def time_layers(layers: list[dict], repeats: int, settings: Settings) -> float:
    """Median seconds a layer: every layer's attention as one compiled graph (mx.compile: its
    Python runs once, so the figure is the GPU's and the launches', as in a decode step), with
    `settings`' splits and head group."""
    names = ("y", "keys", "values", "position", "q_weight", "k_weight")

    def graph(*arrays):
        outs = []
        for i, inputs in enumerate(layers):
            y, keys, values, position, q_weight, k_weight = arrays[6 * i: 6 * i + 6]
            o, _, _ = ops.attention_decode(
                y, keys, values, position, position,
                heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, offsets=(Q_OFF, K_OFF, V_OFF), gate=G_OFF,
                q_weight=q_weight, k_weight=k_weight, bias=None, rope=inputs["rope"],
                eps=1e-5, scale=HEAD_DIM ** -0.5, splits=settings.attention_splits,
                head_group=settings.attention_head_group)
            outs.extend(o)
        return outs

    compiled = mx.compile(graph)
    arrays = [inputs[name] for inputs in layers for name in names]
    for _ in range(3):
        mx.eval(compiled(*arrays))
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(compiled(*arrays))
        times.append(time.perf_counter() - tic)
    return statistics.median(times) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="5,2048,8192")
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help=f"also these settings ({', '.join(FIELDS)})")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    variants = [("default", DEFAULT)]
    for variant in args.variant:
        name, changes = parse_variant(variant)
        if any(change.partition("=")[0].strip() not in FIELDS for change in changes):
            parser.error(f"--variant {variant!r}: attention_decode takes {', '.join(FIELDS)} of the settings")
        variants.append((name, settings_from(changes)))
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"device {mx.default_device()}, {args.layers} layers an evaluation, median of {args.repeats}")
    print("| variant | " + " | ".join(f"{kind} ctx {c}" for c in contexts for kind in ("window", "full")) + " |")
    print("| --- | " + " | ".join("---:" for _ in contexts for _ in range(2)) + " |")
    cases = {(c, w): [layer_inputs(rng, c, w) for _ in range(args.layers)] for c in contexts for w in (True, False)}
    mx.eval([v for layers in cases.values() for d in layers for v in d.values() if isinstance(v, mx.array)])
    for name, settings in variants:
        cells = []
        for c in contexts:
            for w in (True, False):
                seconds = time_layers(cases[(c, w)], args.repeats, settings)
                seen = min(c + 1, WINDOW) if w else c + 1
                gbs = seen * KV_HEADS * HEAD_DIM * 2 * 2 / seconds / 1e9
                cells.append(f"{seconds * 1e6:.1f} µs ({gbs:,.0f} GB/s)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
