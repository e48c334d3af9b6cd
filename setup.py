"""Builds muser_mlx._cpu_kernels, the CPU products (kernels/cpu), with CMake at install, for the
installing machine's CPU, or for the instruction set the environment's MUSER_CPU_ARCH names (a
-march value, e.g. x86-64-v3: AVX2; kernels/cpu/CMakeLists.txt). Everything else about the
package is in pyproject.toml.

Where the extension cannot be built (no C++ compiler or CMake, an unsupported platform), the
install still succeeds: the build says so, and muser_mlx runs its MLX-ops path on the CPU
(muser_mlx/cpu_ext.py logs that once at first use).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class BuildCPUKernels(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ext.source_dir), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
            # Installed beside mlx: libmlx.so is in site-packages/mlx/lib.
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
            "-DCMAKE_INSTALL_RPATH=$ORIGIN/../mlx/lib",
            f"-DMUSER_CPU_ARCH={os.environ.get('MUSER_CPU_ARCH') or 'native'}",
        ]
        try:
            subprocess.run(configure, check=True)
            subprocess.run(["cmake", "--build", str(build_dir), f"-j{os.cpu_count() or 1}"], check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            message = (f"muser_mlx: the CPU products (kernels/cpu) were not built ({error}). "
                       "The package works without them, through MLX's own ops on the CPU, "
                       "several times slower; install a C++20 compiler and CMake >= 3.24, then "
                       "reinstall.")
            print(f"\n{'!' * 80}\n{message}\n{'!' * 80}\n", file=sys.stderr)


setup(
    ext_modules=[CMakeExtension("muser_mlx._cpu_kernels", ROOT / "kernels" / "cpu")],
    cmdclass={"build_ext": BuildCPUKernels},
)
