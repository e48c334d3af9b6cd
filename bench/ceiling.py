"""The bandwidth ceiling every benchmark here reports its figures against."""

import statistics
import time

import mlx.core as mx


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by an elementwise pass (x + 1) over `nbytes` of
    float32 on the default device: the median of `repeats` timed evaluations after a warm-up.
    Its arrays are freed and MLX's peak-memory counter reset on return, so that the peak a
    benchmark reports afterwards is its own, not this measurement's 2 x nbytes."""
    x = mx.random.normal((nbytes // 4,))
    mx.eval(x)
    mx.eval(x + 1.0)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(x + 1.0)
        times.append(time.perf_counter() - tic)
    del x
    mx.clear_cache()
    mx.reset_peak_memory()
    return 2 * nbytes / statistics.median(times)
