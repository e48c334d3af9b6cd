"""The decoder every architecture here shares: attention, gated FFN, norms, the whole step.

A `ModelConfig` says what differs (rope style, sandwich norms, gates, windows, softcap); the
modules below read it and nothing else. Weights stay raw GGUF blocks (`GGUFTensor`), handed
to `ops.linear` / `ops.embedding_unchecked`; only the small norm vectors and biases are
decoded to float32 at load.

Calling convention (mlx-lm's): `model(token_ids [B, T], cache=model.make_cache()) -> logits
[B, T, vocab]`. The same call serves a one-token decode step and a prefill chunk.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading

import mlx.core as mx
import mlx.nn as nn

from muser_mlx import cpu_ext, gguf, kernels, ops
from muser_mlx.cache import KVCache, SlidingWindowCache, attention_mask, padded_positions
from muser_mlx.dequant import dequantize_rows
from muser_mlx.models import cpu_decode
from muser_mlx.models.config import ModelConfig
from muser_mlx.models.cpu_decode import CPUDecodeStep


# decode_step compiles its graph on a GPU (bench/decode.py --no-compile measures without).
COMPILE_DECODE = True
# decode_step takes the position from the last step's graph (a device array) when it has one for
# this offset, instead of a new host array every step (see decode_step).
DEVICE_POSITION = True
# A GPU prefill chunk (its products on path gpu_dequant_matmul) keeps the float16 outputs of the
# products whose next step converts them anyway, and folds those conversions into that step:
# the FFN's activation and the attention gate become one compiled launch each (`gated_compiled`), where
# MLX's ops took four each (the gate/up pieces' concatenation and float32 conversion, the
# activation, the product; the attention output's conversion, its transpose copy, the sigmoid,
# the product); q and k are converted from their own columns (no copy of the whole output
# first) and v goes to the float16 cache as it is. The values are the same: each float16 output
# is widened to float32 before any arithmetic. A Muse Glimmer layer of a 512-row chunk went from
# ~43 launches to 33, whose building had been the chunk's bound on a slow host (H200: 7,706-7,772
# tokens/s against 6,941-7,151 in the same processes; bench/RESULTS.md, session 32).
PREFILL_FUSED = True
# A GPU prefill chunk's attention is MLX's fused attention, which on CUDA builds a cuDNN graph
# for each shape of q, keys and mask it has not seen: 38-62 ms each on the H200, where the
# attention itself then takes 0.1-0.3 ms (bench/prefill_attention.py; RESULTS.md, session 33).
# A prompt's last chunk has a row count and a key count of its own, so every prompt length a
# process had not seen paid that in its full layers and again in its window layers. Padded
# (`bucketed`): the keys to a multiple of ATTENTION_KEY_BUCKET, the query rows to one of
# ATTENTION_ROW_BUCKET, so that chunks of any length share a few shapes (0: as they are).
ATTENTION_KEY_BUCKET = 256
ATTENTION_ROW_BUCKET = 128


def vector(tensor) -> mx.array:
    """A 1-D GGUF tensor (norm weight, bias) decoded to float32 [n]."""
    return dequantize_rows(tensor.data, tensor.ggml_type).reshape(-1)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x / sqrt(mean(x²) + eps) · weight, in float32 (an eps of 1e-8 vanishes in float16)."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps)


def prefill_fused(x: mx.array, weight) -> bool:
    """Whether x's rows multiply `weight` as a GPU prefill product that PREFILL_FUSED keeps in float16."""
    return PREFILL_FUSED and ops.linear_path(weight.ggml_type, math.prod(x.shape[:-1])) == "gpu_dequant_matmul"


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def bucketed(q: mx.array, keys: mx.array, values: mx.array, key_positions: mx.array, causal: bool):
    """A GPU prefill chunk's attention inputs padded so that their shapes take few values
    (ATTENTION_KEY_BUCKET, ATTENTION_ROW_BUCKET): q [B, heads, T, d], keys and values
    [B, kv_heads, S, d], the keys' positions [S]. Returns (q, keys, values, key_positions,
    front): zero rows after the keys (their positions cache.NOWHERE), zero rows around q's,
    `front` of them before its own; the attention's rows front .. front + T - 1 are the chunk's.

    causal (the mask is bottom-right causal: query i of T sees keys up to S - T + i): q gets
    as many rows after its own as the keys do, so that its own rows still end where the real
    keys end and see exactly what they saw; rows before its own fill it up to a multiple of
    the row bucket, each seeing a prefix of the keys (q's rows never outnumber the keys).
    Otherwise (a mask made from the positions): q's rows after its own only; no real query
    sees a padding key."""
    tokens, seen = q.shape[2], keys.shape[2]
    key_bucket, row_bucket = ATTENTION_KEY_BUCKET, ATTENTION_ROW_BUCKET or 1
    after = _round_up(seen, key_bucket) - seen if key_bucket else 0
    if causal:
        rows = min(_round_up(tokens + after, row_bucket), seen + after)
        front, back = rows - tokens - after, after
    else:
        front, back = 0, _round_up(tokens, row_bucket) - tokens
    if front or back:
        q = mx.pad(q, [(0, 0), (0, 0), (front, back), (0, 0)])
    if after:
        keys, values = (mx.pad(a, [(0, 0), (0, 0), (0, after), (0, 0)]) for a in (keys, values))
        if not causal:  # a causal mask needs no positions
            key_positions = padded_positions(key_positions, after)
    return q, keys, values, key_positions, front


@functools.lru_cache(maxsize=None)
def gated_compiled(activation: str):
    """activation(a) * b of any shape, a and b converted to float32 first (float16 products'
    outputs, possibly strided views), as one compiled launch: activation "silu", "gelu_tanh"
    or "sigmoid"."""
    act = {"silu": nn.silu, "gelu_tanh": ops.gelu_tanh, "sigmoid": mx.sigmoid}[activation]
    return mx.compile(lambda a, b: act(a.astype(mx.float32)) * b.astype(mx.float32), shapeless=True)


def fused_products(make):
    """make(): the fused decode step's launches of some weights; None where a weight's format
    has no q8x kernel (such a model runs the general step)."""
    try:
        return make()
    except ops.NoProductKernelError:
        return None


def _columns(y: mx.array, first: int, width: int) -> mx.array:
    """Columns first .. first + width - 1 of y: y itself when it is that wide, else a view."""
    return y if y.shape[-1] == width else y[..., first : first + width]


class Linear(nn.Module):
    """y = x W.T (+ b) with W kept as the GGUF tensor's raw blocks."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight_tensor = weight  # a GGUFTensor: not an MLX parameter, its bytes stay raw
        if bias is not None:
            self.bias = vector(bias)

    def __call__(self, x: mx.array, keep_float16: bool = False) -> mx.array:
        """keep_float16: as ops.linear's (with a bias, float32 either way)."""
        y = ops.linear(x, self.weight_tensor, keep_float16=keep_float16)
        return y + self.bias if "bias" in self else y

    @property
    def nbytes(self) -> int:
        return self.weight_tensor.nbytes


class Projections(nn.Module):
    """Several projections of one input, as few products as their formats allow: the weights
    of each format are stacked into one array of rows (gguf.stack_rows, still raw blocks) and
    multiplied at once, then the output is split. A decode step is launch-bound as much as
    byte-bound, so q/k/v/gate become one to three products, FFN gate/up one.

    parts: name -> (weight GGUFTensor, bias GGUFTensor or None); calling returns name -> y."""

    def __init__(self, parts: dict):
        super().__init__()
        by_type = {}
        for name, (weight, _) in parts.items():
            by_type.setdefault((weight.ggml_type, weight.shape[0]), []).append(name)
        self.groups = []  # (stacked weight, names, split offsets)
        for names in by_type.values():
            weights = [parts[n][0] for n in names]
            stacked = gguf.stack_rows(weights) if len(weights) > 1 else weights[0]
            offsets = list(itertools.accumulate(w.rows for w in weights))[:-1]
            self.groups.append((stacked, names, offsets))
        self.biases = {n: vector(b) for n, (_, b) in parts.items() if b is not None}
        self.widths = {n: weight.rows for n, (weight, _) in parts.items()}
        # Where each part lands in the concatenated output of all groups (decode_product).
        self.offsets, start = {}, 0
        for stacked, names, _ in self.groups:
            for name in names:
                self.offsets[name] = start
                start += parts[name][0].rows
        # The fused decode step's launches, two groups each, fixed at load (None: a format
        # has no q8x kernel, and the model does not decode fused).
        stacks = [stacked for stacked, _, _ in self.groups]
        self.decode_products = fused_products(lambda: [ops.Product(*stacks[i : i + 2])
                                                       for i in range(0, len(stacks), 2)])

    def __call__(self, x: mx.array, keep_float16: bool = False) -> dict:
        """name -> y [..., rows of its weight]; keep_float16: as ops.linear's (a part with a bias
        is float32 either way)."""
        return self.parts(self.columns(x, keep_float16))

    @staticmethod
    def parts(columns: dict) -> dict:
        """name -> y [..., width] from what `columns` returns (a view of the part's columns)."""
        return {name: _columns(*part) for name, part in columns.items()}

    def columns(self, x: mx.array, keep_float16: bool = False) -> dict:
        """name -> (its group's output, the part's first column, its width): for an op that
        reads a part's columns in place (ops.qk_norm_rope) rather than a copy of them. A part
        with a bias is its own array (the sum), from column 0."""
        out = {}
        for stacked, names, offsets in self.groups:
            y = ops.linear(x, stacked, keep_float16=keep_float16)
            for name, first in zip(names, [0, *offsets]):
                out[name] = (y, first, self.widths[name])
        for name, bias in self.biases.items():
            y, first, width = out[name]
            out[name] = (_columns(y, first, width) + bias, 0, width)
        return out

    @property
    def nbytes(self) -> int:
        return sum(stacked.nbytes for stacked, _, _ in self.groups)

    def decode_product(self, h) -> mx.array:
        """All groups for q8x input h [1, in], as one launch per two groups: float32 [1, width],
        part `name` at self.offsets[name] (biases not added)."""
        pieces = [launch(h) for launch in self.decode_products]
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tensors: dict):
        super().__init__()
        self.config = config
        self.sliding = config.swa_layers[layer]
        self.window = config.sliding_window if self.sliding else None
        self.rope_base = config.rope_base_swa if self.sliding else config.rope_base
        self.rotates = self.sliding or config.rope_full_layers
        t = lambda name: tensors.get(f"blk.{layer}.{name}")  # noqa: E731
        bias = config.qkv_bias
        parts = {n: (t(f"attn_{n}.weight"), t(f"attn_{n}.bias") if bias else None) for n in "qkv"}
        if config.attn_gate:
            parts["gate"] = (t("attn_gate.weight"), None)
        self.input_proj = Projections(parts)
        self.o_proj = Linear(t("attn_output.weight"))
        # Its x comes from attention_combine only, which can write it woven (ops.weave).
        self.decode_output = fused_products(lambda: ops.Product(t("attn_output.weight"), woven=True))
        if config.qk_norm:
            self.q_norm = vector(t("attn_q_norm.weight"))
            self.k_norm = vector(t("attn_k_norm.weight"))
        if bias:
            self.qkv_bias = mx.concatenate([self.input_proj.biases[n] for n in "qkv"])

    def __call__(self, h: mx.array, cache) -> mx.array:
        """h: [B, T, hidden] (normed) -> [B, T, hidden]."""
        c = self.config
        batch, tokens, _ = h.shape
        fused = prefill_fused(h, self.o_proj.weight_tensor)
        columns = self.input_proj.columns(h, keep_float16=fused)
        y = self.input_proj.parts(columns)
        if fused and not c.qk_norm:  # float16 outputs: q and k as float32 for RoPE; v and the gate as they are
            y["q"], y["k"] = y["q"].astype(mx.float32), y["k"].astype(mx.float32)
        v = ops.split_heads(y["v"], c.kv_heads, c.head_dim)  # [B, kv_heads, T, head_dim]
        start = cache.offset
        rope = None
        if self.rotates:
            rope = dict(dims=c.rotary_dim, traditional=c.rope_traditional, base=self.rope_base)
        dtype = ops.attention_dtype(tokens, c.head_dim)
        if c.qk_norm:  # the norm, the head split and RoPE in one op (one kernel on a GPU)
            (q, q_first, _), (k, k_first, _) = columns["q"], columns["k"]
            # A fused prefill chunk: q and k written as attention and the cache take them.
            qk_dtype = dtype if fused and cache.dtype == dtype else mx.float32
            q, k = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, c.heads, c.kv_heads, c.head_dim, c.eps,
                                    start, rope, columns=(q_first, k_first), dtype=qk_dtype)
        else:
            q = ops.split_heads(y["q"], c.heads, c.head_dim, rope=rope, start=start)  # [B, heads, T, hd]
            k = ops.split_heads(y["k"], c.kv_heads, c.head_dim, rope=rope, start=start)
        keys, values, key_positions, in_order = cache.update_and_fetch(k, v, dtype)
        # Keys at positions 0 .. S-1, queries the last T of them, none out of the window: the
        # mask is the causal one, which cuDNN's attention applies itself (an array mask cost
        # more than the attention: ~0.3 ms a Muse Glimmer layer to build and convert).
        causal = dtype == mx.float16 and in_order and (self.window is None or keys.shape[2] <= self.window)
        front = 0
        if dtype == mx.float16 and ATTENTION_KEY_BUCKET:  # a GPU prefill chunk: few shapes (bucketed)
            q, keys, values, key_positions, front = bucketed(q, keys, values, key_positions, causal)
        mask = None
        if causal:
            mask = "causal"
        elif tokens > 1 or self.sliding:  # one token sees a whole full cache; a ring may hold empty slots
            # float16 (a GPU prefill chunk): the additive form, which MLX's attention takes as it is.
            mask = attention_mask(start, q.shape[2], key_positions, self.window,
                                  additive=mx.float16 if dtype == mx.float16 else None)
        o = ops.attention(q, keys, values, c.attention_scale, mask, keep_float16=fused)
        if o.shape[2] != tokens:
            o = o[:, :, front : front + tokens]  # the chunk's own rows
        o = o.transpose(0, 2, 1, 3)  # [B, T, heads, head_dim], a view
        if c.attn_gate:  # sigmoid(gate) * o, o read across its heads' layout (fused: one launch)
            gate = y["gate"].reshape(batch, tokens, c.heads, c.head_dim)
            o = gated_compiled("sigmoid")(gate, o) if fused else o * mx.sigmoid(gate)
        # float16 where fused: the seam (ops.residual_norm) takes it as it is
        return self.o_proj(o.reshape(batch, tokens, c.heads * c.head_dim), keep_float16=fused)


    def decode(self, h, keys: mx.array, values: mx.array, position: mx.array, after: mx.array):
        """The fused one-token step: h as q8x [1, hidden]; keys/values: this layer's cache
        arrays (float16); position: int32 [1]; after: the last step's token (ops.attention_decode).
        Returns (attention output [1, hidden] float32, keys, values) in three launches: the
        projections, kernel attention_decode with its combine (norms, RoPE, cache write, gate,
        quantized), the output projection."""
        c = self.config
        y = self.input_proj.decode_product(h)
        offsets = self.input_proj.offsets
        rope = None
        if self.rotates:
            rope = dict(dims=c.rotary_dim, traditional=c.rope_traditional, base=self.rope_base)
        o, keys, values = ops.attention_decode(
            y, keys, values, position, after, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
            offsets=(offsets["q"], offsets["k"], offsets["v"]), gate=offsets.get("gate"),
            q_weight=self.q_norm if c.qk_norm else None, k_weight=self.k_norm if c.qk_norm else None,
            bias=self.qkv_bias if c.qkv_bias else None, rope=rope, eps=c.eps, scale=c.attention_scale,
            woven=self.decode_output.x_woven)
        return self.decode_output(o), keys, values


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tensors: dict):
        super().__init__()
        self.activation_name = config.activation
        self.activation = nn.silu if config.activation == "silu" else ops.gelu_tanh
        self.gate, self.up = (tensors[f"blk.{layer}.ffn_{n}.weight"] for n in ("gate", "up"))
        self.input_proj = Projections({"gate": (self.gate, None), "up": (self.up, None)})
        self.down_proj = Linear(tensors[f"blk.{layer}.ffn_down.weight"])
        self.decode_products = fused_products(lambda: (
            ops.GatedProduct(self.gate, self.up, config.activation),
            ops.Product(tensors[f"blk.{layer}.ffn_down.weight"])))

    def __call__(self, h: mx.array) -> mx.array:
        if prefill_fused(h, self.gate) and prefill_fused(h, self.up):
            # A product each (no concatenation of the stack's pieces), their float16 outputs
            # into the activation's one launch.
            gate = ops.linear(h, self.gate, keep_float16=True)
            up = ops.linear(h, self.up, keep_float16=True)
            return self.down_proj(gated_compiled(self.activation_name)(gate, up), keep_float16=True)
        y = self.input_proj(h)
        return self.down_proj(self.gated(y["gate"], y["up"]))

    def gated(self, gate: mx.array, up: mx.array) -> mx.array:
        """activation(gate) * up: on the CPU one compiled primitive (MLX's CPU computes
        sigmoid and tanh one value at a time: 16 % of Gemma 3's prefill samples)."""
        if kernels.backend() == "cpu" and cpu_ext.available():
            return cpu_ext.gated_activation(gate, up, self.activation_name)
        return self.activation(gate) * up

    def decode(self, h):
        """The fused one-token step: h as q8x [1, hidden] -> [1, hidden] float32, in two
        launches (gate/up with the activation and q8x epilogue, then down)."""
        gate_up, down = self.decode_products
        return down(gate_up(h))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tensors: dict):
        super().__init__()
        self.config = config
        norm = lambda name: vector(tensors[f"blk.{layer}.{name}.weight"])  # noqa: E731
        self.attn_norm = norm("attn_norm")
        self.ffn_norm = norm("ffn_norm")
        if config.sandwich_norms:
            self.post_attention_norm = norm("post_attention_norm")
            self.post_ffw_norm = norm("post_ffw_norm")
        self.attention = Attention(config, layer, tensors)
        self.feed_forward = FeedForward(config, layer, tensors)

    def __call__(self, x: mx.array, h: mx.array, cache, next_norm: mx.array):
        """x: the residual stream [B, T, hidden]; h: x normed for this layer's attention.
        Returns the new residual stream and it normed by `next_norm` (the next layer's
        attn_norm, or output_norm after the last layer)."""
        c = self.config
        post_eps = c.eps if c.post_norm_eps is None else c.post_norm_eps
        sandwich = c.sandwich_norms
        a = self.attention(h, cache)
        x, h = ops.residual_norm(x, a, self.post_attention_norm if sandwich else None,
                                 self.ffn_norm, post_eps, c.eps)
        f = self.feed_forward(h)
        return ops.residual_norm(x, f, self.post_ffw_norm if sandwich else None, next_norm,
                                 post_eps, c.eps)


    def decode(self, x: mx.array, h, keys: mx.array, values: mx.array, position: mx.array,
               after: mx.array, next_norm: mx.array):
        """The fused one-token step of this layer: x [1, hidden] the residual stream, h it
        normed for attention as q8x. Returns (x, h for the next layer, keys, values): eight
        launches (Attention.decode's three, two seams, FeedForward.decode's two)."""
        c = self.config
        post_eps = c.eps if c.post_norm_eps is None else c.post_norm_eps
        sandwich = c.sandwich_norms
        a, keys, values = self.attention.decode(h, keys, values, position, after)
        x, h = ops.residual_norm_quant(x, a, self.post_attention_norm if sandwich else None,
                                       self.ffn_norm, post_eps, c.eps)
        f = self.feed_forward.decode(h)
        x, h = ops.residual_norm_quant(x, f, self.post_ffw_norm if sandwich else None, next_norm,
                                       post_eps, c.eps)
        return x, h, keys, values


class Transformer(nn.Module):
    """The whole decoder. tensors: GGUF name -> GGUFTensor, already checked against config."""

    def __init__(self, config: ModelConfig, tensors: dict):
        super().__init__()
        self.config = config
        self.token_embd = tensors["token_embd.weight"]
        self.output = tensors["token_embd.weight" if config.tied_embeddings else "output.weight"]
        self.output_norm = vector(tensors["output_norm.weight"])
        self.layers = [Block(config, i, tensors) for i in range(config.layers)]
        if config.embed_norm:
            self.unit_norm = mx.ones((config.hidden,))  # the embedding's norm has no weight
        self.decode_head = fused_products(lambda: ops.Product(
            self.output, head=(config.logit_scale, config.softcap or 0.0)))
        self._decodes_fused = (
            config.head_dim % 64 == 0 and config.hidden % 32 == 0 and self.decode_head is not None
            and all(layer.attention.input_proj.decode_products is not None
                    and layer.attention.decode_output is not None
                    and layer.feed_forward.decode_products is not None for layer in self.layers))
        self._compiled_decode = {}  # thread id -> decode_step's compiled graph
        self._next_position = {}  # id(cache[0]) -> (offset, the position array the last step computed)
        self.cpu_step = CPUDecodeStep(self, rounded=cpu_decode.ROUNDED)  # generate()'s on the CPU
        self.cpu_prompt_step = CPUDecodeStep(self, rounded=False)  # the prompt's last token's
        # The small arrays made here (norm weights, biases) are evaluated now: a lazy array
        # belongs to the stream of the thread that made it, and a model may step in another.
        mx.eval(self.parameters())

    def make_cache(self, dtype=None) -> list:
        """One cache per layer. dtype: float16 where the fused decode step runs (`fused`: a
        GPU), else float32."""
        c = self.config
        dtype = dtype or (mx.float16 if self.fused else mx.float32)
        return [SlidingWindowCache(c.sliding_window, dtype) if sliding else KVCache(dtype)
                for sliding in c.swa_layers]

    @property
    def fused(self) -> bool:
        """Whether one-token steps run the fused decode graph (`decode_step`): on a GPU, for a
        model whose kernels exist (every product's format has a q8x kernel, head_dim a
        multiple of 64, hidden and ff multiples of 32)."""
        return kernels.backend() != "cpu" and self.decodes_fused()

    def decodes_fused(self) -> bool:
        """Whether this model has the fused step's kernels (on any device), decided at load."""
        return self._decodes_fused

    def decode_step(self, token: mx.array, cache: list):
        """One token through the fused decode graph: eight launches a layer (Block.decode),
        then the LM head with logit scale, softcap and greedy argmax in its epilogue.

        token: int32 [1, 1], which may be lazy (sampled from this model's logits, so in range:
        no host check). cache: from make_cache(mx.float16) (make_cache() on a GPU). Returns
        (logits [1, 1, vocab] float32, the greedy token int32 [1]). On a GPU the graph is
        compiled once per cache shape (mx.compile: its Python runs once, not every step)."""
        c = self.config
        position = cache[0].offset
        if position + 1 > c.context:
            raise ValueError(f"{position + 1} positions exceed the model's context of {c.context} tokens")
        if len(cache) != c.layers or any(layer_cache.dtype != mx.float16 for layer_cache in cache):
            raise ValueError("decode_step needs this model's caches in float16: make_cache(mx.float16)")
        for layer_cache in cache:
            layer_cache.reserve(1, c.kv_heads, c.head_dim, position + 1)
        graph = self._decode_graph
        if kernels.backend() != "cpu" and COMPILE_DECODE:
            # A traced graph runs on the streams of the thread that traced it: one per thread.
            thread = threading.get_ident()
            if thread not in self._compiled_decode:
                self._compiled_decode[thread] = mx.compile(self._decode_graph)
            graph = self._compiled_decode[thread]
        # The position as a device array: the last step's graph computed it (DEVICE_POSITION),
        # so the host writes none (a host-written array moves its managed page to the host, and
        # the step's first kernel to touch that page waits for it: kernels.MIN_ARRAY_VALUES);
        # the host makes one when there is none for this offset (the first step, a trimmed cache).
        made = self._next_position.get(id(cache[0]))
        if DEVICE_POSITION and made is not None and made[0] == position:
            position_array = made[1]
        else:
            position_array = kernels.padded_array([position], mx.int32)  # int32 [1] or longer: kernels read [0]
        # On a GPU the kernels write the caches in place, which MLX cannot see: this step's
        # attention launches take the last such step's token as an input, so they follow it
        # even when this step's token came from the host (the general step evaluates it first).
        after = cache[0].written_by if cache[0].written_by is not None else position_array
        logits, greedy, keys, values, next_position = graph(
            token.reshape(1, 1).astype(mx.int32), position_array, after,
            [layer_cache.keys for layer_cache in cache], [layer_cache.values for layer_cache in cache])
        self._next_position = {id(cache[0]): (position + 1, next_position)}
        for layer_cache, layer_keys, layer_values in zip(cache, keys, values):
            layer_cache.keys, layer_cache.values = layer_keys, layer_values
            layer_cache.advance(1)
            layer_cache.written_by = greedy
        return logits, greedy

    def _decode_graph(self, token: mx.array, position: mx.array, after: mx.array, keys: list,
                      values: list):
        """decode_step's graph, a function of arrays alone (so that mx.compile can trace it):
        token int32 [1, 1], position int32 [1] (or padded), the array the cache writes must
        follow, every layer's cache arrays. On a GPU the caches are written in place and returned
        as given; on the CPU new arrays are returned. The last output is the next step's
        position, computed on the device."""
        c = self.config
        x = ops.embedding_unchecked(self.token_embd.data, token, self.token_embd.ggml_type,
                                    c.hidden, c.vocab).reshape(1, c.hidden)
        x, h = ops.residual_norm_quant(None, x, self.unit_norm if c.embed_norm else None,
                                       self.layers[0].attn_norm, c.eps, c.eps, c.embed_scale)
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.output_norm]
        keys, values = list(keys), list(values)
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            x, h, keys[i], values[i] = layer.decode(x, h, keys[i], values[i], position, after, next_norm)
        logits, best = self.decode_head(h)
        return logits.reshape(1, 1, c.vocab), ops.greedy(best), keys, values, position + 1

    def embed(self, ids: mx.array) -> mx.array:
        """ids: validated int32 [B, T] -> float32 [B, T, hidden]."""
        c = self.config
        x = ops.embedding_unchecked(self.token_embd.data, ids, self.token_embd.ggml_type,
                                    c.hidden, c.vocab)
        if c.embed_norm:
            x = rms_norm(x, None, c.eps)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        return x

    def __call__(self, token_ids, cache=None) -> mx.array:
        """token_ids: [B, T] (or [T]) ints, checked on the host; cache: from make_cache()
        (None: a fresh one, for a one-shot forward). Returns float32 logits [B, T, vocab]."""
        return self.logits(self.hidden(token_ids, cache))

    def hidden(self, token_ids, cache=None) -> mx.array:
        """The final normed hidden state [B, T, hidden]: everything before the LM head. A
        prefill chunk whose logits are not needed stops here."""
        ids = ops.check_token_ids(token_ids, self.config.vocab)
        return self.hidden_unchecked(ids[None] if ids.ndim == 1 else ids, cache)

    def hidden_unchecked(self, ids: mx.array, cache=None) -> mx.array:
        """`hidden` without the host check of the ids, so that they may stay lazy: int32
        [B, T] ids known to be in range, e.g. sampled from this model's own logits (every index
        of a logits row is a token id). The next step's graph can then be built while the GPU
        still runs this one."""
        c = self.config
        cache = self.make_cache() if cache is None else cache
        if len(cache) != c.layers:
            raise ValueError(f"cache has {len(cache)} layers; the model has {c.layers}")
        end = cache[0].offset + ids.shape[1]
        if end > c.context:
            raise ValueError(f"{end} positions exceed the model's context of {c.context} tokens")
        x = self.embed(ids)
        h = rms_norm(x, self.layers[0].attn_norm, c.eps)
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.output_norm]
        # A GPU prefill chunk decodes each weight to float16 for the matmul (~1 GB a Muse
        # Glimmer layer): its products are paced (ops.paced_products) so that few of those
        # temporaries are alive at once.
        paced = ids.shape[1] > ops.MATVEC_MAX_TOKENS and kernels.backend() != "cpu"
        with ops.paced_products() if paced else contextlib.nullcontext():
            for layer, layer_cache, next_norm in zip(self.layers, cache, next_norms):
                x, h = layer(x, h, layer_cache, next_norm)
        return h

    def logits(self, hidden: mx.array) -> mx.array:
        """[B, T, hidden] -> float32 [B, T, vocab]: LM head, logit scale, softcap."""
        c = self.config
        logits = ops.linear(hidden, self.output)
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.softcap is not None:
            logits = c.softcap * mx.tanh(logits / c.softcap)
        return logits

    def matrices(self) -> list:
        """The weights one decode step multiplies by, each once, as ops.linear takes them
        (stacked projections as their stacks), the LM head last."""
        found = []
        for layer in self.layers:
            for module in (layer.attention, layer.feed_forward):
                for child in module.children().values():
                    if isinstance(child, Linear):
                        found.append(child.weight_tensor)
                    elif isinstance(child, Projections):
                        found += [stacked for stacked, _, _ in child.groups]
        return found + [self.output]

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matrix once, one embedding row
        (an untied head reads the whole output table; a tied one reads token_embd whole)."""
        return sum(m.nbytes for m in self.matrices()) + self.token_embd.row_bytes
