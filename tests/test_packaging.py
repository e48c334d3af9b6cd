"""A non-editable install (`pip install .`) carries the kernel sources and finds them, and
its compiled CPU products (built by setup.py for this machine) load."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def pip(*args):
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def local_setuptools_is_recent() -> bool:
    """pyproject needs setuptools >= 64 (and `wheel` before setuptools 70.1); where the
    environment has them, build without fetching any (the GPU machine has no package index)."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if major < 64:
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


def test_wheel_install_finds_its_kernel_sources(tmp_path):
    isolation = ["--no-build-isolation"] if local_setuptools_is_recent() else []
    # Build from a copy of the sources: setuptools reuses a checkout's build/ directory, where a
    # kernel deleted since the last build would still sit and end up in the wheel.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", ".venv", ".device", ".git", ".hypothesis", ".pytest_cache",
        "__pycache__", "tests", "examples", "bench"))
    pip("wheel", "-q", "--no-deps", *isolation, "-w", str(tmp_path / "wheels"), str(source))
    target = tmp_path / "site"
    pip("install", "-q", "--no-deps", "--target", str(target), str(next((tmp_path / "wheels").glob("*.whl"))))
    probe = (
        "from muser_mlx import kernels; "
        "print(kernels.kernel_dir()); print(kernels.kernel_names()); "
        "print(kernels.source('embedding').inputs); "
        "from muser_mlx import cpu_ext; print(cpu_ext.available(), cpu_ext.unavailable())"
    )
    # From outside the checkout, with the installed copy first on the path (then whatever path
    # the test run had: where MLX itself may be installed).
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(target / "muser_mlx" / "_kernel_sources")
    assert lines[1] == str(sorted(p.stem for p in (ROOT / "kernels").glob("*.metal") if p.stem != "blocks"))
    assert lines[2] == "('table', 'token_ids')"
    if os.environ.get("MUSER_REQUIRE_CPU_EXT") == "1":  # make test; a machine without CMake or
        # nanobind for the build (the GPU machine) installs the wheel without them
        assert lines[3] == "True ", "the wheel's CPU products (muser_mlx._cpu_kernels) do not load"
