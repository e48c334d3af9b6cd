"""The bandwidth ceiling every benchmark here reports its figures against."""

import statistics
import time

import mlx.core as mx


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by an elementwise pass (x + 1) over `nbytes` of
    float32 on the default device: the median of `repeats` timed evaluations after a warm-up."""
    x = mx.random.normal((nbytes // 4,))
    mx.eval(x)
    mx.eval(x + 1.0)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(x + 1.0)
        times.append(time.perf_counter() - tic)
    return 2 * nbytes / statistics.median(times)
