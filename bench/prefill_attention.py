"""What a prefill chunk's attention costs the first time a process sees its key length.

A GPU prefill chunk of T rows at context c attends over S = c + T keys in a full layer, so
every chunk of a long prompt brings a key length the process has not seen. If MLX's fused
attention (cuDNN on CUDA) builds something per shape, the first chunks of each process pay it
(chunks past the warm-up spent 90-1,109 ms in MLX's encoding, 26-33 ms a round later). Muse
Glimmer's shapes: 32 query heads, 2 kv heads, head_dim 128, float16, T = 512. For each S = T,
2T, ... up to --max-context, in this order, prints the first call's time (one evaluation, the
host's encoding included) and the median of --repeats more:
- "causal": mask="causal", as a full layer's chunk runs it;
- "additive": an additive float16 [T, S] mask (a window layer past its window);
- "bucketed": keys and values padded to the next multiple of --bucket, an additive mask hiding
  the padding: how many distinct shapes a bucketed key length would leave, and its cost.

    python bench/prefill_attention.py [--max-context 8192] [--bucket 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

HEADS, KV_HEADS, HEAD_DIM, T = 32, 2, 128, 512


def timed(fn, repeats: int) -> tuple[float, float]:
    """(ms of the first call, median ms of `repeats` more), each evaluated alone."""
    times = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * times[0], 1e3 * statistics.median(times[1:])


def additive_mask(keys: int, visible: int) -> mx.array:
    """float16 [T, keys]: query i (at position visible - T + i) sees keys 0 .. visible - T + i."""
    q = mx.arange(visible - T, visible)[:, None]
    k = mx.arange(keys)[None, :]
    return mx.where(k <= q, mx.array(0.0, mx.float16), mx.array(-np.inf, mx.float16))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--bucket", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"device: {mx.default_device()}; q [1, {HEADS}, {T}, {HEAD_DIM}], keys [1, {KV_HEADS}, S, "
          f"{HEAD_DIM}] float16; ms: first call / median of {args.repeats} more", flush=True)
    rng = np.random.default_rng(0)
    scale = HEAD_DIM ** -0.5
    q = mx.array(rng.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float16))
    longest = -(-args.max_context // args.bucket) * args.bucket
    keys = mx.array(rng.standard_normal((1, KV_HEADS, longest, HEAD_DIM)).astype(np.float16))
    values = mx.array(rng.standard_normal((1, KV_HEADS, longest, HEAD_DIM)).astype(np.float16))
    mx.eval(q, keys, values)
    sdpa = mx.fast.scaled_dot_product_attention
    for s in range(T, args.max_context + 1, T):
        k, v = keys[:, :, :s], values[:, :, :s]
        mask = additive_mask(s, s)
        padded = -(-s // args.bucket) * args.bucket
        bucket_mask = additive_mask(padded, s)
        mx.eval(mask, bucket_mask)
        causal = timed(lambda: sdpa(q, k, v, scale=scale, mask="causal"), args.repeats)
        additive = timed(lambda: sdpa(q, k, v, scale=scale, mask=mask), args.repeats)
        bucketed = timed(lambda: sdpa(q, keys[:, :, :padded], values[:, :, :padded], scale=scale,
                                      mask=bucket_mask), args.repeats)
        print(f"S {s:6d}: causal {causal[0]:8.1f} / {causal[1]:6.2f}   additive {additive[0]:8.1f} / "
              f"{additive[1]:6.2f}   bucketed to {padded:6d} {bucketed[0]:8.1f} / {bucketed[1]:6.2f}", flush=True)


if __name__ == "__main__":
    main()
