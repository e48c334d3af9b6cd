"""The CPU decode step alone (models/cpu_decode.py), one node a layer against the separate nodes
(CPUDecodeStep's layer_primitive), interleaved in one process: ms a step, median and min over
rounds. Both round products' inputs as the model's settings say (Settings.cpu_rounded).

Each round and variant: a fresh generation cache, `--context` steps to fill it, then `--steps`
timed steps of greedy tokens, either each evaluated before the next is built ("sync") or the
next built and queued before the last is read (as generate()'s loop, "pipelined").
The packaged models, or the files given with --model.

    python bench/cpu_step.py [--model FILE ...] [--rounds 8] [--steps 64] [--context 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import packaged  # noqa: E402
from muser_mlx.generate import load  # noqa: E402
from muser_mlx.models import cpu_decode  # noqa: E402


def time_steps(step, model, context: int, steps: int, pipelined: bool) -> float:
    """ms a step over `steps` greedy steps after `context` untimed ones."""
    cache = cpu_decode.generation_cache(model)
    token = mx.array([[1]], dtype=mx.int32)
    for _ in range(context):
        token = mx.argmax(step(token, cache)).reshape(1, 1)
        mx.eval(token)
    tic = time.perf_counter()
    for _ in range(steps):
        ahead = mx.argmax(step(token, cache)).reshape(1, 1)
        if pipelined:
            mx.async_eval(ahead)
            token.item()
        else:
            ahead.item()
        token = ahead
    token.item()
    return (time.perf_counter() - tic) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", help="GGUF file(s); default: the packaged models")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="untimed steps first")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    paths = [Path(p) for p in args.model or []] or [packaged.model_path(name) for name in packaged.MODELS]
    for path in paths:
        model, _ = load(path)
        if not cpu_decode.serves(model):
            print(f"{path.name}: the CPU decode step does not serve it here")
            continue
        variants = [(primitive, pipelined) for primitive in (True, False) for pipelined in (False, True)]
        steps = {primitive: cpu_decode.CPUDecodeStep(model, rounded=model.settings.cpu_rounded,
                                                     layer_primitive=primitive)
                 for primitive in (True, False)}
        times = {variant: [] for variant in variants}
        for round_ in range(args.rounds + 1):  # the first warms up
            for primitive, pipelined in variants if round_ % 2 else variants[::-1]:
                ms = time_steps(steps[primitive], model, args.context, args.steps, pipelined)
                if round_:
                    times[(primitive, pipelined)].append(ms)
        for (primitive, pipelined), values in times.items():
            print(f"{path.name}: {'one node a layer' if primitive else 'separate nodes  '} "
                  f"{'pipelined' if pipelined else 'sync     '} median {statistics.median(values):.2f} "
                  f"min {min(values):.2f} ms a step ({' '.join(f'{v:.2f}' for v in values)})", flush=True)


if __name__ == "__main__":
    main()
