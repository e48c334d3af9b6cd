"""Our kernels run on the CPU with GPU semantics, for tests: a third rendering of kernels/*.metal.

The Metal program MLX would compile (kernels.metal_program) becomes C++ through metal.h
(tests/emulator/: the Metal builtins as C++, one list) and EMULATION_TRANSLATION below; g++
builds it once into a shared library (cached under ~/.cache/muser_mlx/emulator, keyed by a hash
of the text), and tests/emulator/runtime.cpp runs a launch of it over numpy arrays:

- Threadgroups run one after another; a threadgroup's threads are fibers that share its
  `threadgroup` arrays (filled with NaN bytes as it starts). threadgroup_barrier waits for every
  thread that has not returned; SIMD-group functions (simd_sum, simd_shuffle, ...) wait for the
  32 consecutive threads of a SIMD group. A thread that returns while others wait at a barrier,
  lanes that meet different SIMD-group calls, or a SIMD-group call in a partial SIMD group is an
  error naming the threads, never a hang. Each launch has a CPU-time limit (an endless loop).
- The grid counts threads and is rounded up to whole threadgroups, as MLX's CUDA launch does:
  the last threadgroup's surplus threads run with thread_position_in_grid past the grid (the
  stricter case: Metal's dispatch_threads would cut them; partial_threadgroups=True does that).
- Every buffer ends exactly at an inaccessible page: a read or write past its end fails with
  the thread and the buffer named (before its start: only if it leaves the page). A buffer
  starts as aligned as its size allows (16 bytes if its size is a multiple of 16). Inputs are
  read-only, except those the kernel casts to a writable pointer (`(device half*)k_cache`):
  their writes reach the caller's array, as on a GPU. Outputs start as MLX's init_value
  (kernels.poisoned_outputs), else as 0xFF bytes (NaN), since MLX leaves them uninitialised.
- emulated_gpu() makes the ops take their GPU path and runs every launch here, twice: threads
  in order, then threads and threadgroups in reverse order; outputs that differ reveal a missing
  barrier, a race, or a kernel that counts on which threadgroup runs first or last.
- Device atomics (32-bit unsigned counters, metal.h) are plain read-modify-writes, since
  fibers switch only at barriers and SIMD-group functions; fences order nothing here.

Testing a kernel (tests/test_emulated_kernels.py has one test per kernel):

    with emulated_gpu() as launches, kernels.poisoned_outputs():
        out = np.array(ops.linear(x, weight))   # the op's real GPU path: its grid, template
    assert launches[0][0] == "matvec" and np.isfinite(out).all()   # NaN: never written
    assert relative_error(out, reference) <= 2e-5
    # one launch, no op yet: run(name, inputs, template, grid, threadgroup, shapes, dtypes)
    # a broken variant: emulated_gpu(sources={name: dataclasses.replace(kernels.source(name), ...)})

A builtin the kernel needs and metal.h lacks fails its build: add it there, in its section.

Not emulated: memory ordering between threads (fibers run one at a time, so a race shows only
when the two orders give different results or a read meets NaN; a fence is a no-op), textures, Metal's
fast math (float math here is correctly rounded, as in CUDA), swizzles, and anything that only
the CUDA rendering gets wrong (tests/test_kernels.py compiles that; the GPU suite runs it).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from muser_mlx import kernels
from muser_mlx.kernels import InputSpec

EMULATOR = Path(__file__).parent / "emulator"
# -fwrapv: integers wrap as on a GPU; -fno-strict-aliasing: kernels read bytes as uint4 or float4;
# -fstack-clash-protection: a local array too large for a thread's stack hits its guard page.
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-fwrapv", "-fno-strict-aliasing", "-fstack-clash-protection",
         "-Wno-attributes", f"-I{EMULATOR}"]
CPU_SECONDS = 60.0  # per launch and order

# Metal -> the C++ of metal.h: address spaces and attributes are macros there; what a macro
# cannot do is rewritten here.
EMULATION_TRANSLATION: list[tuple[str, str]] = [
    # A threadgroup array is one array per threadgroup: a static local, registered with the
    # runtime, which poisons it when each threadgroup starts.
    (r"\bthreadgroup\s+(\w+)\s+(\w+)\s*((?:\[[^\];]*\])*)\s*;", r"static \1 \2\3; MUSER_EMU_THREADGROUP(\2);"),
    # A pointer cast checks the alignment of the pointer it makes.
    (r"\(\s*((?:const\s+)?(?:device|constant|threadgroup|thread)\s+(?:const\s+)?\w+)\s*\*\s*\)",
     r"(::muser_emu::Aligned<\1>)"),
]

_DTYPES = {  # MLX dtype -> numpy dtype of its bytes
    mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
    mx.uint32: np.uint32, mx.int8: np.int8, mx.uint8: np.uint8, mx.int64: np.int64,
}
_lock = threading.RLock()  # one launch at a time: the runtime's state is global
_PARAMETER = re.compile(r"\s*(.*?)\s*\b(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\]\s*$")


class EmulationError(AssertionError):
    """A launch the GPU would get wrong: a fault, diverged threads, an endless loop, or (for
    emulated_gpu) outputs that depend on the order threads run in."""


def to_emulation(metal_text: str) -> str:
    text = metal_text
    for pattern, replacement in EMULATION_TRANSLATION:
        text = re.sub(pattern, replacement, text)
    # Any other `threadgroup` declaration would silently become one variable per thread.
    for match in re.finditer(r"(?<!<)(?<!<const )\bthreadgroup\b(?!\s+(?:const\s+)?\w+\s*\*).*", text):
        raise EmulationError(f"the emulator takes threadgroup arrays as `threadgroup TYPE NAME[N]...;`"
                             f" (add the form to EMULATION_TRANSLATION): {match.group(0)!r}")
    return text


def emulation_program(name: str, inputs: list[InputSpec], output_dtypes, template,
                      source: kernels.KernelSource | None = None) -> tuple[str, list[str], set[str]]:
    """The C++ program for one launch, its buffer parameters' names in order, and the inputs it
    writes in place (cast to a non-const device pointer). The program: metal_program's text (of
    `source` instead of the kernel file, if given) in an anonymous namespace, then
    muser_emu_entry(buffers), which calls the kernel with the running thread's attributes."""
    with _lock:
        saved = kernels.source
        if source is not None:
            kernels.source = lambda n: source if n == name else saved(n)
        try:
            metal = kernels.metal_program(name, inputs, output_dtypes, template)
        finally:
            kernels.source = saved
    function = f"custom_kernel_muser_{name}"
    signature = re.search(rf"void {function}\(\n(.*?)\) {{\n", metal, re.S).group(1)
    arguments, buffers = [], []
    for line in signature.split(",\n"):
        kind, parameter, attribute, index = _PARAMETER.match(line).groups()
        if attribute == "buffer":
            assert int(index) == len(buffers), line
            buffers.append(parameter)
            if kind.endswith("&"):
                arguments.append(f"*({kind[:-1]}*)b[{index}]")
            else:
                arguments.append(f"({kind})b[{index}]")
        else:
            arguments.append(f"::muser_emu::self->{attribute}")
    values = ", ".join(str(value) for _, value in template)
    program = (
        '#include "metal.h"\nnamespace {\n' + to_emulation(metal) + "}  // namespace\n"
        + 'extern "C" __attribute__((visibility("default"))) void muser_emu_entry(void* const* b) {\n'
        + f"  {function}<{values}>(\n    " + ",\n    ".join(arguments) + ");\n}\n"
    )
    return program, buffers, _in_place(kernels.source(name) if source is None else source)


# ---------------------------------------------------------------------------------------------
# Building (once per text, cached on disk) and loading
# ---------------------------------------------------------------------------------------------

_loaded: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("MUSER_EMU_CACHE", Path.home() / ".cache" / "muser_mlx" / "emulator"))


def compiler() -> str:
    path = shutil.which(os.environ.get("CXX", "g++"))
    if not path:
        raise EmulationError("the kernel emulator needs g++ (>= 12, for _Float16)")
    return path


def _build(command: list[str], path: Path, what: str, text: str = "") -> None:
    """Run g++ `command` (its output: the last argument) into `path` through a temporary
    directory, so that processes building the same file side by side each see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        command = [part.replace("{work}", work) for part in command]
        if text:
            Path(work, "program.cpp").write_text(text)
        result = subprocess.run([compiler(), *command], capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulationError(f"{what} does not compile:\n{result.stderr}\n--- program.cpp:\n{text}")
        os.replace(command[-1], path)


def _header_dir() -> Path:
    """A directory holding metal.h precompiled (g++ uses metal.h.gch where it would read
    metal.h): it saves about half of each kernel's build."""
    header = (EMULATOR / "metal.h").read_text()
    directory = cache_dir() / hashlib.sha256("\0".join([header, *FLAGS]).encode()).hexdigest()[:32]
    if not (directory / "metal.h.gch").exists():
        _build([*FLAGS, "-x", "c++-header", str(EMULATOR / "metal.h"), "-o", "{work}/metal.h.gch"],
               directory / "metal.h.gch", "metal.h")
    return directory


def _library(text: str, mode: int = ctypes.RTLD_LOCAL) -> ctypes.CDLL:
    """The shared library of C++ `text`, built once: a hash of the text, metal.h and the flags
    names it in the cache, so an edited kernel or header builds anew."""
    digest = hashlib.sha256("\0".join([text, (EMULATOR / "metal.h").read_text(), *FLAGS]).encode()).hexdigest()
    with _lock:
        if digest not in _loaded:
            path = cache_dir() / f"{digest[:32]}.so"
            if not path.exists():
                _build([f"-I{_header_dir()}", *FLAGS, "{work}/program.cpp", "-o", "{work}/lib.so"], path,
                       "the emulated program", text)
            _loaded[digest] = ctypes.CDLL(str(path), mode=mode)
        return _loaded[digest]


def _runtime() -> ctypes.CDLL:
    """runtime.cpp, loaded with its symbols global (the kernels' libraries call into it)."""
    library = _library((EMULATOR / "runtime.cpp").read_text(), mode=ctypes.RTLD_GLOBAL)
    library.muser_emu_launch.restype = ctypes.c_int
    return library


# ---------------------------------------------------------------------------------------------
# Running a launch
# ---------------------------------------------------------------------------------------------


def _host(array, in_place: bool = False) -> tuple[np.ndarray, mx.Dtype]:
    """A row-contiguous numpy copy of an input (as MLX's kernels take them) and its MLX dtype;
    for an input written in place, the caller's own memory where it is row-contiguous."""
    dtype = array.dtype if isinstance(array, mx.array) else None
    if dtype is not None and dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    host = np.asarray(array) if in_place else np.array(array)
    if not host.flags.c_contiguous or not host.flags.writeable:
        host = np.require(host, requirements="CW")  # (np.ascontiguousarray makes 0-d 1-d)
    if dtype is None:
        dtype = {np.dtype(v): k for k, v in _DTYPES.items() if k != mx.bfloat16}[host.dtype]
    return host, dtype


def _poisoned(shape, dtype, init_value) -> np.ndarray:
    """An output buffer: init_value in `dtype`, or 0xFF bytes (NaN) where MLX would leave
    memory uninitialised."""
    if init_value is None:
        size = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        return np.frombuffer(bytearray(b"\xff" * size), _DTYPES[dtype]).reshape(shape)
    with np.errstate(invalid="ignore"):
        if dtype == mx.bfloat16:
            return (np.full(shape, init_value, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return np.full(shape, init_value, np.float64).astype(_DTYPES[dtype])


def run(name: str, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
        *, order: str = "forward", partial_threadgroups: bool = False, cpu_seconds: float = CPU_SECONDS,
        source: kernels.KernelSource | None = None) -> list[np.ndarray]:
    """One launch of kernel `name` (kernels.launch's arguments; inputs as mx or numpy arrays),
    emulated; returns the outputs as numpy arrays (bfloat16 as its uint16 bits); inputs the
    kernel writes in place are written, where row-contiguous (else a copy is). `order`:
    "forward" or "reverse", the order the scheduler runs a threadgroup's threads (and, in
    reverse, the threadgroups) in. `source`
    replaces the kernel's file (tests of broken kernels). Raises EmulationError."""
    kernel = source or kernels.source(name)
    specs = [InputSpec(a.dtype if isinstance(a, mx.array) else _host(a)[1], a.ndim, a.size) for a in inputs]
    program, parameters, in_place = emulation_program(name, specs, output_dtypes, template, source)
    hosts = [_host(array, arg in in_place) for arg, array in zip(kernel.inputs, inputs)]
    runtime = _runtime()  # first: the kernel's library links against it
    library = _library(program)
    outputs = [_poisoned(tuple(shape), dtype, init_value) for shape, dtype in zip(output_shapes, output_dtypes)]
    by_name = dict(zip(kernel.outputs, outputs))
    for arg, (array, _) in zip(kernel.inputs, hosts):  # with the shapes MLX passes where named
        by_name.update({arg: array, f"{arg}_shape": np.array(array.shape, np.int32),
                        f"{arg}_strides": np.array(array.strides, np.int64) // array.itemsize,
                        f"{arg}_ndim": np.array(array.ndim, np.int32)})
    buffers = [by_name[parameter] for parameter in parameters]
    count = len(buffers)
    message = ctypes.create_string_buffer(4096)
    dims = [tuple(grid) + (1,) * (3 - len(grid)), tuple(threadgroup) + (1,) * (3 - len(threadgroup))]
    with _lock:
        status = runtime.muser_emu_launch(
            ctypes.cast(library.muser_emu_entry, ctypes.c_void_p),
            count,
            (ctypes.c_void_p * count)(*[b.ctypes.data for b in buffers]),
            (ctypes.c_size_t * count)(*[b.nbytes for b in buffers]),
            (ctypes.c_size_t * count)(*[b.itemsize for b in buffers]),
            (ctypes.c_int * count)(*[int(p in kernel.outputs or p in in_place) for p in parameters]),
            (ctypes.c_char_p * count)(*[p.encode() for p in parameters]),
            (ctypes.c_uint * 3)(*dims[0]), (ctypes.c_uint * 3)(*dims[1]),
            int(order == "reverse"), int(partial_threadgroups), ctypes.c_double(cpu_seconds),
            message, ctypes.c_size_t(len(message)))
    if status != 0:
        raise EmulationError(f"{name} {dict(template)} grid {tuple(grid)} threadgroup {tuple(threadgroup)} "
                             f"({order}): {message.value.decode()}")
    return outputs


# ---------------------------------------------------------------------------------------------
# The ops' GPU path on the CPU
# ---------------------------------------------------------------------------------------------


class EmulatedKernel:
    """Stands in for the mx.fast kernel object kernels.build returns: called as MLX's kernels
    are, it runs the launch once per order and requires the same output bits from each (and
    the same writes to in-place inputs: the orders before the last run on copies of them)."""

    def __init__(self, name: str, orders, launches: list, source: kernels.KernelSource | None = None):
        self.name, self.orders, self.launches, self.source = name, orders, launches, source

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                 init_value=None, **_):
        self.launches.append((self.name, dict(template), tuple(grid), tuple(threadgroup)))
        kernel = self.source or kernels.source(self.name)
        written = [i for i, arg in enumerate(kernel.inputs) if arg in _in_place(kernel)]
        names = list(kernel.outputs) + [kernel.inputs[i] for i in written]
        results = []
        for k, order in enumerate(self.orders):  # all but the last on copies of in-place inputs
            args = [_copy(a) if i in written and k + 1 < len(self.orders) else a for i, a in enumerate(inputs)]
            outputs = run(self.name, args, template, grid, threadgroup, output_shapes, output_dtypes,
                          init_value, order=order, source=self.source)
            results.append(outputs + [_host(args[i])[0] for i in written])
        for order, other in zip(self.orders[1:], results[1:]):
            for arg, first, second in zip(names, results[0], other):
                if first.tobytes() != second.tobytes():
                    changed = int(np.sum(first.view(np.uint8) != second.view(np.uint8)))
                    raise EmulationError(
                        f"{self.name} {dict(template)}: `{arg}` differs between threads run "
                        f"{self.orders[0]} and {order} ({changed} bytes): a missing barrier, or "
                        f"threads writing the same element")
        outs = [mx.array(out) for out in results[-1][: len(output_dtypes)]]
        return [out.view(mx.bfloat16) if dtype == mx.bfloat16 else out
                for out, dtype in zip(outs, output_dtypes)]


def _in_place(kernel: kernels.KernelSource) -> set[str]:
    """The inputs a kernel writes in place: those it casts to a non-const device pointer."""
    return set(re.findall(r"\(\s*device\s+\w+\s*\*\s*\)\s*(\w+)", kernel.header + kernel.body))


def _copy(array):
    """An independent copy of an mx or numpy array, of the same dtype."""
    if isinstance(array, mx.array):
        copy = mx.array(np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array))
        return copy.view(mx.bfloat16) if array.dtype == mx.bfloat16 else copy
    return np.array(array)


@contextlib.contextmanager
def emulated_gpu(backend: str = "cuda", orders=("forward", "reverse"), sources: dict | None = None):
    """Inside this block kernels.backend() reports `backend`, so the ops take their GPU path,
    and every kernel is built as an EmulatedKernel: kernels.launch itself (its poisoned outputs
    included) runs unchanged. mx.compile returns functions as they are (an emulated kernel
    reads its inputs' values, which a traced graph lacks). `sources` maps kernel names to a
    KernelSource to run instead of the file (a test's broken variant). Yields the list of
    launches: (name, template, grid, threadgroup)."""
    launches: list = []
    saved = kernels.backend, kernels.build, mx.compile
    kernels.backend = lambda: backend
    kernels.build = lambda name, backend_name: EmulatedKernel(name, tuple(orders), launches, (sources or {}).get(name))
    mx.compile = lambda function, *args, **kwargs: function  # an emulated kernel needs its inputs' values
    try:
        yield launches
    finally:
        kernels.backend, kernels.build, mx.compile = saved
