"""Embedding lookup: time per call for T = 1, 64, 512 (and 16384) tokens, bytes moved, GB/s, and the floor.

Table: Muse Glimmer's token_embd shape (hidden 6656, vocab 202,048) in Q4_K, Q8_0 and F16,
valid blocks written directly as bytes (random quants, finite f16 scales). The CPU run uses
a smaller vocab (the gather reads T rows whatever the vocab; only memory use changes).

Launch latency would hide a kernel this small, so each measurement evaluates CALLS
independent lookups (different ids) in one mx.eval and divides; T = 16384 shows the
kernel's own bandwidth once the fixed per-call cost no longer dominates. The ceiling is a large
device copy measured in the same run; floor = bytes moved / that bandwidth.

    python bench/embedding.py [--vocab N] [--calls N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from ceiling import copy_bandwidth
from muser_mlx import formats, kernels, ops

HIDDEN = 6656
MUSE_VOCAB = 202_048
SCALE_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q8_0: (0,)}


def valid_table(rng, ggml_type, vocab) -> mx.array:
    fmt = formats.FORMATS[ggml_type]
    nbytes = vocab * fmt.row_bytes(HIDDEN)
    if ggml_type == GGMLType.F16:
        values = rng.standard_normal(nbytes // 2, dtype=np.float32).astype(np.float16)
        return mx.array(values.view(np.uint8).reshape(vocab, -1))
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8).reshape(-1, fmt.type_size)
    for start in SCALE_FIELDS[ggml_type]:
        scales = rng.uniform(1e-3, 1e-1, size=raw.shape[0]).astype(np.float16)
        raw[:, start : start + 2] = scales.reshape(-1, 1).view(np.uint8)
    return mx.array(raw.reshape(vocab, -1))


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: builds the kernel, faults memory in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    on_gpu = kernels.backend() != "cpu"
    vocab = args.vocab or (MUSE_VOCAB if on_gpu else 16_384)
    calls = args.calls or (64 if on_gpu else 8)
    rng = np.random.default_rng(0)

    bandwidth = copy_bandwidth((4 << 30) if on_gpu else (256 << 20), args.repeats)
    device = mx.device_info().get("device_name", platform.machine())
    print(f"backend {kernels.backend()} ({device}); hidden {HIDDEN}, vocab {vocab}; "
          f"{calls} lookups per evaluation; median of {args.repeats}")
    print(f"ceiling: elementwise copy {bandwidth / 1e9:,.1f} GB/s (read + write)\n")
    print("| table | T | µs / call | bytes / call | GB/s | floor µs | time / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ggml_type in (GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.F16):
        table = valid_table(rng, ggml_type, vocab)
        row_bytes = formats.FORMATS[ggml_type].row_bytes(HIDDEN)
        for tokens in (1, 64, 512, 16384):
            ids = [mx.array(rng.integers(0, vocab, size=tokens).astype(np.int32)) for _ in range(calls)]

            def lookups():
                mx.eval([ops.embedding_unchecked(table, i, ggml_type, HIDDEN, vocab) for i in ids])

            seconds = median_seconds(lookups, args.repeats) / calls
            nbytes = tokens * (row_bytes + 4) + tokens * HIDDEN * 4
            floor = nbytes / bandwidth
            print(f"| {ggml_type.name} | {tokens} | {seconds * 1e6:,.1f} | {nbytes:,} | "
                  f"{nbytes / seconds / 1e9:,.1f} | {floor * 1e6:,.2f} | {seconds / floor:,.1f}x |")
        del table


if __name__ == "__main__":
    main()
