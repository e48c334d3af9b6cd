"""Shared fixtures: fresh random generators, the backends to run kernels on, real models."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import packaged


def gpu_available() -> bool:
    return mx.metal.is_available() or mx.cuda.is_available()


# MUSER_EMULATE=1 adds "emulated": the GPU path on the CPU, every kernel run by tests/emulate.py
# (each test's shapes compile once; slow on a cold cache, so not part of `make test`).
BACKENDS = ["cpu"] + (["gpu"] if gpu_available() else []) + (["emulated"] if os.environ.get("MUSER_EMULATE") else [])


def pytest_collection_modifyitems(config, items):
    """MUSER_TEST_SHARD=i/n keeps every n-th test from the i-th (0-based), so that n processes
    run the suite together (`make test-gpu SHARDS=n`: each GPU kernel shape compiles on first
    use, which is CPU work the machine's cores can share)."""
    shard = os.environ.get("MUSER_TEST_SHARD")
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"MUSER_TEST_SHARD={shard!r}: expected i/n, e.g. 0/4") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"MUSER_TEST_SHARD={shard!r}: i must lie in 0..n-1")
    kept = items[index::count]
    chosen = set(kept)
    config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
    items[:] = kept


@pytest.fixture
def rng():
    """A generator seeded from the OS: every run draws fresh inputs. The seed is printed
    so a failure can be replayed: MUSER_TEST_SEED=<seed> pytest <test id>."""
    chosen = os.environ.get("MUSER_TEST_SEED")
    seed = int(chosen) if chosen else int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test body with MLX's default device set to this backend ("emulated": the CPU,
    with the ops on their GPU path; the test sees "gpu")."""
    if request.param == "emulated":
        from tests.emulate import emulated_gpu

        with emulated_gpu():
            yield "gpu"
        return
    previous = mx.default_device()
    mx.set_default_device(mx.cpu if request.param == "cpu" else mx.gpu)
    yield request.param
    mx.set_default_device(previous)


def relative_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tile_settings(half, **fields):
    """Settings whose tile products (ops.TileProduct) take the f16 form (half true; "by token":
    its stage written by SIMD groups, Settings.tile_stage_by_token) or the int8 form at every
    count of rows (Settings.tile_half_from), with these other fields."""
    from muser_mlx.settings import Settings
    return Settings(tile_half_from=1 if half else 1 << 30, tile_stage_by_token=half == "by token", **fields)


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


def tiny_models(tmp_path, rng, window: int, default_weights: str):
    """make(architecture, weights=default_weights, **tiny_model options) -> (file, model): a tiny
    GGUF model of random weights (muser_mlx.testing.tiny_model) written and loaded."""
    from muser_mlx import gguf
    from muser_mlx.models import build_model
    from muser_mlx.testing import tiny_model

    def make(architecture, weights=default_weights, **kwargs):
        path = tiny_model(tmp_path / f"{architecture}-{weights}.gguf", architecture, rng,
                          weights=weights, window=window, **kwargs)
        file = gguf.read(path)
        return file, build_model(file)
    return make


def random_ids(rng, model, tokens):
    return rng.integers(0, model.config.vocab, size=tokens)

