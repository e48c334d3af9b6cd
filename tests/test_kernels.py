"""Every kernel's Metal rendering compiles (g++ against a stub of Metal) and its CUDA
rendering compiles (nvcc), exactly as MLX would assemble them; a typo in either fails."""

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import kernels, ops
from muser_mlx.kernels import InputSpec
from tests.conftest import tile_settings

STUBS = Path(__file__).parent / "stubs"

# Representative launches: kernel, input specs, output dtypes, template constants.
# Every kernel file must appear, so no kernel escapes the check.
LAUNCHES = {
    "embedding": (
        "embedding",
        [InputSpec(mx.uint8, 1, 40 * 144), InputSpec(mx.int32, 1, 9)],
        [mx.float32],
        [("FORMAT", 12), ("HIDDEN", 256), ("ROW_BYTES", 144), ("VOCAB", 40)],
    ),
    "embedding_f16_out": (
        "embedding",
        [InputSpec(mx.uint8, 2, 40 * 210), InputSpec(mx.int32, 1, 40)],
        [mx.float16],
        [("FORMAT", 14), ("HIDDEN", 256), ("ROW_BYTES", 210), ("VOCAB", 40)],
    ),
    "dequant_rows_q4k": (
        "dequant_rows",
        [InputSpec(mx.uint8, 2, 24 * 288)],
        [mx.float16],
        [("FORMAT", 12), ("IN", 512), ("ROW_BYTES", 288), ("OUT", 24)],
    ),
    "dequant_spans_q6k": (
        "dequant_spans",
        [InputSpec(mx.uint8, 2, 24 * 420)],
        [mx.float16],
        [("FORMAT", 14), ("IN", 512), ("ROW_BYTES", 420), ("OUT", 24)],
    ),
    "dequant_into_q4k": (
        "dequant_into",
        [InputSpec(mx.uint8, 2, 24 * 288), InputSpec(mx.float16, 1, 30 * 512), InputSpec(mx.float16, 2, 9 * 24),
         InputSpec(mx.float32, 2, 7 * 512)],
        [mx.float16],
        [("FORMAT", 12), ("IN", 512), ("ROW_BYTES", 288), ("OUT", 24)],
    ),
    "dequant_spans_q8_0_f32": (
        "dequant_spans",
        [InputSpec(mx.uint8, 2, 5 * 102)],
        [mx.float32],
        [("FORMAT", 8), ("IN", 96), ("ROW_BYTES", 102), ("OUT", 5)],
    ),
    "dequant_rows_f32": (
        "dequant_rows",
        [InputSpec(mx.uint8, 2, 5 * 400)],
        [mx.float32],
        [("FORMAT", 0), ("IN", 100), ("ROW_BYTES", 400), ("OUT", 5)],
    ),
    "qk_norm_rope": (
        "qk_norm_rope",
        [InputSpec(mx.float32, 3, 2 * 4 * 256), InputSpec(mx.float32, 3, 2 * 2 * 64),
         InputSpec(mx.float32, 1, 64), InputSpec(mx.float32, 1, 64), InputSpec(mx.float32, 1, 16),
         InputSpec(mx.int32, 1, 1), InputSpec(mx.float32, 1, 1)],
        [mx.float32, mx.float32],
        [("HEADS", 4), ("KV_HEADS", 2), ("HEAD_DIM", 64), ("ROTARY", 32), ("TRADITIONAL", 0), ("Q_STRIDE", 256),
         ("K_STRIDE", 128), ("Q_OFF", 0), ("K_OFF", 0)],
    ),
    "qk_norm_rope_stack_f16": (  # a prefill chunk's: q and k read from one float16 stack, float16 out
        "qk_norm_rope",
        [InputSpec(mx.float16, 3, 2 * 4 * 768), InputSpec(mx.float16, 3, 2 * 4 * 768),
         InputSpec(mx.float32, 1, 64), InputSpec(mx.float32, 1, 64), InputSpec(mx.float32, 1, 16),
         InputSpec(mx.int32, 1, 1), InputSpec(mx.float32, 1, 1)],
        [mx.float16, mx.float16],
        [("HEADS", 4), ("KV_HEADS", 2), ("HEAD_DIM", 64), ("ROTARY", 32), ("TRADITIONAL", 1), ("Q_STRIDE", 768),
         ("K_STRIDE", 768), ("Q_OFF", 0), ("K_OFF", 256)],
    ),
    "matvec": (
        "matvec",
        [InputSpec(mx.uint8, 2, 24 * 544), InputSpec(mx.float32, 2, 3 * 512)],
        [mx.float32],
        [("FORMAT", 14), ("IN", 512), ("ROW_BYTES", 420), ("OUT", 24), ("TOKENS", 3)],
    ),
    "product_two_formats": (
        "product",
        [InputSpec(mx.uint8, 2, 24 * 288), InputSpec(mx.uint8, 2, 8 * 544), InputSpec(mx.int8, 2, 2 * 512),
         InputSpec(mx.float32, 2, 2 * 16), InputSpec(mx.float32, 2, 2 * 64), InputSpec(mx.float32, 1, 2)],
        [mx.float32],
        [("FORMAT_A", 12), ("ROW_BYTES_A", 288), ("OUT_A", 24), ("FORMAT_B", 8), ("ROW_BYTES_B", 544),
         ("OUT_B", 8), ("IN", 512), ("TOKENS", 2), ("ROWS", 4), ("UNROLL", 2), ("WIDE", 1), ("STAGE", 1),
         ("WOVEN", 1), ("EPILOGUE", 0), ("INT_FLOATS", 0), ("LEAN", 0), ("GROUPED", 0)]
    ),
    "product_grouped": (  # the batched step's form: 8 rows a threadgroup, token groups along x
        "product",
        [InputSpec(mx.uint8, 2, 24 * 288), InputSpec(mx.uint8, 2, 8 * 544), InputSpec(mx.int8, 2, 16 * 512),
         InputSpec(mx.float32, 2, 16 * 16), InputSpec(mx.float32, 2, 16 * 64), InputSpec(mx.float32, 1, 2)],
        [mx.float32],
        [("FORMAT_A", 12), ("ROW_BYTES_A", 288), ("OUT_A", 24), ("FORMAT_B", 8), ("ROW_BYTES_B", 544),
         ("OUT_B", 8), ("IN", 512), ("TOKENS", 8), ("ROWS", 4), ("UNROLL", 1), ("WIDE", 0), ("STAGE", 1),
         ("WOVEN", 0), ("EPILOGUE", 0), ("INT_FLOATS", 0), ("LEAN", 1), ("GROUPED", 1)]
    ),
    "product_woven": (  # the o-projection's form: wide Q4_K units reading woven x from device memory
        "product",
        [InputSpec(mx.uint8, 2, 24 * 2304), InputSpec(mx.uint8, 2, 24 * 2304), InputSpec(mx.int8, 2, 4096),
         InputSpec(mx.float32, 2, 128), InputSpec(mx.float32, 2, 512), InputSpec(mx.float32, 1, 2)],
        [mx.float32],
        [("FORMAT_A", 12), ("ROW_BYTES_A", 2304), ("OUT_A", 24), ("FORMAT_B", 12), ("ROW_BYTES_B", 2304),
         ("OUT_B", 0), ("IN", 4096), ("TOKENS", 1), ("ROWS", 2), ("UNROLL", 2), ("WIDE", 1), ("STAGE", 0),
         ("WOVEN", 1), ("EPILOGUE", 0), ("INT_FLOATS", 1), ("LEAN", 1), ("GROUPED", 0)]
    ),
    "product_head": (
        "product",
        [InputSpec(mx.uint8, 2, 40 * 420), InputSpec(mx.uint8, 2, 40 * 420), InputSpec(mx.int8, 2, 512),
         InputSpec(mx.float32, 2, 16), InputSpec(mx.float32, 2, 64), InputSpec(mx.float32, 1, 2)],
        [mx.float32],
        [("FORMAT_A", 14), ("ROW_BYTES_A", 420), ("OUT_A", 40), ("FORMAT_B", 14), ("ROW_BYTES_B", 420),
         ("OUT_B", 0), ("IN", 512), ("TOKENS", 1), ("ROWS", 4), ("UNROLL", 1), ("WIDE", 0), ("STAGE", 0),
         ("WOVEN", 0), ("EPILOGUE", 1), ("INT_FLOATS", 1), ("LEAN", 0), ("GROUPED", 0)]
    ),
    "product_q6k_lean": (  # ffn_down Q6_K's form with LEAN's integer scales
        "product",
        [InputSpec(mx.uint8, 2, 40 * 1680), InputSpec(mx.uint8, 2, 40 * 1680), InputSpec(mx.int8, 2, 2 * 2048),
         InputSpec(mx.float32, 2, 2 * 64), InputSpec(mx.float32, 2, 2 * 256), InputSpec(mx.float32, 1, 2)],
        [mx.float32],
        [("FORMAT_A", 14), ("ROW_BYTES_A", 1680), ("OUT_A", 40), ("FORMAT_B", 14), ("ROW_BYTES_B", 1680),
         ("OUT_B", 0), ("IN", 2048), ("TOKENS", 2), ("ROWS", 2), ("UNROLL", 1), ("WIDE", 0), ("STAGE", 0),
         ("WOVEN", 0), ("EPILOGUE", 0), ("INT_FLOATS", 0), ("LEAN", 1), ("GROUPED", 0)]
    ),
    "product_glu": (
        "product_glu",
        [InputSpec(mx.uint8, 2, 64 * 288), InputSpec(mx.uint8, 2, 64 * 420), InputSpec(mx.int8, 2, 512),
         InputSpec(mx.float32, 2, 16), InputSpec(mx.float32, 2, 64)],
        [mx.int8, mx.float32, mx.float32],
        [("FORMAT_G", 12), ("ROW_BYTES_G", 288), ("FORMAT_U", 14), ("ROW_BYTES_U", 420), ("OUT", 64),
         ("IN", 512), ("TOKENS", 1), ("ROWS", 4), ("UNROLL", 3), ("WIDE", 1), ("ACTIVATION", 1), ("GROUPED", 1)]
    ),
    "product_tiles": (  # Q4_K and Q6_K in one launch (k32 and k16 products)
        "product_tiles",
        [InputSpec(mx.uint8, 2, 37 * 288), InputSpec(mx.uint8, 2, 45 * 420), InputSpec(mx.int8, 2, 24 * 512),
         InputSpec(mx.float32, 2, 24 * 16), InputSpec(mx.float32, 2, 24 * 64)],
        [mx.float32],
        [("FORMAT_A", 12), ("ROW_BYTES_A", 288), ("OUT_A", 37), ("FORMAT_B", 14), ("ROW_BYTES_B", 420),
         ("OUT_B", 45), ("IN", 512), ("TOKENS", 64), ("WARPS", 4), ("HALF", 0), ("BY_TOKEN", 0),
         ("CHUNKS", 2), ("GLU", 0), ("ACTIVATION", 0)]
    ),
    "product_tiles_glu_q8_0": (  # gated, Q8_0, 8 rows of x a threadgroup
        "product_tiles",
        [InputSpec(mx.uint8, 2, 64 * 544), InputSpec(mx.uint8, 2, 64 * 544), InputSpec(mx.int8, 2, 8 * 512),
         InputSpec(mx.float32, 2, 8 * 16), InputSpec(mx.float32, 2, 8 * 64)],
        [mx.float32],
        [("FORMAT_A", 8), ("ROW_BYTES_A", 544), ("OUT_A", 64), ("FORMAT_B", 8), ("ROW_BYTES_B", 544),
         ("OUT_B", 64), ("IN", 512), ("TOKENS", 8), ("WARPS", 4), ("HALF", 0), ("BY_TOKEN", 0),
         ("CHUNKS", 1), ("GLU", 1), ("ACTIVATION", 1)]
    ),
    "quantize_rows": (
        "quantize_rows",
        [InputSpec(mx.float32, 2, 3 * 512)],
        [mx.int8, mx.float32, mx.float32],
        [("IN", 512), ("GLU", 0), ("ACTIVATION", 0), ("CHUNKS", 1)],
    ),
    "quantize_rows-glu": (
        "quantize_rows",
        [InputSpec(mx.float32, 3, 3 * 2 * 2 * 512)],
        [mx.int8, mx.float32, mx.float32],
        [("IN", 512), ("GLU", 1), ("ACTIVATION", 1), ("CHUNKS", 3)],
    ),
    "residual_norm_quant": (
        "residual_norm_quant",
        [InputSpec(mx.float32, 2, 2 * 6656), InputSpec(mx.float32, 2, 2 * 6656), InputSpec(mx.float32, 1, 6656),
         InputSpec(mx.float32, 1, 6656), InputSpec(mx.float32, 1, 3)],
        [mx.float32, mx.int8, mx.float32, mx.float32],
        [("HIDDEN", 6656), ("RESIDUAL", 1), ("BRANCH_NORM", 1), ("NEXT_NORM", 1), ("SLICE_BLOCKS", 16),
         ("THREADS", 256), ("CHUNKS", 1)],
    ),
    "residual_norm_quant_unnormed": (  # OLMo 2's seam: the next branch reads the sum itself; a
        "residual_norm_quant",         # tile product's branch in 3 chunks
        [InputSpec(mx.float32, 2, 2048), InputSpec(mx.float32, 3, 3 * 2048), InputSpec(mx.float32, 1, 2048),
         InputSpec(mx.float32, 2, 2048), InputSpec(mx.float32, 1, 3)],
        [mx.float32, mx.int8, mx.float32, mx.float32],
        [("HIDDEN", 2048), ("RESIDUAL", 1), ("BRANCH_NORM", 1), ("NEXT_NORM", 0), ("SLICE_BLOCKS", 16),
         ("THREADS", 256), ("CHUNKS", 3)],
    ),
    "residual_norm_rows_f16": (  # a prefill seam: the product's float16 output as the branch
        "residual_norm_rows",
        [InputSpec(mx.float32, 2, 3 * 6656), InputSpec(mx.float16, 2, 3 * 6656), InputSpec(mx.float32, 1, 6656),
         InputSpec(mx.float32, 1, 6656), InputSpec(mx.float32, 1, 4)],
        [mx.float32, mx.float32],
        [("HIDDEN", 6656), ("BRANCH_NORM", 1), ("NEXT_NORM", 1), ("THREADS", 256)],
    ),
    "residual_norm_rows_f32": (
        "residual_norm_rows",
        [InputSpec(mx.float32, 2, 2 * 100), InputSpec(mx.float32, 2, 2 * 100), InputSpec(mx.float32, 1, 100),
         InputSpec(mx.float32, 1, 100), InputSpec(mx.float32, 1, 4)],
        [mx.float32, mx.float32],
        [("HIDDEN", 100), ("BRANCH_NORM", 0), ("NEXT_NORM", 0), ("THREADS", 128)],
    ),
    "attention_decode": (
        "attention_decode",
        [InputSpec(mx.float32, 1, 8192 + 512), InputSpec(mx.float32, 1, 128), InputSpec(mx.float32, 1, 128),
         InputSpec(mx.float32, 1, 1), InputSpec(mx.float32, 1, 64), InputSpec(mx.int32, 1, 1),
         InputSpec(mx.float16, 4, 2 * 2048 * 128), InputSpec(mx.float16, 4, 2 * 2048 * 128),
         InputSpec(mx.float32, 1, 3)],
        [mx.float32],
        [("HEADS", 32), ("KV_HEADS", 2), ("HEAD_DIM", 128), ("ROTARY", 128), ("TRADITIONAL", 1), ("QK_NORM", 1),
         ("SOFTCAP", 0), ("BIAS", 0), ("MAX_SPLITS", 128), ("HEAD_GROUP", 4), ("Q_OFF", 0),
         ("K_OFF", 8192), ("V_OFF", 8448)]
    ),
    "attention_decode_whole_norm_softcap": (  # OLMo 2's q/k norm over the whole projections; Gemma 2's cap
        "attention_decode",
        [InputSpec(mx.float32, 1, 4096 + 2 * 1024), InputSpec(mx.float32, 1, 4096), InputSpec(mx.float32, 1, 1024),
         InputSpec(mx.float32, 1, 1), InputSpec(mx.float32, 1, 64), InputSpec(mx.int32, 1, 1),
         InputSpec(mx.float16, 4, 8 * 2048 * 128), InputSpec(mx.float16, 4, 8 * 2048 * 128),
         InputSpec(mx.float32, 1, 3)],
        [mx.float32],
        [("HEADS", 32), ("KV_HEADS", 8), ("HEAD_DIM", 128), ("ROTARY", 128), ("TRADITIONAL", 0), ("QK_NORM", 2),
         ("SOFTCAP", 1), ("BIAS", 0), ("MAX_SPLITS", 128), ("HEAD_GROUP", 4), ("Q_OFF", 0),
         ("K_OFF", 4096), ("V_OFF", 5120)]
    ),
    "attention_combine": (
        "attention_combine",
        [InputSpec(mx.float32, 1, 32 * 64 * 130), InputSpec(mx.float32, 1, 8192 + 512)],
        [mx.int8, mx.float32, mx.float32],
        [("HEADS", 32), ("HEAD_DIM", 128), ("GATE", 1), ("G_OFF", 4096), ("WOVEN", 1)],
    ),
    "argmax": (
        "argmax",
        [InputSpec(mx.float32, 3, 6314 * 2)],
        [mx.int32],
        [("GROUPS", 6314)],
    ),
}


def _f16_form(launch, by_token: int = 0):
    """A product_tiles launch of LAUNCHES in its f16 form (template HALF 1; BY_TOKEN: its stage
    by SIMD groups)."""
    name, specs, output_dtypes, template = launch
    changed = {"HALF": 1, "BY_TOKEN": by_token}
    return name, specs, output_dtypes, [(key, changed.get(key, value)) for key, value in template]


# the f16 form of the same launches: Q4_K and Q6_K in one launch; gated, Q8_0, 8 rows of x; each
# with its stage by SIMD groups too
LAUNCHES["product_tiles_f16"] = _f16_form(LAUNCHES["product_tiles"])
LAUNCHES["product_tiles_f16_glu_q8_0"] = _f16_form(LAUNCHES["product_tiles_glu_q8_0"])
LAUNCHES["product_tiles_f16_by_token"] = _f16_form(LAUNCHES["product_tiles"], 1)
LAUNCHES["product_tiles_f16_by_token_glu_q8_0"] = _f16_form(LAUNCHES["product_tiles_glu_q8_0"], 1)


def compile_metal(text: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.metal.cpp"
    path.write_text(f'#include "{STUBS / "metal_stub.h"}"\n' + text)
    compiler = shutil.which("g++") or shutil.which("clang++")
    assert compiler, "the Metal check needs g++ or clang++"
    return subprocess.run(
        [compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-attributes", "-Wno-unused", str(path)],
        capture_output=True, text=True,
    )


def compile_cuda(text: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.cu"
    path.write_text(f'#include "{STUBS / "mlx_cuda_stub.cuh"}"\n' + text)
    nvcc = shutil.which("nvcc")
    assert nvcc, "the CUDA check needs nvcc (present on the CI machine)"
    return subprocess.run(
        [nvcc, "-std=c++17", "-arch=sm_90", "--ptx", str(path), "-o", str(tmp_path / "kernel.ptx")],
        capture_output=True, text=True,
    )


def test_every_kernel_has_a_launch_to_check():
    assert {launch[0] for launch in LAUNCHES.values()} == set(kernels.kernel_names())


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_metal_rendering_compiles(launch, tmp_path):
    result = compile_metal(kernels.metal_program(*LAUNCHES[launch]), tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_cuda_rendering_compiles(launch, tmp_path):
    result = compile_cuda(kernels.cuda_program(*LAUNCHES[launch]), tmp_path)
    assert result.returncode == 0, result.stderr


def test_the_checks_catch_a_typo(tmp_path):
    program = kernels.metal_program(*LAUNCHES["embedding"])
    broken = program.replace("muser_value<FORMAT>(row,element)", "muser_valeu<FORMAT>(row,element)")
    assert broken != program and compile_metal(broken, tmp_path).returncode != 0
    cuda = kernels.cuda_program(*LAUNCHES["embedding"])
    broken = cuda.replace("uint slot", "uint slot slot")
    assert broken != cuda and compile_cuda(broken, tmp_path).returncode != 0


def test_device_atomics_render_for_metal_and_cuda(tmp_path):
    # The emulator's last-threadgroup-done probe (tests/test_emulated_kernels.py) through both
    # compile checks: lib/base.metal's atomics as Metal (atomic_fetch_add_explicit, ...) and as
    # CUDA (atomicAdd, atomicExch, __threadfence).
    from tests.test_emulated_kernels import LAST_DONE, LAST_DONE_LAUNCH

    dtypes, template, _, _, _, output_dtypes = LAST_DONE_LAUNCH
    specs = [InputSpec(dtypes[0], 1, 32 * 40), InputSpec(dtypes[1], 1, 4)]
    metal = kernels.metal_program("last_done", specs, output_dtypes, template, kernel=LAST_DONE)
    result = compile_metal(metal, tmp_path)
    assert result.returncode == 0, result.stderr
    cuda = kernels.cuda_program("last_done", specs, output_dtypes, template, kernel=LAST_DONE)
    assert "return atomicAdd(counter,value);" in cuda and "__threadfence();" in cuda
    result = compile_cuda(cuda, tmp_path)
    assert result.returncode == 0, result.stderr


def test_cuda_translation_is_the_same_source():
    kernel = kernels.source("embedding")
    cuda = kernels.to_cuda(kernel.body)
    assert "thread_position_in_grid" not in cuda and "device " not in cuda
    # Only the table's rewrites differ: undoing the thread index gives back the Metal text.
    assert cuda.replace("(blockIdx.x * blockDim.x + threadIdx.x)", "thread_position_in_grid.x") == \
        kernel.body.replace("const device uint8_t", "const uint8_t")


def test_kernel_sources_declare_their_interface():
    kernel = kernels.source("embedding")
    assert kernel.inputs == ("table", "token_ids") and kernel.outputs == ("hidden",)


def test_arrays_kernels_read_every_step_stay_out_of_mlx_small_managed_pool():
    # MLX's CUDA allocator keeps arrays of at most 8 bytes in one pool of managed memory, which
    # page-faults whenever the host touches any of them (kernels.MIN_ARRAY_VALUES).
    from muser_mlx.ops.attention import _inverse_frequencies

    for array in (kernels.parameters(1e-5), kernels.parameters(1e-5, 0.5), kernels.padded_array([7], mx.int32),
                  _inverse_frequencies(0, 0.0), _inverse_frequencies(2, 10000.0)):
        assert array.nbytes >= 16
    # Built from host values, not lazy: a lazy array would be recomputed by every compiled step.
    assert _inverse_frequencies(0, 0.0) is _inverse_frequencies(0, 0.0)
    frequencies = np.array(_inverse_frequencies(8, 10000.0))
    assert frequencies[:4].tolist() == (10000.0 ** (-np.arange(0, 8, 2) / 8)).astype(np.float32).tolist()
    assert kernels.padded_array([7], mx.int32)[0].item() == 7
    assert np.array(kernels.parameters(1e-5, 0.5))[:2].tolist() == np.array([1e-5, 0.5], np.float32).tolist()



# Launches whose CUDA text the include form (kernels.CUDA_INCLUDES) is compiled for too: the
# products, attention and a kernel that reads an input's shape.
INCLUDED = ["product_two_formats", "product_grouped", "product_head", "product_glu", "attention_decode", "residual_norm_quant", "embedding"]


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_cuda_include_form_is_the_same_text(launch, tmp_path):
    # What MLX receives on CUDA: #include lines of files named by their content. With the
    # files' text put back in place of the lines, the program is the inline one (but for the
    # function's name, which carries the digest, and the comment naming shape parameters).
    name, specs, output_dtypes, template = LAUNCHES[launch]
    inline = kernels.cuda_program(name, specs, output_dtypes, template)
    included = kernels.cuda_program(name, specs, output_dtypes, template, included=tmp_path)
    lines = re.findall(r'#include "([^"]+)"\n', included)
    assert len(lines) == 2 and all(Path(path).parent == tmp_path for path in lines)
    assert len(included) < len(inline) // 3 + 1500  # what MLX hashes at every launch
    expanded = re.sub(r'#include "([^"]+)"\n', lambda m: Path(m.group(1)).read_text(), included)
    expanded = re.sub(r"\n// (\w+_(shape|strides|ndim) ?)+\n", "\n", expanded)
    digest = re.search(r"custom_kernel_muser_(\w+)\(", included).group(1)
    assert digest.startswith(name + "_")
    assert expanded.replace(f"custom_kernel_muser_{digest}(", f"custom_kernel_muser_{name}(") == inline
    # The same texts give the same files; another template gives other ones.
    assert kernels.cuda_program(name, specs, output_dtypes, template, included=tmp_path) == included
    changed = [(key, value + 1) for key, value in template[:1]] + list(template[1:])
    other = kernels.cuda_program(name, specs, output_dtypes, changed, included=tmp_path)
    assert re.findall(r'#include "([^"]+)"\n', other)[1] != lines[1]


@pytest.mark.parametrize("launch", INCLUDED)
def test_cuda_include_form_compiles(launch, tmp_path):
    result = compile_cuda(kernels.cuda_program(*LAUNCHES[launch], included=tmp_path), tmp_path)
    assert result.returncode == 0, result.stderr


def test_cuda_include_form_mentions_shape_parameters(tmp_path):
    # A body that reads x_shape: MLX finds the name in the source it is given (the comment) and
    # adds the parameter; without it the kernel would not compile.
    probe = kernels.kernel_source("probe", ("x",), ("y",), "y[0] = x[0] + float(x_shape[0]);")
    _, source, header = kernels.cuda_included_arguments(probe, [("N", 4)], tmp_path)
    assert source.splitlines()[1] == "// x_shape" and header.startswith("#include ")
    program = kernels.cuda_program("probe", [InputSpec(mx.float32, 1, 4)], [mx.float32], [("N", 4)],
                                   kernel=probe, included=tmp_path)
    assert "const __grid_constant__ Shape x_shape" in program
    assert compile_cuda(program, tmp_path).returncode == 0


def test_cuda_include_form_refuses_what_it_cannot_write(tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_KERNEL_CACHE", str(tmp_path / 'a"b'))
    with pytest.raises(kernels.KernelSourceError, match="quote"):
        kernels.cuda_text_file("int x;", kernels.cuda_text_dir())
    with pytest.raises(kernels.KernelSourceError, match="ints and bools"):
        kernels.cuda_constants([("T", 1.5)])


def test_cuda_launches_take_the_include_form(tmp_path, monkeypatch):
    # kernels.launch on CUDA: one mx.fast.cuda_kernel per launch configuration, built from the
    # include lines, called without template constants (they are in the included body);
    # MUSER_CUDA_INCLUDES=0 (CUDA_INCLUDES False) builds the inline kernel MLX's examples use.
    made, calls = [], []

    def cuda_kernel(**arguments):
        made.append(arguments)
        return lambda **launch: calls.append((arguments["name"], launch)) or ["out"]

    monkeypatch.setenv("MUSER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "CUDA_INCLUDES", True)
    kernels._build.cache_clear()
    try:
        for rows in (2, 2, 4):
            assert kernels.launch("argmax", ["x"], [("ROWS", rows)], (32, 1, 1), (32, 1, 1), [[1]], ["d"]) == ["out"]
        assert len(made) == 2 and [call[0] for call in calls] == [made[0]["name"]] * 2 + [made[1]["name"]]
        assert all("template" not in launch and launch["grid"] == (32, 1, 1) for _, launch in calls)
        assert made[0]["source"].startswith(f'#include "{tmp_path}') and made[0]["header"].startswith("#include")
        body = Path(re.match(r'#include "([^"]+)"', made[1]["source"]).group(1)).read_text()
        assert body.startswith("  constexpr int ROWS = 4;\n")
        monkeypatch.setattr(kernels, "CUDA_INCLUDES", False)
        kernels.launch("argmax", ["x"], [("ROWS", 2)], (32, 1, 1), (32, 1, 1), [[1]], ["d"])
        assert made[2]["name"] == "muser_argmax" and "#include" not in made[2]["source"]
        assert calls[-1][1]["template"] == [("ROWS", 2)]
    finally:
        kernels._build.cache_clear()


# A CUDA launch fails ("too many resources requested") when registers a thread x threads a
# threadgroup exceed the 65,536 registers of an SM (sm_90). The products' registers grow with
# tokens, rows, unroll and wide units; ops._config caps them so that every launch fits. Checked
# here on Muse Glimmer's decode shapes at the configurations the ops choose (GPU-free: nvcc's
# ptxas counts the registers).
MUSE_PRODUCTS = {  # shape, format, the second weight's (attn_output reads woven x, as in the model)
    "q+gate|k+v": ((6656, 8192), GGMLType.Q4_K, (6656, 2048), GGMLType.Q8_0),
    "attn_output": ((4096, 6656), GGMLType.Q4_K, None, None),
    "ffn_down Q4_K": ((19968, 6656), GGMLType.Q4_K, None, None),
    "ffn_down Q6_K": ((19968, 6656), GGMLType.Q6_K, None, None),
}


def _stand_in(shape, ggml_type, name):
    """What a launch's arguments read of a weight: its shape [in, out], format and name."""
    return SimpleNamespace(shape=shape, ggml_type=ggml_type, name=name)


def _ptxas_report(program: str, tmp_path) -> str:
    """ptxas's report (-v) of a CUDA program compiled for sm_90: registers, spills, stack."""
    path = tmp_path / "kernel.cu"
    path.write_text(f'#include "{STUBS / "mlx_cuda_stub.cuh"}"\n' + program)
    result = subprocess.run([shutil.which("nvcc"), "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                             str(path), "-o", str(tmp_path / "kernel.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def _registers(program: str, tmp_path) -> int:
    return int(re.search(r"Used (\d+) registers", _ptxas_report(program, tmp_path)).group(1))


@pytest.mark.parametrize("tokens, grouped", [(1, False), (8, False), (8, True)], ids=["1", "8", "8-grouped"])
@pytest.mark.parametrize("case", sorted(MUSE_PRODUCTS))
def test_product_launches_fit_the_register_file(case, tokens, grouped, tmp_path):
    shape, ggml_type, second_shape, second_type = MUSE_PRODUCTS[case]
    second = _stand_in(second_shape, second_type, "b") if second_shape else None
    product = ops.Product(_stand_in(shape, ggml_type, "a"), second, tokens=tokens, woven=case == "attn_output" and not grouped,
                          grouped=grouped)
    template, _, threadgroup, _ = product.launch_arguments()
    row_bytes = [value for name, value in template if name.startswith("ROW_BYTES")]
    inputs = [InputSpec(mx.uint8, 2, product.out_a * row_bytes[0]),
              InputSpec(mx.uint8, 2, max(product.out_b, 1) * row_bytes[1]),
              InputSpec(mx.int8, 2, tokens * shape[0]), InputSpec(mx.float32, 2, tokens * shape[0] // 32),
              InputSpec(mx.float32, 2, tokens * shape[0] // 8), InputSpec(mx.float32, 1, 2)]
    registers = _registers(kernels.cuda_program("product", inputs, [mx.float32], template), tmp_path)
    assert registers * threadgroup[0] <= 65536, (registers, threadgroup, template)


@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize("in_features", [6656, 2048], ids=["muse", "default-config"])
def test_glu_launches_fit_the_register_file(in_features, tokens, tmp_path):
    gate = _stand_in((in_features, 19968), GGMLType.Q4_K, "gate")
    glu = ops.GatedProduct(gate, _stand_in((in_features, 19968), GGMLType.Q4_K, "up"), tokens=tokens,
                           grouped=tokens == 8)
    template, _, threadgroup = glu.launch_arguments()
    row_bytes = dict(template)["ROW_BYTES_G"]
    inputs = [InputSpec(mx.uint8, 2, 19968 * row_bytes), InputSpec(mx.uint8, 2, 19968 * row_bytes),
              InputSpec(mx.int8, 2, tokens * in_features), InputSpec(mx.float32, 2, tokens * in_features // 32),
              InputSpec(mx.float32, 2, tokens * in_features // 8)]
    program = kernels.cuda_program("product_glu", inputs, [mx.int8, mx.float32, mx.float32], template)
    registers = _registers(program, tmp_path)
    assert registers * threadgroup[0] <= 65536, (registers, threadgroup, template)


# The batched step's tile products at Muse Glimmer's shapes (64 rows of x: one token group), as
# BatchStep launches them: every launch fits the register file, with no spills to local memory
# (but for a few bytes where the gated launch is bounded to 168 registers a thread).
MUSE_TILE_PRODUCTS = {  # (in, out) and format of A, then of B (None: no B), gated
    "q+gate|k+v": ((6656, 8192), GGMLType.Q4_K, (6656, 512), GGMLType.Q8_0, False),
    "attn_output": ((4096, 6656), GGMLType.Q4_K, None, None, False),
    "gate+up": ((6656, 19968), GGMLType.Q4_K, (6656, 19968), GGMLType.Q4_K, True),
    "gate+up split": ((6656, 19968), GGMLType.Q4_K, (6656, 19968), GGMLType.Q4_K, "split"),
    "gate+up split one-tile": ((6656, 19968), GGMLType.Q4_K, (6656, 19968), GGMLType.Q4_K, "one-tile"),
    "ffn_down Q4_K": ((19968, 6656), GGMLType.Q4_K, None, None, False),
    "ffn_down Q6_K": ((19968, 6656), GGMLType.Q6_K, None, None, False),
    "ffn_down Q4_K pairs": ((19968, 6656), GGMLType.Q4_K, None, None, "pairs"),
    "ffn_down Q6_K pairs": ((19968, 6656), GGMLType.Q6_K, None, None, "pairs"),
    "attn_output pairs": ((4096, 6656), GGMLType.Q4_K, None, None, "pairs"),
}


def _tile_launch_report(product, in_features: int, tmp_path):
    """(ptxas's report, registers a thread, template values, threadgroup) of `product`'s
    (ops.TileProduct) 64-row launch, compiled for sm_90 as MLX would assemble it."""
    template, _, threadgroup, _, _ = product.launch_arguments(64)
    values = dict(template)
    inputs = [InputSpec(mx.uint8, 2, product.out_a * values["ROW_BYTES_A"]),
              InputSpec(mx.uint8, 2, max(product.out_b, 1) * values["ROW_BYTES_B"]),
              InputSpec(mx.int8, 2, 64 * in_features), InputSpec(mx.float32, 2, 64 * in_features // 32),
              InputSpec(mx.float32, 2, 64 * in_features // 8)]
    report = _ptxas_report(kernels.cuda_program("product_tiles", inputs, [mx.float32], template), tmp_path)
    return report, int(re.search(r"Used (\d+) registers", report).group(1)), values, threadgroup


@pytest.mark.parametrize("half", [False, True, "by token"], ids=["int8", "f16", "f16-by-token"])
@pytest.mark.parametrize("case", sorted(MUSE_TILE_PRODUCTS))
def test_tile_product_launches_fit_the_register_file(case, half, tmp_path):
    shape, ggml_type, second_shape, second_type, gated = MUSE_TILE_PRODUCTS[case]
    second = _stand_in(second_shape, second_type, "b") if second_shape else None
    product = ops.TileProduct(_stand_in(shape, ggml_type, "a"), second,
                              "silu" if gated and gated != "pairs" else None,
                              settings=tile_settings(half, tile_glu_split_from=64 if gated in ("split", "one-tile") else 0,
                                                    tile_glu_split_pairs=gated != "one-tile",
                                                    tile_pairs_from=64 if gated == "pairs" else 0))
    report, registers, values, threadgroup = _tile_launch_report(product, shape[0], tmp_path)
    assert registers * threadgroup[0] <= 65536, (registers, values)
    # a launch bounded to hold more threadgroups (Settings.tile_glu_min_warps: the gated one at 64
    # rows, and one in pairs in the f16 form) fits them, and spills a little
    least = values["LAUNCH_MIN_THREADGROUPS"]
    assert least == (3 if gated in (True, "split") or (gated == "pairs" and half) else 0)
    assert registers * threadgroup[0] * max(least, 1) <= 65536, (registers, least)
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spilled <= (64 if least else 0), report


@pytest.mark.parametrize("case", ["q+gate|k+v", "attn_output", "ffn_down Q4_K", "ffn_down Q6_K"])
def test_ungated_tile_launches_bounded_by_the_settings_fit_four_an_sm(case, tmp_path):
    """Settings.tile_min_warps 16: a 64-row ungated f16 launch of Muse Glimmer's shapes is bounded
    to 4 threadgroups an SM (LAUNCH_MIN_THREADGROUPS 4), holds them in the register file, and
    spills at most a few bytes (q+gate|k+v took 135 registers unbounded)."""
    shape, ggml_type, second_shape, second_type, _ = MUSE_TILE_PRODUCTS[case]
    second = _stand_in(second_shape, second_type, "b") if second_shape else None
    product = ops.TileProduct(_stand_in(shape, ggml_type, "a"), second, settings=tile_settings(True, tile_min_warps=16))
    report, registers, values, threadgroup = _tile_launch_report(product, shape[0], tmp_path)
    assert values["LAUNCH_MIN_THREADGROUPS"] == 4 and values["GLU"] == 0
    assert dict(product.launch_arguments(32)[0])["LAUNCH_MIN_THREADGROUPS"] == 0  # 64-row launches only
    assert registers * threadgroup[0] * 4 <= 65536, registers
    assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) <= 64, report


def test_launch_bounds_go_into_the_cuda_header_alone():
    # LAUNCH_* template constants become CUDA's __launch_bounds__ in the launch's header (MLX
    # writes the signature), not constants of the body; a minimum of 0 leaves the kernel as it is
    template = [("TOKENS", 64), ("LAUNCH_THREADS", 128), ("LAUNCH_MIN_THREADGROUPS", 3)]
    assert "__launch_bounds__(128, 3)" in kernels.cuda_launch_bounds(template)
    assert kernels.cuda_constants(template) == "  constexpr int TOKENS = 64;\n\n"
    assert kernels.cuda_launch_bounds([("LAUNCH_THREADS", 128), ("LAUNCH_MIN_THREADGROUPS", 0)]) == ""
    assert kernels.cuda_launch_bounds([("TOKENS", 64)]) == ""


# The batched step's seams (kernel residual_norm_quant, 64 rows: slices of up to
# ops.norm.SEAM_WIDE_BLOCKS blocks, up to 1,024 threads, launch-bounded): every launch fits the
# register file; Muse Glimmer's without spills.
@pytest.mark.parametrize("hidden", [6656, 16384, 576])
def test_wide_seam_launches_fit_the_register_file(hidden, tmp_path):
    from muser_mlx.ops import norm

    blocks, threads = norm.seam_shape(hidden, 64)
    assert threads > norm.SEAM_THREADS or hidden == 576
    template = [("HIDDEN", hidden), ("RESIDUAL", 1), ("BRANCH_NORM", 1), ("NEXT_NORM", 1), ("SLICE_BLOCKS", blocks),
                ("THREADS", threads), ("CHUNKS", 5), ("LAUNCH_THREADS", threads), ("LAUNCH_MIN_THREADGROUPS", 1)]
    n = 64 * hidden
    inputs = [InputSpec(mx.float32, 2, n), InputSpec(mx.float32, 3, 5 * n), InputSpec(mx.float32, 1, hidden),
              InputSpec(mx.float32, 1, hidden), InputSpec(mx.float32, 1, 4)]
    report = _ptxas_report(kernels.cuda_program("residual_norm_quant", inputs,
                                                [mx.float32, mx.int8, mx.float32, mx.float32], template), tmp_path)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers * threads <= 65536, (registers, threads)
    if hidden == 6656:
        assert " 0 bytes spill stores" in report, report


@pytest.mark.parametrize("probe", ["tiles_read", "flat_read"])
def test_bench_read_probes_render_for_metal_and_cuda(probe, tmp_path):
    # bench/tile_read.py's probes (what bounds a tile product: its loads alone, a plain read)
    # through both compile checks, with product_tiles' own template.
    import bench.tile_read as tile_read

    text, names = ((tile_read.TILES_READ, ("weight_a", "weight_b")) if probe == "tiles_read"
                   else (tile_read.FLAT_READ, ("weight",)))
    kernel = kernels.kernel_source(probe, names, ("y",), text)
    _, specs, _, template = LAUNCHES["product_tiles"]
    specs = specs[: len(names)]
    template = (template + [("GRID_X", 1), ("GRID_Y", 3)] if probe == "tiles_read"
                else [("THREADGROUPS", tile_read.FLAT_THREADGROUPS)])
    for program, compile_ in ((kernels.metal_program(probe, specs, [mx.uint32], template, kernel=kernel), compile_metal),
                              (kernels.cuda_program(probe, specs, [mx.uint32], template, kernel=kernel), compile_cuda)):
        result = compile_(program, tmp_path)
        assert result.returncode == 0, result.stderr
