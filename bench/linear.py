"""linear() from GGUF blocks against the bandwidth floor, MLX's quantized_matmul and f16 matmul.

Shapes (out x in) are Muse Glimmer's projections; on the CPU, SmolLM2-135M's. Weights are
valid blocks written directly as bytes (random quants, finite scales), several copies of
each so that repeated calls stream from memory, not from the 60 MB L2.

T = 1: CALLS calls per mx.eval (rotating weight copies and x), time per call, weight bytes,
GB/s, and time over the floor (weight bytes / the copy bandwidth measured in this run).
T = 512: TFLOP/s of linear() against an f16 `x @ w.T` of the same shape.

    python bench/linear.py [--ours-only]
    python bench/linear.py --products [--types Q4_K,Q6_K] [--product-configs 2:8:1,2:8:2]   # q8x kernels

--products times each configuration as Settings(products={format: config}) with the by-width
tables empty, passed to ops.product / ops.product_glu.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from ceiling import copy_bandwidth
from muser_mlx import formats, kernels, ops
from muser_mlx.settings import DEFAULT

GPU_SHAPES = [(4096, 6656), (256, 6656), (6656, 4096), (19968, 6656), (6656, 19968), (202048, 6656)]
CPU_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
SCALE_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q8_0: (0,), GGMLType.Q4_1: (0, 2)}
STREAM_BYTES = 512 << 20  # weight copies per shape add up to at least this


class Weight:
    """Stands in for a GGUF tensor: raw bytes [out, row_bytes] plus type and GGUF shape."""

    def __init__(self, data, ggml_type, in_features, out_features):
        self.data, self.ggml_type = data, ggml_type
        self.shape = (in_features, out_features)
        self.name = f"{ggml_type.name} {out_features}x{in_features}"


def valid_weight(rng, ggml_type, out_features, in_features) -> mx.array:
    fmt = formats.FORMATS[ggml_type]
    row_bytes = fmt.row_bytes(in_features)
    raw = np.frombuffer(rng.bytes(out_features * row_bytes), dtype=np.uint8).copy()
    blocks = raw.reshape(-1, fmt.type_size)
    for start in SCALE_FIELDS[ggml_type]:
        scale = rng.uniform(1e-3, 1e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start : start + 2] = scale.reshape(-1, 1).view(np.uint8)
    return mx.array(raw.reshape(out_features, row_bytes))


def per_call_seconds(make_calls, repeats: int) -> float:
    calls = make_calls()
    mx.eval(calls)  # warm-up: builds kernels
    times = []
    for _ in range(repeats):
        calls = make_calls()
        start = time.perf_counter()
        mx.eval(calls)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(calls)


def row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--types", default="", help="--products: only these types (e.g. Q4_K,Q6_K)")
    parser.add_argument("--product-configs", default=[],
                        type=lambda s: [tuple(int(v) for v in c.split(":")) for c in s.split(",")],
                        help="--products: R:G:U[:W[:S[:I[:L]]]] (ProductConfig's rows, SIMD groups, unroll, wide "
                             "Q4_K units, stage, int floats, lean) configurations, e.g. 2:8:1,2:8:1:1")
    parser.add_argument("--cases", default="", help="--products: only these labels (comma-separated), e.g. attn_output,q+gate|k+v")
    parser.add_argument("--products", action="store_true",
                        help="GPU: the fused decode's q8x products on Muse Glimmer's shapes, over rows per "
                             "SIMD group x SIMD groups per threadgroup, then stop")
    parser.add_argument("--ours-only", action="store_true",
                        help="skip MLX's quantized_matmul and the f16 matvec (measured in earlier runs)")
    args = parser.parse_args()
    on_gpu = kernels.backend() != "cpu"
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    ggml_types = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0] if on_gpu else [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K]
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth((4 << 30) if on_gpu else (256 << 20), args.repeats)
    print(f"backend {kernels.backend()} ({mx.device_info().get('device_name')}); "
          f"{args.calls} calls per evaluation, median of {args.repeats}")
    print(f"ceiling: elementwise copy {bandwidth / 1e9:,.0f} GB/s (read + write)\n")

    if args.products:
        products(rng, bandwidth, args)
        return
    print("T = 1 (decode)\n")
    print(row(["shape out x in", "weight", "path", "µs / call", "weight MB", "GB/s", "% of ceiling", "time / floor"]))
    print(row(["---"] * 2 + ["---"] + ["---:"] * 5))
    for out_features, in_features in shapes:
        for ggml_type in ggml_types:
            if in_features % formats.FORMATS[ggml_type].block_size:
                continue
            nbytes = out_features * formats.FORMATS[ggml_type].row_bytes(in_features)
            copies = max(1, math.ceil(STREAM_BYTES / nbytes)) if on_gpu else 1
            weights = [Weight(valid_weight(rng, ggml_type, out_features, in_features), ggml_type, in_features, out_features)
                       for _ in range(copies)]
            xs = [mx.random.normal((1, in_features)) for _ in range(4)]
            seconds = per_call_seconds(
                lambda: [ops.linear(xs[i % 4], weights[i % copies]) for i in range(args.calls)], args.repeats)
            path = ops.linear_path(ggml_type, 1)
            print(row([f"{out_features} x {in_features}", ggml_type.name, path, f"{seconds * 1e6:,.1f}",
                       f"{nbytes / 1e6:,.1f}", f"{nbytes / seconds / 1e9:,.0f}",
                       f"{100 * nbytes / seconds / bandwidth:.0f} %", f"{seconds / (nbytes / bandwidth):.2f}x"]))
            del weights
        if on_gpu and not args.ours_only:
            # MLX's own 4-bit affine quantization and an f16 matvec at the same shape.
            dense = [mx.random.normal((out_features, in_features)).astype(mx.float16) for _ in range(2)]
            xs16 = [x.astype(mx.float16) for x in xs]
            for group in (32, 64):
                quantized = [mx.quantize(w, group_size=group, bits=4) for w in dense]
                qbytes = sum(a.nbytes for a in quantized[0])
                seconds = per_call_seconds(lambda: [
                    mx.quantized_matmul(xs16[i % 4], *quantized[i % 2], transpose=True, group_size=group, bits=4)
                    for i in range(args.calls)], args.repeats)
                print(row([f"{out_features} x {in_features}", f"mx 4-bit g{group}", "quantized_matmul",
                           f"{seconds * 1e6:,.1f}", f"{qbytes / 1e6:,.1f}", f"{qbytes / seconds / 1e9:,.0f}",
                           f"{100 * qbytes / seconds / bandwidth:.0f} %", f"{seconds / (qbytes / bandwidth):.2f}x"]))
            fbytes = dense[0].nbytes
            seconds = per_call_seconds(lambda: [xs16[i % 4] @ dense[i % 2].T for i in range(args.calls)], args.repeats)
            print(row([f"{out_features} x {in_features}", "f16", "x @ w.T", f"{seconds * 1e6:,.1f}",
                       f"{fbytes / 1e6:,.1f}", f"{fbytes / seconds / 1e9:,.0f}",
                       f"{100 * fbytes / seconds / bandwidth:.0f} %", f"{seconds / (fbytes / bandwidth):.2f}x"]))
            del dense, quantized

    if not on_gpu:
        return
    print("\nT = 512 (prefill)\n")
    print(row(["shape out x in", "weight", "path", "ms / call", "TFLOP/s", "f16 matmul ms", "f16 TFLOP/s"]))
    print(row(["---"] * 3 + ["---:"] * 4))
    for out_features, in_features in shapes:
        flops = 2 * 512 * in_features * out_features
        x = mx.random.normal((512, in_features))
        dense = mx.random.normal((out_features, in_features)).astype(mx.float16)
        x16 = x.astype(mx.float16)
        f16_seconds = per_call_seconds(lambda: [x16 @ dense.T for _ in range(4)], args.repeats)
        for ggml_type in ggml_types:
            weight = Weight(valid_weight(rng, ggml_type, out_features, in_features), ggml_type, in_features, out_features)
            seconds = per_call_seconds(lambda: [ops.linear(x, weight) for _ in range(4)], args.repeats)
            print(row([f"{out_features} x {in_features}", ggml_type.name, ops.linear_path(ggml_type, 512),
                       f"{seconds * 1e3:,.3f}", f"{flops / seconds / 1e12:,.1f}",
                       f"{f16_seconds * 1e3:,.3f}", f"{flops / f16_seconds / 1e12:,.1f}"]))
        del dense


# The fused decode step's products on Muse Glimmer (out x in, the formats of the released mix):
# the layer's projections (q+gate Q4_K with k+v Q8_0, one launch), attn_output, gate/up with
# the SwiGLU epilogue, ffn_down (Q4_K or Q6_K), and the LM head with its softcap epilogue.
PRODUCT_CASES = [
    ("q+gate|k+v", (8192, 6656), GGMLType.Q4_K, (512, GGMLType.Q8_0)),
    ("attn_output", (6656, 4096), GGMLType.Q4_K, None),
    ("ffn gate/up GLU", (19968, 6656), GGMLType.Q4_K, "glu"),
    ("ffn_down", (6656, 19968), GGMLType.Q4_K, None),
    ("ffn_down", (6656, 19968), GGMLType.Q6_K, None),
    ("LM head", (202048, 6656), GGMLType.Q6_K, "head"),
    ("attn_output", (6656, 4096), GGMLType.Q8_0, None),
    ("ffn_down", (6656, 19968), GGMLType.Q8_0, None),
]


def products(rng, bandwidth, args) -> None:
    """µs per call and % of the copy ceiling of ops.product / product_glu (x as q8x, made once)
    over ProductConfigs of rows per SIMD group x SIMD groups per threadgroup: each column's
    config for its format at every width (Settings' by-width tables empty)."""
    configs = [ops.ProductConfig(*c) for c in args.product_configs] or [
        ops.ProductConfig(r, g) for r in (1, 2, 4, 8) for g in (2, 4, 8)]
    print("| product | shape out x in | weight | MB | "
          + " | ".join(f"R{c.rows} G{c.simd_groups} U{c.unroll}" + (" W" if c.wide else "") for c in configs) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in configs) + " |")
    for label, (out_features, in_features), ggml_type, extra in PRODUCT_CASES:
        if args.cases and label not in args.cases.split(","):
            continue
        if args.types and ggml_type.name not in args.types.split(","):
            continue
        row_bytes = formats.FORMATS[ggml_type].row_bytes(in_features)
        nbytes = out_features * row_bytes * (2 if extra == "glu" else 1)
        if isinstance(extra, tuple):
            nbytes += extra[0] * formats.FORMATS[extra[1]].row_bytes(in_features)
        copies = max(1, math.ceil(STREAM_BYTES / nbytes))

        def make():
            w = Weight(valid_weight(rng, ggml_type, out_features, in_features), ggml_type, in_features, out_features)
            if isinstance(extra, tuple):
                return w, Weight(valid_weight(rng, extra[1], extra[0], in_features), extra[1], in_features, extra[0])
            if extra == "glu":
                return w, Weight(valid_weight(rng, ggml_type, out_features, in_features), ggml_type, in_features, out_features)
            return w, None

        weights = [make() for _ in range(copies)]
        xs = [ops.quantize_rows(mx.random.normal((1, in_features))) for _ in range(4)]
        mx.eval(xs)

        def call(i, settings):
            first, second = weights[i % copies]
            x = xs[i % 4]
            if extra == "glu":
                return list(ops.product_glu(x, first, second, settings=settings))
            if extra == "head":
                return list(ops.product(x, first, head=(0.196, 20.0), settings=settings))
            return ops.product(x, first, second, settings=settings)

        cells = []
        for config in configs:
            if extra == "glu" and config.simd_groups != 4 and not args.product_configs:  # glu: 32 / rows SIMD groups
                cells.append("")
                continue
            settings = DEFAULT.replace(products={**DEFAULT.products, ggml_type: config}, products_by_width={},
                                       glu_by_width={})
            seconds = per_call_seconds(lambda: [call(i, settings) for i in range(args.calls)], args.repeats)
            cells.append(f"{seconds * 1e6:,.1f} ({100 * nbytes / seconds / bandwidth:.0f}%)")
        print(row([label, f"{out_features} x {in_features}", ggml_type.name, f"{nbytes / 1e6:,.1f}"] + cells),
              flush=True)
        del weights


if __name__ == "__main__":
    main()
