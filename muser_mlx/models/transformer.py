"""The decoder every architecture here shares, and its general step (any number of tokens).

A `ModelConfig` says what differs (rope style, sandwich norms, gates, windows, softcap); the
modules below read it and nothing else. Weights stay raw GGUF blocks (`GGUFTensor`), handed
to `ops.linear` / `ops.embedding_unchecked`; only the small norm vectors and biases are
decoded to float32 at load. The model's Settings (muser_mlx/settings.py) are fixed at load.

Calling convention (mlx-lm's): `model(token_ids [B, T], cache=model.make_cache()) -> logits
[B, T, vocab]`. The same call serves a one-token step and a prefill chunk. The one-token
steps generate() runs are gpu_decode.py's (fused kernels) and cpu_decode.py's (compiled CPU
primitives); all three build a layer with layers.decoder_layer.
"""

from __future__ import annotations

import contextlib
import functools
import math

import mlx.core as mx
import mlx.nn as nn

from muser_mlx import cpu_ext, kernels, ops
from muser_mlx.cache import KVCache, SlidingWindowCache, attention_mask, padded_positions
from muser_mlx.models.config import ModelConfig
from muser_mlx.models.cpu_decode import CPUDecodeStep
from muser_mlx.models.gpu_decode import GPUDecodeStep
from muser_mlx.models.layers import Linear, Projections, decoder_layer, rms_norm, vector
from muser_mlx.settings import DEFAULT, Settings


def prefill_fused(x: mx.array, weight) -> bool:
    """Whether x's rows multiply `weight` as a GPU prefill product (path gpu_dequant_matmul),
    whose float16 output the chunk keeps where the next step converts it anyway: the FFN's
    activation and the attention gate become one compiled launch each (`gated_compiled`), q
    and k are widened from their own columns and v goes to the float16 cache as it is. The
    values are the same (each float16 output is widened before any arithmetic); a Muse Glimmer
    layer went from ~43 launches to 33, whose building had bound the chunk (7,706-7,772 tokens/s
    against 6,941-7,151)."""
    return ops.linear_path(weight.ggml_type, math.prod(x.shape[:-1])) == "gpu_dequant_matmul"


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def bucketed(q: mx.array, keys: mx.array, values: mx.array, key_positions: mx.array, causal: bool,
             key_bucket: int, row_bucket: int):
    """A GPU prefill chunk's attention inputs padded so that their shapes take few values
    (multiples of key_bucket keys and row_bucket rows: Settings.attention_key_bucket /
    attention_row_bucket), so that chunks of any length share a few cuDNN graphs (38-62 ms to
    build each, where the attention then takes 0.1-0.3 ms): q [B, heads, T, d], keys and values
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
    row_bucket = row_bucket or 1
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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tensors: dict, settings: Settings = DEFAULT):
        super().__init__()
        self.config = config
        self.sliding = config.swa_layers[layer]
        self.window = config.sliding_window if self.sliding else None
        self.rope = config.rope(layer)
        self.buckets = (settings.attention_key_bucket, settings.attention_row_bucket)
        t = lambda name: tensors.get(f"blk.{layer}.{name}")  # noqa: E731
        bias = config.qkv_bias
        parts = {n: (t(f"attn_{n}.weight"), t(f"attn_{n}.bias") if bias else None) for n in "qkv"}
        if config.attn_gate:
            parts["gate"] = (t("attn_gate.weight"), None)
        self.input_proj = Projections(parts)
        self.o_proj = Linear(t("attn_output.weight"))
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
        if c.qk_norm_whole:  # OLMo 2: each projection normed whole, in float32, before the head split
            y["q"], y["k"] = rms_norm(y["q"], self.q_norm, c.eps), rms_norm(y["k"], self.k_norm, c.eps)
        elif fused and not c.qk_norm:  # float16 outputs: q and k as float32 for RoPE; v and the gate as they are
            y["q"], y["k"] = y["q"].astype(mx.float32), y["k"].astype(mx.float32)
        v = ops.split_heads(y["v"], c.kv_heads, c.head_dim)  # [B, kv_heads, T, head_dim]
        start = cache.offset
        rope = self.rope
        dtype = ops.attention_dtype(tokens, c.head_dim)
        if c.qk_norm and not c.qk_norm_whole:  # the norm, the head split and RoPE in one op (one kernel on a GPU)
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
        if dtype == mx.float16 and self.buckets[0]:  # a GPU prefill chunk: few shapes (bucketed)
            q, keys, values, key_positions, front = bucketed(q, keys, values, key_positions, causal, *self.buckets)
        mask = None
        if causal:
            mask = "causal"
        elif tokens > 1 or self.sliding:  # one token sees a whole full cache; a ring may hold empty slots
            # float16 (a GPU prefill chunk): the additive form, which MLX's attention takes as it is.
            mask = attention_mask(start, q.shape[2], key_positions, self.window,
                                  additive=mx.float16 if dtype == mx.float16 else None)
        o = ops.attention(q, keys, values, c.attention_scale, mask, keep_float16=fused, softcap=c.attn_softcap)
        if o.shape[2] != tokens:
            o = o[:, :, front : front + tokens]  # the chunk's own rows
        o = o.transpose(0, 2, 1, 3)  # [B, T, heads, head_dim], a view
        if c.attn_gate:  # sigmoid(gate) * o, o read across its heads' layout (fused: one launch)
            gate = y["gate"].reshape(batch, tokens, c.heads, c.head_dim)
            o = gated_compiled("sigmoid")(gate, o) if fused else o * mx.sigmoid(gate)
        # float16 where fused: the seam (ops.residual_norm) takes it as it is
        return self.o_proj(o.reshape(batch, tokens, c.heads * c.head_dim), keep_float16=fused)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tensors: dict):
        super().__init__()
        self.activation_name = config.activation
        self.activation = nn.silu if config.activation == "silu" else ops.gelu_tanh
        self.gate, self.up = (tensors[f"blk.{layer}.ffn_{n}.weight"] for n in ("gate", "up"))
        self.input_proj = Projections({"gate": (self.gate, None), "up": (self.up, None)})
        self.down_proj = Linear(tensors[f"blk.{layer}.ffn_down.weight"])

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

class Block(nn.Module):
    """One decoder layer's weights: its norms (the sandwich post-norms None where the model has
    none, the pre-norms None where it has none), attention and feed-forward. The general step runs it for any number of tokens."""

    def __init__(self, config: ModelConfig, layer: int, tensors: dict, settings: Settings = DEFAULT):
        super().__init__()
        self.config = config
        norm = lambda name: vector(tensors[f"blk.{layer}.{name}.weight"])  # noqa: E731
        self.attn_norm = norm("attn_norm") if config.pre_norms else None  # None: the branch reads x
        self.ffn_norm = norm("ffn_norm") if config.pre_norms else None
        sandwich = config.sandwich_norms
        self.post_attention_norm = norm("post_attention_norm") if sandwich else None
        self.post_ffw_norm = norm("post_ffw_norm") if sandwich else None
        self.attention = Attention(config, layer, tensors, settings)
        self.feed_forward = FeedForward(config, layer, tensors)


class GeneralPieces:
    """layers.LayerPieces of the general step: T tokens, float32 x, a cache object."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def attention(self, index: int, block, h, cache):
        return block.attention(h, cache), cache

    def seam(self, x, branch, branch_weight, next_weight):
        c = self.config
        return ops.residual_norm(x, branch, branch_weight, next_weight, c.post_eps, c.eps)

    def feed_forward(self, index: int, block, h):
        return block.feed_forward(h)


class Transformer(nn.Module):
    """The whole decoder. tensors: GGUF name -> GGUFTensor, already checked against config;
    settings: the tunables, fixed here (muser_mlx/settings.py)."""

    def __init__(self, config: ModelConfig, tensors: dict, settings: Settings = DEFAULT):
        super().__init__()
        self.config = config
        self.settings = settings
        self.token_embd = tensors["token_embd.weight"]
        self.output = tensors["token_embd.weight" if config.tied_embeddings else "output.weight"]
        self.output_norm = vector(tensors["output_norm.weight"])
        self.layers = [Block(config, i, tensors, settings) for i in range(config.layers)]
        if config.embed_norm:
            self.unit_norm = mx.ones((config.hidden,))  # the embedding's norm has no weight
        self.general = GeneralPieces(config)
        self.gpu_step = GPUDecodeStep(self)  # generate()'s one-token step on a GPU
        self.cpu_step = CPUDecodeStep(self, rounded=settings.cpu_rounded)  # generate()'s on the CPU
        self.cpu_prompt_step = CPUDecodeStep(self, rounded=False)  # the prompt's last token's
        # The small arrays made here (norm weights, biases) are evaluated now: a lazy array
        # belongs to the stream of the thread that made it, and a model may step in another.
        mx.eval(self.parameters())

    @property
    def next_norms(self) -> list:
        """The norm after each layer: the next layer's attn_norm (None where layers have no
        pre-norm: the seam's h is then the stream itself), output_norm after the last."""
        return [layer.attn_norm for layer in self.layers[1:]] + [self.output_norm]

    def make_cache(self, dtype=None) -> list:
        """One cache per layer. dtype: float16 where the fused decode step runs (`fused`: a
        GPU), else float32."""
        c = self.config
        dtype = dtype or (mx.float16 if self.fused else mx.float32)
        return [SlidingWindowCache(c.sliding_window, dtype) if sliding else KVCache(dtype)
                for sliding in c.swa_layers]

    @property
    def fused(self) -> bool:
        """Whether one-token steps run the fused decode step (`decode_step`): on a GPU, for a
        model whose kernels exist (every product's format has a q8x kernel, head_dim a
        multiple of 64, hidden a multiple of 32)."""
        return kernels.backend() != "cpu" and self.decodes_fused()

    def decodes_fused(self) -> bool:
        """Whether this model has the fused step's kernels (on any device), decided at load."""
        return self.gpu_step.available

    def decode_step(self, token: mx.array, cache: list):
        """One token through the fused decode step (gpu_decode.GPUDecodeStep): token int32 [1, 1]
        in range (may be lazy), cache from make_cache(mx.float16). Returns (logits [1, 1, vocab]
        float32, the greedy token int32 [1])."""
        return self.gpu_step(token, cache)

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
        c.check_context(cache[0].offset + ids.shape[1])
        x = self.embed(ids)
        h = x if self.layers[0].attn_norm is None else rms_norm(x, self.layers[0].attn_norm, c.eps)
        # A GPU prefill chunk decodes each weight to float16 for the matmul (~1 GB a Muse
        # Glimmer layer): its products are paced (ops.paced_products) so that few of those
        # temporaries are alive at once.
        paced = ids.shape[1] > ops.MATVEC_MAX_TOKENS and kernels.backend() != "cpu"
        with ops.paced_products(self.settings) if paced else contextlib.nullcontext():
            for i, (layer, layer_cache, next_norm) in enumerate(zip(self.layers, cache, self.next_norms)):
                x, h, _ = decoder_layer(self.general, i, layer, x, h, next_norm, layer_cache)
        return h

    def logits(self, hidden: mx.array, rounded: bool = False) -> mx.array:
        """[B, T, hidden] -> float32 [B, T, vocab]: LM head, logit scale, softcap (rounded: the
        head's input rounded to int8, as ops.linear's)."""
        c = self.config
        logits = ops.linear(hidden, self.output, rounded=rounded)
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
                        found += child.stacks
        return found + [self.output]

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matrix once, one embedding row
        (an untied head reads the whole output table; a tied one reads token_embd whole)."""
        return sum(m.nbytes for m in self.matrices()) + self.token_embd.row_bytes
