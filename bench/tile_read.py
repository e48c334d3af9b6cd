"""What bounds a tile product (kernel product_tiles): its weight loads alone, in its own pattern
and launch shape, against a plain read of the same bytes. Two probe kernels (bench-only; their
text below, built as tests' probes are: kernels.kernel_source):
  tiles_read: each SIMD group's loads of its 16-row tile (and the up projection's) span by
              span (lib/tiles.metal's muser_tile_load_rows, the product's grid, chunks and
              template), the words xor-ed together and one word a thread written: the
              product with no x, no stage and no products.
  flat_read:  the weight bytes read as 16-byte vectors, consecutive threads at consecutive
              addresses, grid-stride over a fixed grid: the device's read rate for this tensor.
If the product runs near tiles_read, its loads bound it (their pattern, their bytes in flight);
if tiles_read runs near flat_read and the product far below both, its arithmetic and latency do.
Used by bench/batch.py --each (a "read" line under each tile product), and alone, with no
model file (random bytes in Muse Glimmer's shapes: seconds of device time):

    python bench/tile_read.py [--rows 8,64] [--variant NAME:field=value,...]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from muser_mlx import kernels  # noqa: E402

TILES_READ = """
#include "lib/tiles.metal"
const int SPANS = IN / (32 * MUSER_TILE_SPAN(IN));
const int PER_CHUNK = (SPANS + CHUNKS - 1) / CHUNKS;
const int RAW = MUSER_TILE_RAW(FORMAT_A) > MUSER_TILE_RAW(FORMAT_B) ? MUSER_TILE_RAW(FORMAT_A) : MUSER_TILE_RAW(FORMAT_B);
const int UP_RAW = GLU != 0 ? 2 * MUSER_TILE_RAW(FORMAT_B) : 1;
const uint GROUPS_A = (uint(OUT_A) + 15u) / 16u;
const uint GROUPS_B = GLU != 0 ? 0u : (uint(OUT_B) + 15u) / 16u;
uint lane = thread_index_in_simdgroup;
uint first_tile = threadgroup_position_in_grid.y * uint(WARPS);
size_t slot = (size_t(threadgroup_position_in_grid.z) * uint(GRID_Y) + threadgroup_position_in_grid.y) * uint(GRID_X)
              + threadgroup_position_in_grid.x;
slot = slot * uint(32 * WARPS) + thread_position_in_threadgroup.x;
if (first_tile >= GROUPS_A + GROUPS_B) {
  y[slot] = 0u;
  return;
}
uint tile = first_tile + simdgroup_index_in_threadgroup;
bool active = tile < GROUPS_A + GROUPS_B;
bool in_a = tile < GROUPS_A;
uint first_row = (in_a ? tile : tile - GROUPS_A) * 16u;
uint chunk = threadgroup_position_in_grid.z;
uint first_span = min(chunk * uint(PER_CHUNK), uint(SPANS));
uint end_span = min(first_span + uint(PER_CHUNK), uint(SPANS));
uint g = lane / 4u;
uint t = lane % 4u;
size_t offsets[2];
size_t up_offsets[2];
muser_tile_offsets<ROW_BYTES_A, OUT_A, ROW_BYTES_B, OUT_B, GLU>(offsets, up_offsets, in_a, first_row, g);
uint sum = 0u;
for (uint span = first_span; span < end_span && active; ++span) {
  uint raw[2 * RAW];
  uint up_raw[UP_RAW];
  muser_tile_load_rows<FORMAT_A, FORMAT_B, IN, GLU>(raw, up_raw, weight_a, weight_b, offsets, up_offsets, in_a,
                                                 span, t);
  for (int i = 0; i < 2 * RAW; ++i) {
    sum ^= raw[i];
  }
  for (int i = 0; i < UP_RAW; ++i) {
    sum ^= GLU != 0 ? up_raw[i] : 0u;
  }
}
y[slot] = sum;
"""

FLAT_READ = """
const device uint4* vectors = (const device uint4*)weight;
size_t count = size_t(weight_shape[0]) * size_t(weight_shape[1]) / 16u;
size_t stride = size_t(THREADGROUPS) * 256u;
size_t first = size_t(threadgroup_position_in_grid.x) * 256u + thread_position_in_threadgroup.x;
uint sum = 0u;
for (size_t i = first; i < count; i += stride) {
  uint4 v = vectors[i];
  sum ^= (v.x ^ v.y) ^ (v.z ^ v.w);
}
y[first] = sum;
"""

FLAT_THREADGROUPS = 132 * 16


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    text, inputs = (TILES_READ, ("weight_a", "weight_b")) if name == "tiles_read" else (FLAT_READ, ("weight",))
    probe = kernels.kernel_source(name, inputs, ("y",), text)
    if kernels.backend() == "metal":
        return mx.fast.metal_kernel(name=f"muser_{name}", input_names=list(inputs), output_names=["y"],
                                    source=probe.body, header=probe.header)
    return kernels.IncludedCudaKernel(probe)


def tiles_read(product, rows: int) -> mx.array:
    """The weight loads of `product` (ops.TileProduct) for `rows` rows of x, alone."""
    template, grid, threadgroup, *_ = product.launch_arguments(rows)
    threads = grid[0] * grid[1] * grid[2]
    template = template + [("GRID_X", grid[0] // threadgroup[0]), ("GRID_Y", grid[1])]
    (y,) = _kernel("tiles_read")(inputs=list(product.launch_inputs(rows)), template=template, grid=grid,
                                 threadgroup=threadgroup, output_shapes=[(threads,)], output_dtypes=[mx.uint32])
    return y


def flat_read(weight) -> mx.array:
    """`weight`'s bytes (a GGUF tensor's uint8 [rows, row bytes], a multiple of 16 bytes), read
    as 16-byte vectors."""
    if weight.data.size % 16:
        raise ValueError(f"flat_read: {weight.data.size} bytes, not whole 16-byte vectors")
    (y,) = _kernel("flat_read")(inputs=[weight.data], template=[("THREADGROUPS", FLAT_THREADGROUPS)],
                                grid=(256 * FLAT_THREADGROUPS, 1, 1), threadgroup=(256, 1, 1),
                                output_shapes=[(256 * FLAT_THREADGROUPS,)], output_dtypes=[mx.uint32])
    return y


# Muse Glimmer's products (GGUF shape [in, out], format of A, of B, gated)
SHAPES = {
    "head Q6_K": ((6656, 202048), "Q6_K", None, False),
    "gate+up Q4_K": ((6656, 19968), "Q4_K", "Q4_K", True),
    "down Q4_K": ((19968, 6656), "Q4_K", None, False),
    "q+gate|k+v": ((6656, 8192), "Q4_K", "Q8_0", False),
}


def _random_weight(name: str, shape, format_name: str):
    """Random bytes (timing only) in a weight's layout, as a GGUF tensor stand-in."""
    from muser_mlx.formats import GGMLType, block_format
    from muser_mlx.gguf import StackedRows
    ggml_type = GGMLType[format_name]
    if format_name == "Q8_0" and shape == (6656, 8192):
        shape = (6656, 512)  # k+v beside q+gate
    row_bytes = block_format(ggml_type).row_bytes(shape[0])
    data = mx.random.randint(0, 256, (shape[1], row_bytes)).astype(mx.uint8)
    mx.eval(data)
    return StackedRows(name, ggml_type, shape, data)


def _median_ms(run, runs: int = 5, launches: int = 20) -> float:
    run()  # built and warm
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return 1e3 * sorted(times)[runs // 2] / launches


def main() -> None:
    from muser_mlx import ops
    from settings_cli import parse_variant, settings_from
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...")
    parser.add_argument("--only", default=None, help="these products (comma-separated names of SHAPES)")
    args = parser.parse_args()
    forms = {"default": settings_from([])}
    for variant in args.variant:
        name, changes = parse_variant(variant)
        forms[name] = settings_from(changes)
    names = args.only.split(",") if args.only else list(SHAPES)
    if kernels.backend() == "cpu":
        raise SystemExit("tile_read.py times GPU kernels: no GPU here (mx.default_device() is the CPU)")
    print(f"device {kernels.backend()} ({mx.default_device()}); ms a launch (median of 5 x 20); GB/s of weight bytes",
          flush=True)
    for name in names:
        shape, first, second, gated = SHAPES[name]
        a = _random_weight("a", shape, first)
        b = _random_weight("b", shape, second) if second else None
        weights = [a] + ([b] if b is not None else [])
        nbytes = sum(w.data.nbytes for w in weights)
        flat = _median_ms(lambda: mx.eval([flat_read(w) for w in weights for _ in range(20)]))
        print(f"{name}: {nbytes / 1e9:.3f} GB; plain read {flat:.3f} ms ({nbytes / flat / 1e6:.0f} GB/s)", flush=True)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = ops.quantize_rows(mx.random.normal((rows, shape[0])))
            mx.eval(*x)
            for form, settings in forms.items():
                product = ops.TileProduct(a, b, "silu" if gated else None, settings=settings)
                ms = _median_ms(lambda: mx.eval([product.gated_q8x(x) if gated else product(x, summed=False)
                                                  for _ in range(20)]))
                loads = _median_ms(lambda: mx.eval([tiles_read(product, rows) for _ in range(20)]))
                template, grid, _, chunks, _ = product.launch_arguments(rows)
                print(f"  {rows:>2} rows {form:<8} product {ms:7.3f} ms ({nbytes / ms / 1e6:5.0f} GB/s)  "
                      f"its loads alone {loads:7.3f} ms ({nbytes / loads / 1e6:5.0f} GB/s)  "
                      f"[{grid[0] // (32 * product.warps)} x {grid[1]} x {chunks} threadgroups, "
                      f"TOKENS {dict(template)['TOKENS']}]", flush=True)
        del a, b, weights
        mx.clear_cache()


if __name__ == "__main__":
    main()
