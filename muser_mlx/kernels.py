"""Kernel sources: load them, render them for the backend in use, build each once, launch.

Every kernel is written once, in Metal, as the body of an `mx.fast.metal_kernel` (the file
`kernels/<name>.metal`), plus the shared helpers of `kernels/lib/` that it includes. A kernel
file starts with `// kernel:`, `// inputs:` and `// outputs:` lines naming its parameters, and
names the lib files it uses with `#include "lib/<file>.metal"` lines (paths from kernels/); a lib
file includes the lib files it builds on the same way. The include lines never reach MLX, which
takes a body and a header: `kernel_source` resolves them into the header, keeping only the
definitions the kernel uses.

For NVIDIA GPUs the same text becomes an `mx.fast.cuda_kernel` through `CUDA_TRANSLATION`, a
short table of textual rewrites plus `CUDA_PRELUDE` (the few Metal builtins CUDA lacks). The
kernel dialect is kept small enough for that table: one-dimensional threadgroups, no vector
types beyond uint2, uint4 and float4, scalars passed as template constants or read from input shapes.
What the two languages spell differently (a packed int8 dot product and a funnel shift, which
Metal lacks; device atomics and the device fence) are lib/base.metal's only
`#if defined(__CUDACC__)` branches.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

LIB = "lib"  # kernels/lib/: the helpers kernels include (not kernels themselves)
MAX_GRID = 2**31 - 1  # threads in one launch, at most


def kernel_dir() -> Path:
    """kernels/ of a checkout, or the copy a wheel installs beside this module
    (pyproject maps kernels/ to muser_mlx/_kernel_sources)."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "kernels"
    return checkout if checkout.is_dir() else here / "_kernel_sources"


@dataclass(frozen=True)
class KernelSource:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: str  # Metal text: the body of the kernel function
    header: str  # Metal text: helpers placed before the kernel


class KernelSourceError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def source(name: str) -> KernelSource:
    path = kernel_dir() / f"{name}.metal"
    text = path.read_text()
    fields = {}
    for line in text.splitlines():
        match = re.match(r"//\s*(kernel|inputs|outputs):\s*(.*)$", line)
        if match:
            fields[match.group(1)] = match.group(2).split()
    if fields.get("kernel") != [name] or "inputs" not in fields or "outputs" not in fields:
        raise KernelSourceError(f"{path}: needs '// kernel: {name}', '// inputs:' and '// outputs:' lines")
    return kernel_source(name, tuple(fields["inputs"]), tuple(fields["outputs"]), text)


def kernel_source(name: str, inputs: tuple, outputs: tuple, text: str) -> KernelSource:
    """A kernel's Metal text (a file's, or a test's probe), comments dropped, its #include
    lines resolved: the header holds the definitions of the included lib files that the body
    uses, directly or through each other (_used_definitions)."""
    files = _included_files(text, f"kernel {name}")
    helpers = "".join(_without_includes(_lib_text(path)) for path in files)
    body = _code_only(_without_includes(text))
    return KernelSource(name, inputs, outputs, body, _used_definitions(_code_only(helpers), body))


_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b(.*)$", re.M)


def _includes(text: str, where: str) -> list[str]:
    """The paths of `text`'s #include lines, in order; each must be `#include "lib/<file>.metal"`."""
    paths = []
    for match in _INCLUDE.finditer(text):
        path = re.fullmatch(r'\s*"([^"]+)"\s*(//.*)?', match.group(1))
        if path is None or not path.group(1).startswith(f"{LIB}/") or ".." in path.group(1).split("/"):
            raise KernelSourceError(f'{where}: {match.group(0).strip()!r}: kernels include lib files only, as '
                                    f'#include "{LIB}/<file>.metal"')
        paths.append(path.group(1))
    return paths


def _without_includes(text: str) -> str:
    return _INCLUDE.sub("", text)


def _lib_text(path: str) -> str:
    file = kernel_dir() / path
    if not file.is_file():
        raise KernelSourceError(f"#include \"{path}\": no file {path} in {kernel_dir()}")
    return file.read_text()


def _included_files(text: str, where: str) -> list[str]:
    """The lib files `text` includes, directly or through other lib files, each once and after
    every file it includes (the order a C preprocessor with include guards would give)."""
    files: list[str] = []

    def visit(path: str, chain: list[str]) -> None:
        if path in chain:
            raise KernelSourceError(f"include cycle: {' -> '.join([*chain, path])}")
        if path in files:
            return
        try:
            inner = _includes(_lib_text(path), path)
        except KernelSourceError as error:
            raise KernelSourceError(f"{chain[-1]}: {error}") from None
        for included in inner:
            visit(included, [*chain, path])
        files.append(path)

    for path in _includes(text, where):
        visit(path, [where])
    return files


def _definitions(code: str) -> list[str]:
    """The top-level definitions of helper code (comments and blank lines already dropped), each
    whole, in order: a `#define` line; an `#if` .. `#endif` block (its branches define the same
    names); or a declaration from its first line (`template <...>` included) to the line that
    closes its last brace at depth 0 or ends it with `;`. Blank lines split nothing."""
    definitions, lines, depth, nesting = [], [], 0, 0
    for line in filter(None, code.splitlines()):
        lines.append(line)
        if re.match(r"#\s*if", line):
            nesting += 1
        elif re.match(r"#\s*endif", line):
            nesting -= 1
        elif not line.startswith("#"):
            depth += line.count("{") - line.count("}")
        if nesting == 0 and depth == 0 and (line.startswith("#") or line.endswith(("}", ";"))):
            definitions.append("\n".join(lines) + "\n")
            lines = []
        if depth < 0 or nesting < 0:
            raise KernelSourceError(f"unbalanced helper code at {line!r}")
    if lines:
        raise KernelSourceError(f"helper code ends inside a definition: {lines[0]!r}")
    return definitions


def _used_definitions(helpers: str, body: str) -> str:
    """The definitions of `helpers` (_definitions) that define a `muser_*` or `MUSER_*` name the
    body uses, directly or through another definition, in their order. MLX hashes a kernel's
    whole source at every launch (_code_only), so each kernel carries only its own helpers:
    whole lib files would make attention_combine's header 27 KB, for the 1 KB it uses."""
    definitions = _definitions(helpers)
    defined = [set(re.findall(r"#define\s+(MUSER_\w+)", d)) | set(re.findall(r"^struct\s+(muser_\w+)", d, re.M)) |
               set(re.findall(r"^(?:inline|constant)\b[^(\[]*?\b(muser_\w+)\s*[(\[]", d, re.M))
               for d in definitions]
    wanted, used = set(re.findall(r"\b(?:muser|MUSER)_\w+", body)), set()
    while True:
        new = {i for i, names in enumerate(defined) if names & wanted} - used
        if not new:
            break
        used |= new
        for i in new:
            wanted |= set(re.findall(r"\b(?:muser|MUSER)_\w+", definitions[i]))
    return "".join(definitions[i] for i in sorted(used))


def _code_only(text: str) -> str:
    """The text without comments, blank lines, indentation and the spaces around punctuation
    (lines kept, so a compiler's message still points at one): MLX builds and hashes a
    kernel's whole source at every launch (H200 host, bench/launch.py: ~0.2 us a KB), so the
    ~half of our files that is comments, and ~20 % of the rest that is spaces, costs time in
    every step."""
    lines = (_squeezed(re.sub(r"\s*//.*$", "", line)) for line in text.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


_PUNCTUATION = set("(){}[];,=<>+-*/&|!?:.^%~")
_SEPARATORS = set("(){}[];,")


def _squeezed(line: str) -> str:
    """A line of code without its indentation and the spaces that separate nothing: those
    beside a bracket, comma or semicolon, or between a word and an operator. Spaces between two
    words, and between two operators (`- -x`, `a / *p`, `> >`), stay; so do preprocessor lines
    (`#define NAME (x)` differs from `#define NAME(x)`)."""
    line = line.strip()
    if line.startswith("#"):
        return line

    def space(match: re.Match) -> str:
        before = line[match.start() - 1] if match.start() else ""
        after = line[match.end()] if match.end() < len(line) else ""
        if before in _SEPARATORS or after in _SEPARATORS or (before in _PUNCTUATION) != (after in _PUNCTUATION):
            return ""
        return " "

    return re.sub(r"[ \t]+", space, line)


def kernel_names() -> list[str]:
    """The kernels: kernels/*.metal (the lib files sit in kernels/lib/)."""
    return sorted(p.stem for p in kernel_dir().glob("*.metal"))


# ---------------------------------------------------------------------------------------------
# Metal -> CUDA
# ---------------------------------------------------------------------------------------------

# Threadgroups are one-dimensional in this dialect, so SIMD positions come from threadIdx.x.
CUDA_TRANSLATION: list[tuple[str, str]] = [
    (r"\bthread_position_in_grid\.x\b", "(blockIdx.x * blockDim.x + threadIdx.x)"),
    (r"\bthread_position_in_threadgroup\.x\b", "threadIdx.x"),
    (r"\bthreadgroup_position_in_grid\.x\b", "blockIdx.x"),
    (r"\bthreadgroup_position_in_grid\.y\b", "blockIdx.y"),
    (r"\bthreadgroup_position_in_grid\.z\b", "blockIdx.z"),
    (r"\bthreads_per_threadgroup\.x\b", "blockDim.x"),
    (r"\bthread_index_in_simdgroup\b", "(threadIdx.x % 32u)"),
    (r"\bsimdgroup_index_in_threadgroup\b", "(threadIdx.x / 32u)"),
    (r"\bthreadgroups_per_grid\.x\b", "gridDim.x"),
    (r"threadgroup_barrier\(mem_flags::mem_threadgroup\)", "__syncthreads()"),
    (r"simdgroup_barrier\(mem_flags::mem_threadgroup\)", "__syncwarp()"),
    # Address spaces: a pointer parameter into threadgroup or thread memory is a plain pointer
    # in CUDA (generic addressing); a threadgroup array in a kernel body is __shared__.
    (r"\bthreadgroup\s+(\w+)\s*\*", r"\1*"),
    (r"\bthread\s+(\w+)\s*\*", r"\1*"),
    (r"\bthread\s+", ""),
    (r"\bthreadgroup\s+", "__shared__ "),
    (r"\bdevice\s+", ""),
    (r"\bconstant\s+", "__constant__ "),
    (r"\binline\s+", "__device__ inline "),
    (r"\bas_type<half>", "__ushort_as_half"),
    (r"\bas_type<ushort>", "__half_as_ushort"),  # of a half only
    (r"\bas_type<float>", "__uint_as_float"),
    (r"\buint2\(", "make_uint2("),
    (r"\buint4\(", "make_uint4("),
    (r"\bfloat4\(", "make_float4("),
    (r"\bmetal::", ""),
]

CUDA_PRELUDE = """\
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
__device__ inline float simd_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}
__device__ inline float simd_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}
__device__ inline float simd_shuffle_xor(float value, unsigned int mask) {
  return __shfl_xor_sync(0xffffffffu, value, mask);
}
__device__ inline float simd_shuffle(float value, unsigned int lane) {
  return __shfl_sync(0xffffffffu, value, lane);
}
"""


def to_cuda(metal_text: str) -> str:
    text = metal_text
    for pattern, replacement in CUDA_TRANSLATION:
        text = re.sub(pattern, replacement, text)
    return text


# ---------------------------------------------------------------------------------------------
# Backends and building
# ---------------------------------------------------------------------------------------------


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where the default device runs kernels."""
    return "cpu" if mx.default_device() == mx.cpu else _gpu_backend()


@functools.lru_cache(maxsize=None)
def _gpu_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def build(name: str, backend_name: str):
    """The MLX kernel object for `name` on `backend_name`, built once per process (on CUDA
    once per CUDA_INCLUDES setting: a bench variant may change it between traces)."""
    return _build(name, backend_name, CUDA_INCLUDES if backend_name == "cuda" else None)


@functools.lru_cache(maxsize=None)
def _build(name: str, backend_name: str, includes: bool | None):
    kernel = source(name)
    if backend_name == "metal":
        return mx.fast.metal_kernel(
            name=f"muser_{name}",
            input_names=list(kernel.inputs),
            output_names=list(kernel.outputs),
            source=kernel.body,
            header=kernel.header,
        )
    if backend_name == "cuda":
        if includes:
            return IncludedCudaKernel(kernel)
        return mx.fast.cuda_kernel(
            name=f"muser_{name}",
            input_names=list(kernel.inputs),
            output_names=list(kernel.outputs),
            source=to_cuda(kernel.body),
            header=CUDA_PRELUDE + to_cuda(kernel.header),
        )
    raise ValueError(f"no GPU kernels on backend {backend_name!r}")


# MLX's CUDA custom kernel hashes its whole source text at every launch (CustomKernel::eval_gpu
# names the JIT module by it): 9-10 KB for a product or attention_decode, ~3 MB a Muse Glimmer
# decode step, ~0.5 ms of host time a step at ~6 GB/s. So on CUDA each launch configuration's
# text (the same CUDA rendering, template constants included) is written once to two files
# named by their content, and the kernel MLX sees is two #include lines that NVRTC reads back:
# ~150 bytes to hash. MUSER_CUDA_INCLUDES=0: the text inline, as MLX's examples pass it.
CUDA_INCLUDES = os.environ.get("MUSER_CUDA_INCLUDES", "1") != "0"


def cuda_text_dir() -> Path:
    """Where the CUDA texts go: $MUSER_KERNEL_CACHE, else $XDG_CACHE_HOME/muser_mlx/cuda
    (~/.cache), else the temporary directory when that cannot be written."""
    explicit = os.environ.get("MUSER_KERNEL_CACHE")
    if explicit:
        candidates = [Path(explicit)]
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        candidates = [Path(cache) / "muser_mlx" / "cuda", Path(tempfile.gettempdir()) / "muser_mlx_cuda"]
    for directory in candidates:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory.resolve()
        except OSError:
            pass
    raise KernelSourceError(f"no writable directory for the CUDA kernel texts (tried {', '.join(map(str, candidates))}); "
                            f"set MUSER_KERNEL_CACHE, or MUSER_CUDA_INCLUDES=0 to pass them inline")


def cuda_text_file(text: str, directory: Path | None = None) -> Path:
    """`text` in a file named by its SHA-256 (written once, atomically: a file of that name is
    complete). Its path must not hold a double quote: it goes into an #include line."""
    directory = directory or cuda_text_dir()
    path = directory / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.cuh"
    if '"' in str(path) or "\\" in str(path):
        raise KernelSourceError(f"CUDA kernel text directory {directory} holds a quote or a backslash")
    if not path.exists():
        fd, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    return path


def cuda_constants(template) -> str:
    """Template constants as MLX's cuda_kernel writes them into the kernel's body (but for
    LAUNCH_*, which cuda_launch_bounds turns into the header's)."""
    lines = []
    for key, value in template:
        if key.startswith("LAUNCH_"):
            continue
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {key} = {'true' if value else 'false'};\n")
        elif isinstance(value, int) or hasattr(value, "__index__"):
            lines.append(f"  constexpr int {key} = {int(value)};\n")
        else:
            raise KernelSourceError(f"template constant {key}={value!r}: the CUDA kernels take ints and bools")
    return "".join(lines) + ("\n" if lines else "")


def cuda_included_texts(kernel: KernelSource, template) -> tuple[str, str]:
    """(header, body) for one launch configuration, as the files hold them: MLX's cuda_kernel
    places the header before the kernel function and the body inside it."""
    return (CUDA_PRELUDE + to_cuda(kernel.header) + cuda_launch_bounds(template),
            cuda_constants(template) + to_cuda(kernel.body))


def cuda_launch_bounds(template) -> str:
    """CUDA's __launch_bounds__ for a launch whose template holds LAUNCH_THREADS (its
    threadgroup's threads) and LAUNCH_MIN_THREADGROUPS > 0 (the threadgroups an SM must hold at
    once: ptxas caps the registers a thread to fit them, spilling if it must). MLX writes the
    kernel's signature itself, so the header redefines __global__ for the one function after
    it. Only in the included texts (CUDA_INCLUDES): inline, one header serves every template.
    Metal has no such bound; there the constants go unused."""
    values = dict(template or ())
    least = int(values.get("LAUNCH_MIN_THREADGROUPS", 0))
    if least <= 0:
        return ""
    threads = int(values["LAUNCH_THREADS"])
    return ("#if defined(__location__)\n#undef __global__\n"
            f"#define __global__ __location__(global) __launch_bounds__({threads}, {least})\n#endif\n")


def cuda_included_arguments(kernel: KernelSource, template, directory: Path | None = None) -> tuple[str, str, str]:
    """(name, source, header) for MLX's cuda_kernel: one launch configuration's texts in files
    (cuda_text_file), included."""
    header, body = cuda_included_texts(kernel, template)
    header_path, body_path = cuda_text_file(header, directory), cuda_text_file(body, directory)
    # MLX adds an input's shape / strides / ndim parameters when the source mentions them by
    # name: the body is in a file, so the names go in a comment.
    mentions = [f"{arg}_{suffix}" for arg in kernel.inputs for suffix in ("shape", "strides", "ndim")
                if f"{arg}_{suffix}" in kernel.body]
    digest = hashlib.sha256((header + body).encode()).hexdigest()[:16]
    return (f"muser_{kernel.name}_{digest}",
            f'#include "{body_path}"\n' + (f"// {' '.join(mentions)}\n" if mentions else ""),
            f'#include "{header_path}"\n')


class IncludedCudaKernel:
    """A kernel MLX's cuda_kernel builds from #include lines (CUDA_INCLUDES): one mx.fast kernel
    per launch configuration (template), named by its text's digest, called as MLX's are."""

    def __init__(self, kernel: KernelSource):
        self.kernel = kernel
        self._built: dict = {}

    def specialized(self, template):
        key = tuple(template or ())
        built = self._built.get(key)
        if built is None:
            name, body, header = cuda_included_arguments(self.kernel, key)
            built = mx.fast.cuda_kernel(name=name, input_names=list(self.kernel.inputs),
                                        output_names=list(self.kernel.outputs), source=body, header=header)
            self._built[key] = built
        return built

    def __call__(self, *, inputs, template, **launch):
        return self.specialized(template)(inputs=inputs, **launch)


# MLX's CUDA allocator keeps every array of at most 8 bytes in one small pool of managed
# (unified) memory. When the host writes one (a step's position) or reads one (the greedy
# token), the pool's page moves to the host, and the next kernel that touches any of them
# page-faults it back (H200, ncu: 60 % of attention_decode's stall samples sat on its first
# read of the position). Arrays that kernels read every step are made at least
# MIN_ARRAY_VALUES values long (16 bytes for 4-byte values) so that they live in device memory;
# 1 turns the padding off.
MIN_ARRAY_VALUES = 4


def padded_array(values, dtype) -> mx.array:
    """mx.array(values, dtype) with zeros appended up to MIN_ARRAY_VALUES values (the kernels
    read the leading ones)."""
    values = list(values)
    return mx.array(values + [0] * (MIN_ARRAY_VALUES - len(values)), dtype=dtype)


def parameters(*values: float) -> mx.array:
    """A small float32 array of a launch's scalar parameters (eps, scales), made once per
    distinct list (padded_array): a step that passes the same parameters reuses the array."""
    return _parameters(values, MIN_ARRAY_VALUES)


@functools.lru_cache(maxsize=None)
def _parameters(values: tuple, _padding: int) -> mx.array:
    return padded_array(values, mx.float32)


_poison: list[float] = []


@contextlib.contextmanager
def poisoned_outputs(value: float = float("nan")):
    """Inside this block every launch first fills its outputs with `value` (NaN by default),
    so a test sees any element a kernel failed to write."""
    _poison.append(value)
    try:
        yield
    finally:
        _poison.pop()


def launch(name: str, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """Run kernel `name` on the current GPU backend; returns its list of outputs."""
    kernel = build(name, backend())
    return kernel(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
        init_value=_poison[-1] if _poison else None,
    )


# ---------------------------------------------------------------------------------------------
# Whole programs as MLX would compile them (for the compile checks and for reading)
# ---------------------------------------------------------------------------------------------

_METAL_TYPES = {
    mx.uint8: "uint8_t", mx.int8: "int8_t", mx.uint32: "uint32_t", mx.int32: "int32_t",
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
}
_CUDA_TYPES = {
    mx.uint8: "uint8_t", mx.int8: "int8_t", mx.uint32: "uint32_t", mx.int32: "int32_t",
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
}
# Metal thread attributes MLX adds to the signature when their name appears in the body.
_METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


_METAL_SHAPE_TYPES = {"shape": "const constant int*", "strides": "const constant int64_t*", "ndim": "const constant int&"}
_CUDA_SHAPE_TYPES = {"shape": "Shape", "strides": "Strides", "ndim": "int"}


def _shape_suffixes(body: str, arg: str, spec: "InputSpec") -> list[str]:
    """The shape, strides and ndim parameters MLX adds after an input, in its order: those
    whose name the body mentions, for inputs of rank >= 1."""
    if spec.ndim == 0:
        return []
    return [suffix for suffix in ("shape", "strides", "ndim") if f"{arg}_{suffix}" in body]


@dataclass(frozen=True)
class InputSpec:
    dtype: mx.Dtype
    ndim: int
    size: int


def metal_program(name: str, inputs: list[InputSpec], output_dtypes, template,
                  kernel: KernelSource | None = None) -> str:
    """The Metal text MLX's metal_kernel compiles for this launch: header, generated
    signature (small inputs in `constant`, shapes where the body names them, thread
    attributes the body uses), body, and the explicit template instantiation. `kernel`: a
    source other than kernels/<name>.metal (tests' probes)."""
    kernel = kernel or source(name)
    function = f"custom_kernel_muser_{name}"
    params = []
    for arg, spec in zip(kernel.inputs, inputs):
        space = "constant" if spec.size < 8 else "device"
        ref = "&" if spec.ndim == 0 else "*"
        params.append(f"  const {space} {_METAL_TYPES[spec.dtype]}{ref} {arg} [[buffer({len(params)})]]")
        for suffix in _shape_suffixes(kernel.body, arg, spec):
            params.append(f"  {_METAL_SHAPE_TYPES[suffix]} {arg}_{suffix} [[buffer({len(params)})]]")
    for arg, dtype in zip(kernel.outputs, output_dtypes):
        params.append(f"  device {_METAL_TYPES[dtype]}* {arg} [[buffer({len(params)})]]")
    for attribute, kind in _METAL_ATTRIBUTES:
        if attribute in kernel.body:
            params.append(f"  {kind} {attribute} [[{attribute}]]")
    template_params = ", ".join(f"int {key}" for key, _ in template)
    template_values = ", ".join(str(value) for _, value in template)
    host_name = f"{function}_{'_'.join(str(value) for _, value in template)}"
    return (
        kernel.header
        + f"template <{template_params}>\n[[kernel]] void {function}(\n"
        + ",\n".join(params)
        + ") {\n"
        + kernel.body
        + "\n}\n"
        + f'template [[host_name("{host_name}")]] [[kernel]] '
        + f"decltype({function}<{template_values}>) {function}<{template_values}>;\n"
    )


def cuda_program(name: str, inputs: list[InputSpec], output_dtypes, template,
                 kernel: KernelSource | None = None, included: Path | None = None) -> str:
    """The CUDA text MLX's cuda_kernel compiles for this launch (after its default header):
    our prelude and helpers, then the generated __global__ function with the template
    constants as constexprs. `kernel`: as metal_program's. included: a directory: the text as
    CUDA_INCLUDES hands it to MLX, two #include lines of files written there."""
    kernel = kernel or source(name)
    params = []
    for arg, spec in zip(kernel.inputs, inputs):
        params.append(f"    const {_CUDA_TYPES[spec.dtype]}* {arg}")
        for suffix in _shape_suffixes(kernel.body, arg, spec):
            params.append(f"    const __grid_constant__ {_CUDA_SHAPE_TYPES[suffix]} {arg}_{suffix}")
    for arg, dtype in zip(kernel.outputs, output_dtypes):
        params.append(f"    {_CUDA_TYPES[dtype]}* {arg}")
    if included is None:
        function = f"muser_{name}"
        header, body = cuda_included_texts(kernel, template)
    else:
        function, body, header = cuda_included_arguments(kernel, template, included)
    return (
        header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void custom_kernel_{function}(\n"
        + ",\n".join(params)
        + ") {\n"
        + body
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
