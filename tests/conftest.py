"""Shared fixtures: fresh random generators, the backends to run kernels on, real models."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import packaged


def gpu_available() -> bool:
    return mx.metal.is_available() or mx.cuda.is_available()


BACKENDS = ["cpu"] + (["gpu"] if gpu_available() else [])


@pytest.fixture
def rng():
    """A generator seeded from the OS: every run draws fresh inputs. The seed is printed
    so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test body with MLX's default device set to this backend."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu if request.param == "cpu" else mx.gpu)
    yield request.param
    mx.set_default_device(previous)


def relative_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return packaged.smollm2_path()
    except packaged.ModelNotInstalledError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def gemma3_path():
    try:
        return packaged.gemma3_path()
    except packaged.ModelNotInstalledError as error:
        pytest.skip(str(error))
