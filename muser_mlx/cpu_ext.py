"""The CPU products and attention as compiled MLX primitives: muser_mlx._cpu_kernels, built at
install from kernels/cpu by setup.py for the installing machine's CPU.

`linear`, `attention` and the glue between them (`residual_norm`, `attention_decode`,
`gated_activation`) are MLX ops (primitives GGUFLinear, Attention, ...): lazy, evaluated by
mx.eval on a CPU stream, in float32 on all cores with the CPU's vector instructions; `linear`
reads the raw GGUF blocks.
Where the extension was not built or does not load, `available()` is False, `unavailable()`
says why, and ops.linear_path sends the products to MLX's own ops (logged once).
MUSER_CPU_EXT_PATH=<directory> loads the extension built there instead (make test's builds for
other instruction sets: Makefile, test-cpu-arch).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path

import mlx.core as mx

from muser_mlx.formats import GGMLType

_log = logging.getLogger(__name__)


def _load_from(directory: str):
    """The extension built into `directory` (e.g. make test's build for AVX2, build/cpu-x86-64-v3),
    loaded as muser_mlx._cpu_kernels in place of the installed one: (module, '') or (None, why)."""
    files = [path for suffix in importlib.machinery.EXTENSION_SUFFIXES
             for path in sorted(Path(directory).glob(f"_cpu_kernels{suffix}"))]
    if not files:
        return None, f"MUSER_CPU_EXT_PATH={directory} holds no _cpu_kernels extension"
    spec = importlib.util.spec_from_file_location("muser_mlx._cpu_kernels", files[0])
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        return None, f"{files[0]} (MUSER_CPU_EXT_PATH) does not load ({error})"
    sys.modules[spec.name] = module  # so that no importer loads the installed one beside it
    return module, ""


_REINSTALL = "reinstall the package with a C++20 compiler and CMake >= 3.24 on the PATH"
if os.environ.get("MUSER_CPU_EXT_PATH"):
    _cpu_kernels, _why = _load_from(os.environ["MUSER_CPU_EXT_PATH"])
elif importlib.util.find_spec("muser_mlx._cpu_kernels") is None:
    _cpu_kernels = None
    _why = f"the extension muser_mlx._cpu_kernels was not built at install; {_REINSTALL}"
else:
    try:
        from muser_mlx import _cpu_kernels
    except ImportError as error:
        _cpu_kernels = None
        _why = f"muser_mlx._cpu_kernels does not load ({error}); {_REINSTALL}"
    else:
        _why = ""
if _cpu_kernels is not None:
    if _cpu_kernels.mlx_version != mx.__version__:
        _why = (f"muser_mlx._cpu_kernels was built against MLX {_cpu_kernels.mlx_version}, this is "
                f"MLX {mx.__version__}; reinstall muser_mlx")
        _cpu_kernels = None

# The formats with a compiled product (the rest take MLX's ops; see ops.linear_path).
FORMATS = frozenset(t for t in GGMLType if _cpu_kernels is not None and _cpu_kernels.has_product(int(t)))


def available() -> bool:
    return _cpu_kernels is not None


def unavailable() -> str:
    """Why the extension is not available ('' when it is)."""
    return _why


def half_cache() -> bool:
    """Whether the decode primitives take float16 caches (the compiler had _Float16)."""
    return bool(getattr(_cpu_kernels, "half_cache", False))


def instruction_set() -> str:
    """The vector instructions the products were compiled for (e.g. 'avx512')."""
    return _cpu_kernels.instruction_set()


@functools.lru_cache(maxsize=None)
def note_unavailable() -> None:
    """Log once that the CPU products and attention run on MLX's ops, and why."""
    _log.warning("the CPU products and attention run on MLX's own ops, several times slower: %s",
                 _why)


@functools.lru_cache(maxsize=None)
def note_fallback(ggml_type) -> None:
    """Log once per format that a CPU product runs on MLX's ops instead of the extension."""
    if not available():
        note_unavailable()
    else:
        _log.warning("%s weights have no compiled CPU product: MLX's own ops serve them",
                     GGMLType(ggml_type).name)


def linear(rows: mx.array, weight_bytes: mx.array, ggml_type, out_features: int,
           threads: int = 0, rounded: bool = False) -> mx.array:
    """rows [T, in] float @ W.T for W = `out_features` rows of raw GGUF blocks (uint8, any
    shape holding [out, row_bytes]); returns float32 [T, out], multiplied in float32.
    rounded: rows rounded to int8 blocks (one scale max|x|/127 each, half away from zero) of
    32 values (formats.quantize_activations), or of 256 for Q4_K, Q5_K and Q6_K
    (formats.quantize_activations_super), and multiplied with integer dot products (beyond
    a few rows, 4 to 8 by format, as integer panels: products.cpp's rounded_tile_tokens).
    threads: 0 for all cores."""
    if weight_bytes.ndim != 2 or weight_bytes.shape[0] != out_features:
        weight_bytes = weight_bytes.reshape(out_features, -1)  # a graph node: only where needed
    return _cpu_kernels.linear(rows, weight_bytes, int(ggml_type), threads, rounded=rounded)


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None,
              threads: int = 0) -> mx.array:
    """softmax(q keysᵀ · scale, where mask) values in float32: q [B, heads, T, head_dim], keys
    and values [B, kv_heads, S, head_dim] (head_dim a multiple of 16), mask bool [T, S] or
    None; returns float32 [B, heads, T, head_dim] (zeros for a row that sees no key)."""
    return _cpu_kernels.attention(q, keys, values, scale, mask, threads)


def residual_norm(residual: mx.array | None, branch: mx.array, branch_weight: mx.array | None,
                  next_weight: mx.array | None, branch_eps: float, next_eps: float):
    """ops.residual_norm as one primitive: residual (or None), branch float [rows, hidden];
    weights [hidden] (branch_weight None: no post-norm; next_weight None: normed is the sum).
    Returns (sum, normed), float32."""
    total, normed = _cpu_kernels.residual_norm(residual, branch, branch_weight, next_weight,
                                               branch_eps, next_eps)
    return total, normed


def norm_rope_heads(y: mx.array, heads: int, head_dim: int, norm: mx.array | None, eps: float,
                    rope: dict | None, start: int) -> mx.array:
    """ops.split_heads as one primitive: y float [B, T, heads * head_dim] -> [B, heads, T,
    head_dim], each head RMS-normed by `norm` (None: not), then rotated by RoPE (rope:
    dict(dims, base, traditional, freqs), or None) from position `start`; angles in double."""
    return _cpu_kernels.norm_rope_heads(y, norm, heads, head_dim, 0, eps, start, rope["dims"] if rope else 0,
                                        rope["base"] if rope else 0.0, bool(rope and rope["traditional"]),
                                        _inverse_frequencies(rope))


def _inverse_frequencies(rope: dict | None) -> list:
    """The rope's own inverse frequencies (scaled or factored RoPE), or [] for base^(-2i / dims)."""
    return list(rope["freqs"]) if rope and rope.get("freqs") is not None else []


def gated_activation(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    """act(gate) * up as one primitive, 16 values at a time: activation "silu" (x sigmoid(x))
    or "gelu_tanh" (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as x sigmoid(2u)).
    gate, up: float [..., n] of one shape (slices of one product's output are read in place).
    MLX's CPU computes sigmoid and tanh one value at a time (~15 ns each). Returns float32."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"no compiled gated activation {activation!r} (silu, gelu_tanh)")
    return _cpu_kernels.gated_activation(gate, up, activation == "gelu_tanh")


def attention_decode(y: mx.array, keys: mx.array, values: mx.array, position: mx.array, *,
                     heads: int, kv_heads: int, head_dim: int, offsets: tuple[int, int, int],
                     gate: int | None, bias: mx.array | None, q_norm: mx.array | None,
                     k_norm: mx.array | None, rope: dict | None, eps: float, scale: float,
                     qk_norm_whole: bool = False, softcap: float | None = None, threads: int = 0):
    """One decode token's attention from its projections: three primitives (the key and
    value writes, each one output so that MLX can hand it the cache's memory, then attention).

    y: float32 [B, width] (B rows: a batched decode step's; row b at position[b], in the
    cache's row b; the cache may hold more rows): q at offsets[0] (heads * head_dim), k at offsets[1], v at
    offsets[2] (kv_heads * head_dim each), the gate's sigmoid input at `gate` (None: no gate);
    bias: q, k, v biases concatenated, or None; q_norm/k_norm [head_dim] or None (qk_norm_whole:
    [heads * head_dim] / [kv_heads * head_dim], each over its whole projection); softcap: the
    scores' s -> softcap * tanh(s / softcap), or None; rope:
    dict(dims, base, traditional) or None; position: int32 [B]. keys/values: float32 (or
    float16 where half_cache()) [>= B, kv_heads, capacity, head_dim]: slot position % capacity
    receives the token's key and value (rounded to the cache's dtype), slots 0 .. min(position
    + 1, capacity) - 1 are attended.
    Returns (o float32 [B, heads * head_dim], keys, values): new cache arrays, which reuse
    the old ones' memory when nothing else holds them."""
    shape = _decode_heads(heads, kv_heads, head_dim, offsets, gate, rope, eps, scale, qk_norm_whole, softcap)
    keys = _cpu_kernels.write_cache(y, keys, position, bias, k_norm, shape, True)
    values = _cpu_kernels.write_cache(y, values, position, bias, None, shape, False)
    o = _cpu_kernels.attention_decode(y, keys, values, position, bias, q_norm, shape, threads)
    return o, keys, values


def decode_layer(x: mx.array, h: mx.array, keys: mx.array, values: mx.array, position: mx.array, *,
                 attention_in: list, attention_out, ffn_in: list, ffn_out, norms: dict,
                 heads: int, kv_heads: int, head_dim: int, offsets: tuple[int, int, int],
                 gate: int | None, bias: mx.array | None, rope: dict | None, eps: float,
                 post_eps: float, scale: float, activation: str, rounded: bool,
                 qk_norm_whole: bool = False, softcap: float | None = None, threads: int = 0,
                 in_place: bool = False):
    """One decoder layer of a decode step of B rows (a token each) as one primitive: the ~10 nodes of
    residual_norm, attention_decode, gated_activation and the products between them, their
    functions called in the same order on the same values (the same result, bit for bit), with
    MLX paying for one node and the thread pool kept awake between phases.

    x, h: float32 [B, hidden], the residual stream and its normed copy; keys, values [at least
    B, kv_heads, capacity, head_dim], position int32 [B], heads ... scale: as attention_decode's
    rows (row b of the caches is row b's). Products as (uint8 weight [out, row_bytes], ggml
    type): attention_in the groups whose outputs side by side hold q, k, v (and the gate) at
    `offsets`; ffn_in gate|up stacked, or gate then up. norms: "ffn" and "next" (the next
    layer's attention norm, or the output norm) [hidden], each absent where there is none (the
    branch reads the stream itself: OLMo 2); optional "q", "k" (as attention_decode's) and the
    sandwich's "post_attention", "post_ffw" [hidden]. activation: "silu" or "gelu_tanh".
    Returns (x, h, keys, values): x, h float32 [B, hidden] leaving the layer. in_place: the
    caches' memory is written even while MLX still holds the arrays given (a pipelined loop's
    step in flight: MLX keeps a node's buffers until its work has run), so the old arrays change
    too: only for caches no one else reads."""
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"no compiled gated activation {activation!r} (silu, gelu_tanh)")
    shape = _decode_heads(heads, kv_heads, head_dim, offsets, gate, rope, eps, scale, qk_norm_whole, softcap)
    x, h, keys, values = _cpu_kernels.decode_layer(
        x, h, position, keys, values, [(w, int(t)) for w, t in attention_in],
        (attention_out[0], int(attention_out[1])), [(w, int(t)) for w, t in ffn_in],
        (ffn_out[0], int(ffn_out[1])), bias, norms.get("q"), norms.get("k"),
        norms.get("post_attention"), norms.get("ffn"), norms.get("post_ffw"), norms.get("next"), shape,
        eps, post_eps, activation == "gelu_tanh", rounded, threads, in_place)
    return x, h, keys, values


def _decode_heads(heads, kv_heads, head_dim, offsets, gate, rope, eps, scale, qk_norm_whole, softcap):
    """attention_decode's and decode_layer's settings as the extension's DecodeHeads."""
    return _cpu_kernels.DecodeHeads(
        heads, kv_heads, head_dim, *offsets, -1 if gate is None else gate,
        rope["dims"] if rope else 0, bool(rope and rope["traditional"]),
        float(rope["base"]) if rope else 0.0, eps, scale, _inverse_frequencies(rope),
        qk_norm_whole, float(softcap or 0.0))
