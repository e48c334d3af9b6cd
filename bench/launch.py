"""The fixed cost of one op in a long chain: our custom kernels against MLX's own ops.

A decode step is ~1,000 small ops, so what one op costs apart from its bytes matters as much
as the kernels' bandwidth. Each case chains N ops (each one's output the next one's input,
as in a model), times building the graph in Python and evaluating it, and prints both per op:
- ops.linear of one row on a 256 x 256 Q4_K weight (on a GPU our generic matvec kernel, the
  lib headers included);
- a bare copy kernel with no header (the same launch path, a short source), and the same
  kernel with a 12 KB header of comment lines (MLX builds and hashes a kernel's whole source
  at every launch: the cost of source size alone);
- the padded kernel as the CUDA kernels reach MLX (kernels.CUDA_INCLUDES): its header in a
  file, an #include line in the source MLX hashes;
- the bare copy kernel with five more (unused) small inputs, with three more outputs, and with
  one more (unused) 320 MB input: what each array of a launch costs, and what a graph commit
  costs (MLX's CUDA backend commits a graph every 100 ops or every 1,000 MB of inputs on
  sm_90, MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER: a decode step's weights commit one
  every ~3 layers);
- mx.quantized_matmul 4-bit on a 256 x 256 weight (MLX's own quantized op);
- mx.fast.rms_norm and x * 1.0001 on [1, 256] (MLX's own small ops).

--prefill: instead, the kinds of op a GPU prefill chunk is made of, at small shapes so that
the host's cost shows: a float16 matmul through cuBLAS ([64, 256] x [256, 256]^T), MLX's
fused attention (cuDNN, causal, [1, 4, 64, 64]), the compiled gated activation
(transformer.gated_compiled), and x * 1.0001 and the matmul each followed by an mx.async_eval
(as the prefill pacer queues each product: an encoding and a committed CUDA graph each).

    python bench/launch.py [--ops 400] [--repeats 5] [--prefill]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muser_mlx import gguf, kernels, ops, testing  # noqa: E402
from muser_mlx.formats import GGMLType  # noqa: E402

WIDTH = 256
PADDING = 12_000  # bytes of comment lines in the padded copy kernel's header


def chain_cost(op, x, count: int, repeats: int) -> tuple[float, float]:
    """Median µs per op of building and of evaluating a chain of `count` ops."""
    builds, evals = [], []
    for _ in range(repeats + 1):
        mx.eval(x)
        tic = time.perf_counter()
        y = x
        for _ in range(count):
            y = op(y)
        built = time.perf_counter()
        mx.eval(y)
        done = time.perf_counter()
        builds.append(built - tic)
        evals.append(done - built)
    return 1e6 * statistics.median(builds[1:]) / count, 1e6 * statistics.median(evals[1:]) / count


def report(name: str, op, x, count: int, repeats: int) -> None:
    """One line: chain_cost's µs per op, building and evaluating."""
    build, run = chain_cost(op, x, count, repeats)
    print(f"{name:40s} build {build:6.1f} µs/op   evaluate {run:6.1f} µs/op   total {build + run:6.1f}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill", action="store_true", help="the ops of a GPU prefill chunk instead")
    args = parser.parse_args()
    if args.prefill:
        return prefill_costs(args.ops, args.repeats)
    print(f"device: {mx.default_device()}, backend {kernels.backend()}; {args.ops} chained ops", flush=True)
    rng = np.random.default_rng(0)
    weight = mx.array(testing.random_blocks(rng, GGMLType.Q4_K, WIDTH, WIDTH).reshape(WIDTH, -1))
    tensor = gguf.StackedRows("w", GGMLType.Q4_K, (WIDTH, WIDTH), weight)  # a GGUF tensor's stand-in
    x = mx.array(rng.standard_normal((1, WIDTH)).astype(np.float32))
    norm_weight = mx.ones((WIDTH,))
    w_mx, scales, biases = mx.quantize(mx.array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)),
                                       group_size=64, bits=4)
    copy = None
    if kernels.backend() != "cpu":
        maker = mx.fast.cuda_kernel if kernels.backend() == "cuda" else mx.fast.metal_kernel
        index = ("(blockIdx.x * blockDim.x + threadIdx.x)" if kernels.backend() == "cuda"
                 else "thread_position_in_grid.x")
        body = f"unsigned int i = {index}; if (i < 256) {{ y[i] = x[i]; }}"
        copy = maker(name="bench_copy", input_names=["x"], output_names=["y"], source=body)
        many_in = maker(name="bench_copy_many_in", input_names=["x", "a", "b", "c", "d", "e"],
                        output_names=["y"], source=body)
        many_out = maker(name="bench_copy_many_out", input_names=["x"], output_names=["y", "p", "q", "r"],
                         source=body)
        padding = "".join(f"// {i:5d} {'.' * 70}\n" for i in range(PADDING // 80))
        padded = maker(name="bench_copy_padded", input_names=["x"], output_names=["y"], source=body,
                       header=padding)
        included = None
        if kernels.backend() == "cuda":
            included = maker(name="bench_copy_included", input_names=["x"], output_names=["y"], source=body,
                             header=f'#include "{kernels.cuda_text_file(padding)}"\n')

    cases = {
        f"ops.linear Q4_K ({ops.linear_path(GGMLType.Q4_K, 1)})": lambda y: ops.linear(y, tensor),
        "mx.quantized_matmul 4-bit": lambda y: mx.quantized_matmul(y, w_mx, scales, biases, transpose=True,
                                                                   group_size=64, bits=4),
        "mx.fast.rms_norm": lambda y: mx.fast.rms_norm(y, norm_weight, 1e-5),
        "x * 1.0001": lambda y: y * 1.0001,
    }
    if copy is not None:
        cases["bare copy kernel (no header)"] = lambda y: copy(
            inputs=[y], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1), output_shapes=[(1, WIDTH)],
            output_dtypes=[mx.float32])[0]
        cases[f"bare copy kernel, {PADDING // 1000} KB header"] = lambda y: padded(
            inputs=[y], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1), output_shapes=[(1, WIDTH)],
            output_dtypes=[mx.float32])[0]
        if included is not None:
            cases[f"the same {PADDING // 1000} KB header, #included"] = lambda y: included(
                inputs=[y], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1), output_shapes=[(1, WIDTH)],
                output_dtypes=[mx.float32])[0]
        smalls = [mx.zeros((4,)) for _ in range(5)]
        big = mx.zeros((320 << 20,), dtype=mx.uint8)
        mx.eval(smalls, big)
        cases["bare copy, 5 more small inputs"] = lambda y: many_in(
            inputs=[y, *smalls], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1), output_shapes=[(1, WIDTH)],
            output_dtypes=[mx.float32])[0]
        cases["bare copy, 3 more outputs"] = lambda y: many_out(
            inputs=[y], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1),
            output_shapes=[(1, WIDTH), (4,), (4,), (4,)], output_dtypes=[mx.float32] * 4)[0]
        cases["bare copy, one more 320 MB input"] = lambda y: many_in(
            inputs=[y, big, *smalls[:4]], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1),
            output_shapes=[(1, WIDTH)], output_dtypes=[mx.float32])[0]
    for name, op in cases.items():
        report(name, op, x, args.ops, args.repeats)


def prefill_costs(count: int, repeats: int) -> None:
    """The host's cost of a GPU prefill chunk's kinds of op (--prefill)."""
    from muser_mlx.models import transformer

    print(f"device: {mx.default_device()}, backend {kernels.backend()}; {count} chained ops (prefill's kinds)",
          flush=True)
    rng = np.random.default_rng(0)
    rows = mx.array(rng.standard_normal((64, WIDTH)).astype(np.float16))
    w16 = mx.array((rng.standard_normal((WIDTH, WIDTH)) / 16).astype(np.float16))
    heads = mx.array((rng.standard_normal((1, 4, 64, 64)) / 8).astype(np.float16))
    gated = transformer.gated_compiled("silu")

    def queued(op):
        def run(y):
            out = op(y)
            mx.async_eval(out)
            return out
        return run

    cases = [
        ("x * 1.0001 (float16 [64, 256])", lambda y: y * 1.0001, rows),
        ("float16 matmul (cuBLAS)", lambda y: y @ w16.T, rows),
        ("fused attention, causal (cuDNN)",
         lambda y: mx.fast.scaled_dot_product_attention(y, y, y, scale=0.125, mask="causal"), heads),
        ("compiled gated silu(a) * b", lambda y: gated(y, y), rows),
        ("x * 1.0001, an async_eval each", queued(lambda y: y * 1.0001), rows),
        ("float16 matmul, an async_eval each", queued(lambda y: y @ w16.T), rows),
    ]
    for name, op, x in cases:
        report(name, op, x, count, repeats)


if __name__ == "__main__":
    main()
