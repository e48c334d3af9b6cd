"""The tail of the q/k/v projections: head split, per-head norm, RoPE."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from muser_mlx import cpu_ext, kernels
from muser_mlx.ops.activations import Q8X, Q8X_DTYPES, WovenQ8X, q8x_shapes, quantize_rows_mlx, weave
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.settings import DEFAULT


def split_heads(y: mx.array, heads: int, head_dim: int, weight: mx.array | None = None,
                eps: float = 0.0, rope: dict | None = None, start: int = 0) -> mx.array:
    """A projection's output [B, T, heads * head_dim] as heads [B, heads, T, head_dim], each
    RMS-normed by `weight` if given, then rotated by RoPE if `rope` (dict(dims, base,
    traditional, freqs): freqs the pairs' inverse frequencies where they are not
    base^(-2i / dims), else None) is given, from position `start`. On the CPU the compiled primitive
    (cpu_ext.norm_rope_heads: MLX's ops took ~1.5 ms a Gemma 3 layer of a 128-token prompt),
    elsewhere MLX's own ops."""
    batch, tokens, _ = y.shape
    if (kernels.backend() == "cpu" and cpu_ext.available() and isinstance(start, int)
            and (weight is not None or rope is not None)):
        return cpu_ext.norm_rope_heads(y, heads, head_dim, weight, eps, rope, start)
    y = y.reshape(batch, tokens, heads, head_dim).transpose(0, 2, 1, 3)
    if weight is not None:
        y = mx.fast.rms_norm(y, weight, eps)
    if rope is not None:
        if rope.get("freqs") is None:
            y = mx.fast.rope(y, rope["dims"], traditional=rope["traditional"], base=rope["base"],
                             scale=1.0, offset=start)
        else:  # MLX takes the periods, 1 / inverse frequency
            y = mx.fast.rope(y, rope["dims"], traditional=rope["traditional"], base=None, scale=1.0,
                             offset=start, freqs=_periods(rope["freqs"]))
    return y


def qk_norm_rope(q: mx.array, k: mx.array, q_weight: mx.array, k_weight: mx.array, heads: int,
                 kv_heads: int, head_dim: int, eps: float, start: int, rope: dict | None,
                 columns: tuple[int, int] = (0, 0), dtype=mx.float32):
    """Per-head RMS norm of the q and k projections, then RoPE, as attention wants them.

    q: [B, T, width] whose columns columns[0] .. columns[0] + heads * head_dim - 1 are the q
    projection (columns (0, 0) and widths heads * head_dim, kv_heads * head_dim: q and k as
    they are); k alike from columns[1] (q and k may be one array, a stack's output); float32,
    or float16 on a GPU (a prefill product's output, read as float); weights [head_dim];
    start: the position of row 0; rope: None (no rotation) or dict(dims, base, traditional).
    Returns q [B, heads, T, head_dim] and k [B, kv_heads, T, head_dim] in `dtype` (float16: a
    GPU prefill chunk's attention and cache dtype, rounded once from the float32 result): on a
    GPU from one launch of kernel qk_norm_rope, on the CPU through split_heads (the compiled
    primitive norm_rope_heads, or MLX's rms_norm and rope without the extension).
    """
    batch, tokens, _ = q.shape
    q_off, k_off = columns
    if q_off + heads * head_dim > q.shape[-1] or k_off + kv_heads * head_dim > k.shape[-1]:
        raise ValueError(f"qk_norm_rope: columns {columns} and {heads}/{kv_heads} heads of {head_dim} "
                         f"do not fit q {list(q.shape)} and k {list(k.shape)}")
    if kernels.backend() == "cpu":
        q = q[..., q_off : q_off + heads * head_dim] if q.shape[-1] != heads * head_dim else q
        k = k[..., k_off : k_off + kv_heads * head_dim] if k.shape[-1] != kv_heads * head_dim else k
        q, k = qk_norm_rope_mlx(q.astype(mx.float32), k.astype(mx.float32), q_weight, k_weight, heads, kv_heads,
                                head_dim, eps, start, rope)
        return q.astype(dtype), k.astype(dtype)
    if q.dtype != k.dtype or q.dtype not in (mx.float16, mx.float32):
        q, k = q.astype(mx.float32), k.astype(mx.float32)
    dims = rope["dims"] if rope is not None else 0
    q_out, k_out = kernels.launch(
        "qk_norm_rope",
        inputs=[q, k, q_weight, k_weight, rope_inverse_frequencies(rope),
                _start_array(start), kernels.parameters(eps)],
        template=[("HEADS", heads), ("KV_HEADS", kv_heads), ("HEAD_DIM", head_dim), ("ROTARY", dims),
                  ("TRADITIONAL", int(bool(rope and rope["traditional"]))), ("Q_STRIDE", q.shape[-1]),
                  ("K_STRIDE", k.shape[-1]), ("Q_OFF", q_off), ("K_OFF", k_off)],
        grid=(32 * batch * tokens * (heads + kv_heads), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(batch, heads, tokens, head_dim), (batch, kv_heads, tokens, head_dim)],
        output_dtypes=[dtype, dtype],
    )
    return q_out, k_out


def _start_array(start: int) -> mx.array:
    """int32 [start, start + 1, ...] (MIN_ARRAY_VALUES of them; kernels read [0]) computed on
    the device (an arange): a host-written array lives in managed memory, and the first kernel
    to read it waits for its page to move (H200, a 512-row prefill chunk: qk_norm_rope took
    ~150 us a layer, ~5 us of it its own work)."""
    return mx.arange(start, start + max(1, kernels.MIN_ARRAY_VALUES), dtype=mx.int32)


def qk_norm_rope_mlx(q: mx.array, k: mx.array, q_weight: mx.array, k_weight: mx.array, heads: int,
                     kv_heads: int, head_dim: int, eps: float, start: int, rope: dict | None):
    """qk_norm_rope as split_heads for q and k: its CPU rendering (cpu_ext.norm_rope_heads,
    or MLX's split, rms_norm and rope), and on a GPU (MLX's ops) what the fused kernel is
    measured against (bench/decode.py)."""
    return (split_heads(q, heads, head_dim, q_weight, eps, rope, start),
            split_heads(k, kv_heads, head_dim, k_weight, eps, rope, start))


def _inverse_frequencies(dims: int, base: float) -> mx.array:
    """RoPE's base^(-2i / dims) for i < dims / 2, float32, made once: an array built from host
    values (a lazy one would be recomputed by every compiled step: a per-step
    `copy_s` was once the dummy of the layers without RoPE), padded (kernels.padded_array), with
    zeros alone when dims is 0."""
    return _frequencies(dims, base, kernels.MIN_ARRAY_VALUES)


@functools.lru_cache(maxsize=None)
def _frequencies(dims: int, base: float, _padding: int) -> mx.array:
    values = (base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)).astype(np.float32) if dims else []
    return kernels.padded_array([float(v) for v in values], mx.float32)


def rope_inverse_frequencies(rope: dict | None) -> mx.array:
    """The kernels' inv_freq input for `rope` (a rope dict or None): its own `freqs` where it
    has them (scaled or factored RoPE), else _inverse_frequencies(dims, base)."""
    if rope is None:
        return _inverse_frequencies(0, 0.0)
    if rope.get("freqs") is None:
        return _inverse_frequencies(rope["dims"], rope["base"])
    return _given_frequencies(tuple(rope["freqs"]), kernels.MIN_ARRAY_VALUES)


@functools.lru_cache(maxsize=None)
def _given_frequencies(freqs: tuple, _padding: int) -> mx.array:
    return kernels.padded_array([float(np.float32(v)) for v in freqs], mx.float32)


@functools.lru_cache(maxsize=None)
def _periods(freqs: tuple) -> mx.array:
    """mx.fast.rope's `freqs` (periods: 1 / inverse frequency), float32 [dims / 2], made once."""
    return mx.array(1.0 / np.asarray(freqs, dtype=np.float64), dtype=mx.float32)


def attention_dtype(tokens: int, head_dim: int, backend: str | None = None):
    """The dtype a chunk of `tokens` queries gives `attention` its keys and values in.
    float16 for a GPU prefill chunk (more than MATVEC_MAX_TOKENS rows) when head_dim is one
    cuDNN's fused attention takes (a multiple of 8, at most 128): MLX then runs cuDNN's flash
    attention, where float32 inputs make it materialize every score in float32 (a Muse Glimmer
    layer: 0.6 of its 2.1 ms of GPU time per 512-row chunk, H200). The cache holds
    float16 on a GPU anyway; q is rounded to float16 too (the prefill products already multiply
    in float16). float32 otherwise: decode steps and every CPU step keep their exact path."""
    backend = backend or kernels.backend()
    if backend != "cpu" and tokens > MATVEC_MAX_TOKENS and head_dim % 8 == 0 and head_dim <= 128:
        return mx.float16
    return mx.float32


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: mx.array | None = None, keep_float16: bool = False, softcap: float | None = None) -> mx.array:
    """softmax(q keysᵀ · scale, where mask) values: q [B, heads, T, head_dim], keys/values
    [B, kv_heads, S, head_dim], mask bool [T, S], "causal" (query i of T sees keys up to
    S - T + i) or None; returns float32 [B, heads, T, head_dim] (keep_float16: float16 where
    the attention ran in float16, for a caller that converts it within its own next launch).
    On the CPU the compiled primitive (cpu_ext.attention: MLX's CPU attention runs its matmuls
    on reference BLAS, 5-8x slower); elsewhere MLX's fused attention, in float16 when keys and
    values come in float16 (attention_dtype). softcap (Gemma 2's): each score s becomes
    softcap * tanh(s / softcap) before the mask, in float32 MLX ops (no fused attention takes it)."""
    if softcap is not None:
        return _softcapped_attention(q, keys, values, scale, mask, softcap)
    if kernels.backend() == "cpu":
        if isinstance(mask, str) and mask == "causal":
            tokens, keys_seen = q.shape[2], keys.shape[2]
            mask = mx.arange(keys_seen)[None, :] <= mx.arange(keys_seen - tokens, keys_seen)[:, None]
        if cpu_ext.available() and q.shape[-1] % 16 == 0:
            return cpu_ext.attention(q, keys, values, scale, mask)
        if not cpu_ext.available():
            cpu_ext.note_unavailable()  # logged once
    if keys.dtype == mx.float16:
        o = mx.fast.scaled_dot_product_attention(q.astype(mx.float16), keys, values.astype(mx.float16),
                                                 scale=scale, mask=mask)
        return o if keep_float16 else o.astype(mx.float32)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def _softcapped_attention(q, keys, values, scale, mask, softcap):
    """attention() with softcapped scores, float32: q [B, heads, T, d], keys/values [B,
    kv_heads, S, d]; mask as attention's (bool, additive float, "causal" or None)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (mx.repeat(a.astype(mx.float32), group, axis=1) if group > 1 else a.astype(mx.float32)
                    for a in (keys, values))
    scores = (q.astype(mx.float32) @ keys.swapaxes(-1, -2)) * scale  # [B, heads, T, S]
    scores = softcap * mx.tanh(scores / softcap)
    if isinstance(mask, str):
        tokens, seen = q.shape[2], keys.shape[2]
        mask = mx.arange(seen)[None, :] <= mx.arange(seen - tokens, seen)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32)
    return mx.softmax(scores, axis=-1, precise=True) @ values


def attention_decode(y: mx.array, keys: mx.array, values: mx.array, position: mx.array, after: mx.array,
                     *, heads: int,
                     kv_heads: int, head_dim: int, offsets: tuple[int, int, int], gate: int | None,
                     q_weight: mx.array | None, k_weight: mx.array | None, bias: mx.array | None,
                     rope: dict | None, eps: float, scale: float, woven: bool = False,
                     splits: int = DEFAULT.attention_splits, head_group: int = DEFAULT.attention_head_group,
                     qk_norm_whole: bool = False, softcap: float | None = None, rows: int = 1,
                     out_rows: int | None = None):
    """One decode token's attention from its projections to the output projection's input, for
    one sequence or for each row of a batch (`rows` > 1, below).

    y: float32 [1, width], the q/k/v (and gate) projections' output: q at offsets[0]
    (heads * head_dim), k at offsets[1], v at offsets[2] (kv_heads * head_dim each), the gate's
    sigmoid input at `gate` (None: no attention gate). q_weight/k_weight [head_dim]: per-head norm
    (None: none), or with qk_norm_whole [heads * head_dim] / [kv_heads * head_dim]: each norm
    over its whole projection (OLMo 2); softcap: each score s becomes softcap * tanh(s /
    softcap) (Gemma 2), None: not; bias: q, k, v biases concatenated (None: none); rope: dict(dims, base,
    traditional) or None; position: int32 [1] (or padded: kernels.padded_array), the token's position p; after: an output of the
    last launch that wrote these caches in place (any array where none did): MLX orders a launch
    only by the arrays it reads and writes, and sees no write of the caches.
    keys, values: the layer's cache [1, kv_heads, capacity, head_dim] float16: slot p % capacity
    receives this token's key and value, slots 0 .. min(p + 1, capacity) - 1 are attended (a full
    cache: capacity > p; a sliding-window ring: capacity = window).
    woven: o as a WovenQ8X (ops.weave's layout), for a Product whose x_woven is set.
    splits: the splits of a cache the first pass aims for (1..128; enough SIMD groups to fill the
    GPU); head_group: the query heads a SIMD group takes, at most (more share each key row's
    load, fewer spread q's preparation): Settings.attention_splits / attention_head_group.
    rows: a batch's rows (BatchStep): y [rows or more, width] (row r the batch's r-th sequence),
    position int32 [rows or more] (each row's), keys and values [rows or more, kv_heads,
    capacity, head_dim] (a BatchKV store: row r the r-th sequence's, one capacity for all);
    out_rows (>= rows; None: rows): o's rows, those past `rows` zeros (a batch padded for its
    products).
    Returns (o as q8x [out_rows, heads * head_dim], keys, values): on a GPU, kernels
    attention_decode (norm, RoPE, cache write in place, split attention) and attention_combine
    (splits merged, gate, quantized), the caches returned as given; on the CPU, MLX ops and new
    cache arrays."""
    capacity = keys.shape[2]
    out_rows = rows if out_rows is None else out_rows
    if not (1 <= rows <= min(y.shape[0], keys.shape[0], values.shape[0], position.shape[0]) and rows <= out_rows) \
            or y.ndim != 2 or keys.dtype != mx.float16 or head_dim % 64 or heads % kv_heads:
        raise ValueError(f"attention_decode takes {rows} row(s) ({out_rows} out) of y [rows, width], positions and a "
                         f"float16 cache, and head_dim a multiple of 64; got y {list(y.shape)}, positions "
                         f"{list(position.shape)}, cache {list(keys.shape)} {keys.dtype}, heads {heads}/{kv_heads}, "
                         f"head_dim {head_dim}")
    q_off, k_off, v_off = offsets
    if kernels.backend() == "cpu":
        key_rows, value_rows, outputs = [], [], []
        for r in range(rows):
            o, k, v = _attention_decode_mlx(y[r : r + 1], keys[r : r + 1], values[r : r + 1], position[r : r + 1],
                                            heads, kv_heads, head_dim, offsets, gate, q_weight, k_weight, bias, rope,
                                            eps, scale, qk_norm_whole, softcap)
            outputs.append(o)
            key_rows.append(k)
            value_rows.append(v)
        if out_rows > rows:  # padding rows: zeros
            outputs.append(Q8X(*(mx.zeros((out_rows - rows, *part.shape[1:]), part.dtype) for part in outputs[0])))
        if keys.shape[0] > rows:  # store rows without a sequence, as they were
            key_rows.append(keys[rows:])
            value_rows.append(values[rows:])
        o = outputs[0] if len(outputs) == 1 else Q8X(*(mx.concatenate(parts) for parts in zip(*outputs)))
        keys = key_rows[0] if len(key_rows) == 1 else mx.concatenate(key_rows)
        values = value_rows[0] if len(value_rows) == 1 else mx.concatenate(value_rows)
        return (weave(o) if woven else o), keys, values
    group = heads // kv_heads
    head_group = max(g for g in range(1, min(group, head_group) + 1) if group % g == 0)
    # Keys per split: the least power-of-two multiple of 32 that makes `splits` splits or fewer.
    # The kernel works it out from the cache's capacity in the same way.
    if not 1 <= splits <= 128:
        raise ValueError(f"splits must be 1..128 (attention_combine's lanes hold 4 each), got {splits}")
    max_splits, split = splits, 32
    while split * max_splits < capacity:
        split *= 2
    splits = -(-capacity // split)
    dims = rope["dims"] if rope is not None else 0
    unused = kernels.parameters(0.0)
    (partial,) = kernels.launch(
        "attention_decode",
        inputs=[y, q_weight if q_weight is not None else unused, k_weight if k_weight is not None else unused,
                bias if bias is not None else unused, rope_inverse_frequencies(rope),
                position, keys, values, kernels.parameters(eps, scale, softcap or 0.0), after],
        template=[("HEADS", heads), ("KV_HEADS", kv_heads), ("HEAD_DIM", head_dim), ("ROTARY", dims),
                  ("TRADITIONAL", int(bool(rope and rope["traditional"]))),
                  ("QK_NORM", 0 if q_weight is None else 2 if qk_norm_whole else 1),
                  ("SOFTCAP", int(softcap is not None)), ("BIAS", int(bias is not None)), ("MAX_SPLITS", max_splits), ("HEAD_GROUP", head_group), ("Q_OFF", q_off), ("K_OFF", k_off), ("V_OFF", v_off)],
        grid=(32 * kv_heads * (group // head_group) * splits, rows, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(rows, heads * splits * (head_dim + 2))],  # a row's o [heads, splits, head_dim], (m, l)
        output_dtypes=[mx.float32],
    )
    codes, scales, sums = kernels.launch(
        "attention_combine",
        inputs=[partial, y],
        template=[("HEADS", heads), ("HEAD_DIM", head_dim), ("GATE", int(gate is not None)),
                  ("G_OFF", gate or 0), ("WOVEN", int(bool(woven)))],
        grid=(heads * head_dim, out_rows, 1),  # a SIMD group per 32 channels
        threadgroup=(256, 1, 1),
        output_shapes=q8x_shapes((out_rows,), heads * head_dim),
        output_dtypes=Q8X_DTYPES,
    )
    return (WovenQ8X if woven else Q8X)(codes, scales, sums), keys, values


def _attention_decode_mlx(y, keys, values, position, heads, kv_heads, head_dim, offsets, gate,
                          q_weight, k_weight, bias, rope, eps, scale, qk_norm_whole, softcap):
    """attention_decode's CPU rendering: the same steps as MLX ops on the same cache layout."""
    q_off, k_off, v_off = offsets
    capacity = keys.shape[2]
    position = position[:1]  # a padded array's leading value (kernels.padded_array)
    q = y[:, q_off : q_off + heads * head_dim]
    k = y[:, k_off : k_off + kv_heads * head_dim]
    v = y[:, v_off : v_off + kv_heads * head_dim]
    if bias is not None:
        q = q + bias[: heads * head_dim]
        k = k + bias[heads * head_dim : (heads + kv_heads) * head_dim]
        v = v + bias[(heads + kv_heads) * head_dim :]
    offset = position[0]
    if qk_norm_whole and q_weight is not None:  # each projection normed whole, then split without a norm
        q, k = mx.fast.rms_norm(q, q_weight, eps), mx.fast.rms_norm(k, k_weight, eps)
        q_weight = k_weight = None
    q = split_heads(q[None], heads, head_dim, q_weight, eps, rope, offset)  # [1, heads, 1, hd]
    k = split_heads(k[None], kv_heads, head_dim, k_weight, eps, rope, offset)
    v = v.reshape(1, kv_heads, 1, head_dim)
    slot = (position % capacity).astype(mx.int32)
    keys = mx.slice_update(keys, k.astype(keys.dtype), mx.concatenate([mx.zeros((2,), mx.int32), slot,
                                                                       mx.zeros((1,), mx.int32)]), (0, 1, 2, 3))
    values = mx.slice_update(values, v.astype(values.dtype), mx.concatenate([mx.zeros((2,), mx.int32), slot,
                                                                             mx.zeros((1,), mx.int32)]), (0, 1, 2, 3))
    visible = mx.arange(capacity) < mx.minimum(position + 1, capacity)
    if softcap is None:
        o = mx.fast.scaled_dot_product_attention(q, keys.astype(mx.float32), values.astype(mx.float32),
                                                 scale=scale, mask=visible[None, None, None, :])
    else:
        o = _softcapped_attention(q, keys, values, scale, visible[None, :], softcap)
    o = o.reshape(1, heads * head_dim)
    if gate is not None:
        o = o * mx.sigmoid(y[:, gate : gate + heads * head_dim])
    return quantize_rows_mlx(o), keys, values
