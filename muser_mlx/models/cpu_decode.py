"""The CPU's one-token decode step, as one compiled graph (generate()'s loop on the CPU).

The general step (`Transformer.__call__`) serves any number of tokens: its Python builds ~20
MLX ops a layer every step (5-6 ms for SmolLM2's 30 layers) and MLX's CPU runs each op alone
(3-30 us each). Here the same layers are written as a function of arrays alone (the token,
its position, every layer's cache arrays), so `mx.compile` traces it once per thread and
cache shape, and a layer is one graph node (cpu_ext.decode_layer, LAYER_PRIMITIVE) where
every product of the layer has a compiled format, else about ten: its products, the two
residual seams (cpu_ext.residual_norm) and attention's three (cpu_ext.attention_decode: the key
and value written into the cache at the position *array*, in the cache's own memory, then
attention over the slots written so far). The one node calls the ten's functions in their
order, so the two give the same logits; it saves MLX's cost per node and keeps the products'
thread pool awake between a layer's phases (SmolLM2 7.85 against 9.10 ms a step, RESULTS.md
session 36).

`rounded` (ROUNDED for generate()): every product's input is rounded to int8 inside the
compiled product, which then multiplies with integer dot products, as llama.cpp's CPU products
do: blocks of 32 values with one scale for the 32-value formats (q8_0,
formats.quantize_activations), of 256 for the K-quants (q8_K,
formats.quantize_activations_super: a super-block then sums in integers). Each value is off by
at most max|x| / 254 of its block: ~0.5-0.7 % of each product's output for normal activations,
0.5-3.6 % of the logits of the tiny test models (README "The CPU decode step",
tests/test_cpu_decode.py). `model(...)` keeps the exact products.

The caches may be float32 or float16 (`generation_cache`: generate()'s, where the compiler has
_Float16): a key or value is rounded to float16 as it is written and widened to float32 as
attention reads it, so a long context's attention reads half the bytes (llama.cpp's default
cache type; a GPU's caches are float16 too).
"""

from __future__ import annotations

import threading

import mlx.core as mx

from muser_mlx import cpu_ext, kernels, ops

# generate()'s CPU steps round every product's input to int8 (module docstring): faster
# products (bench/RESULTS.md, issue 13, sessions 8 and 9).
ROUNDED = True
# A layer as one graph node (cpu_ext.decode_layer: its phases back to back in one primitive) where
# every product of the layer has a compiled CPU format; False: the ~10 nodes of `_layer_nodes`
# (the same functions in the same order: the same values, bit for bit), for A/B benchmarks.
LAYER_PRIMITIVE = True
# generate()'s caches on the CPU, where this step serves: float16 (module docstring), or
# float32 (as make_cache() on the CPU: the exact keys and values of the study path).
GENERATION_CACHE_DTYPE = mx.float16


class CPUDecodeStep:
    """generate()'s one-token step of `model` on the CPU: compiled once per thread (a traced
    graph runs on the streams of the thread that traced it) and per cache shape (mx.compile
    retraces when the caches grow)."""

    def __init__(self, model, rounded: bool, layer_primitive: bool | None = None):
        """layer_primitive: one node a layer where it can (None: LAYER_PRIMITIVE)."""
        self.model = model
        self.rounded = rounded
        self.layer_primitive = LAYER_PRIMITIVE if layer_primitive is None else layer_primitive
        self._compiled = {}  # thread id -> compiled graph

    def __call__(self, token: mx.array, cache: list) -> mx.array:
        """token: int32 [1, 1], in range (may be lazy); cache: model.make_cache() (float32) or
        generation_cache(model) (float16).
        Returns float32 logits [vocab]; the caches hold the token afterwards."""
        c = self.model.config
        position = cache[0].offset
        if position + 1 > c.context:
            raise ValueError(f"{position + 1} positions exceed the model's context of {c.context} tokens")
        if len(cache) != c.layers:
            raise ValueError(f"cache has {len(cache)} layers; the model has {c.layers}")
        for layer_cache in cache:
            layer_cache.reserve(1, c.kv_heads, c.head_dim, position + 1)
        thread = threading.get_ident()
        if thread not in self._compiled:
            self._compiled[thread] = mx.compile(self._graph)
        logits, keys, values = self._compiled[thread](
            token.reshape(1, 1).astype(mx.int32), mx.array([position], dtype=mx.int32),
            [layer_cache.keys for layer_cache in cache], [layer_cache.values for layer_cache in cache])
        for layer_cache, layer_keys, layer_values in zip(cache, keys, values):
            layer_cache.keys, layer_cache.values = layer_keys, layer_values
            layer_cache.advance(1)
        return logits

    def _graph(self, token: mx.array, position: mx.array, keys: list, values: list):
        """token int32 [1, 1], position int32 [1], each layer's keys/values [1, kv_heads,
        capacity, head_dim] -> (logits [vocab], new keys, new values)."""
        model, c = self.model, self.model.config
        x = model.embed(token).reshape(1, c.hidden)
        x, h = cpu_ext.residual_norm(None, x, None, model.layers[0].attn_norm, c.eps, c.eps)
        next_norms = [layer.attn_norm for layer in model.layers[1:]] + [model.output_norm]
        keys, values = list(keys), list(values)
        for i, (layer, next_norm) in enumerate(zip(model.layers, next_norms)):
            x, h, keys[i], values[i] = self._layer(layer, x, h, position, keys[i], values[i], next_norm)
        logits = self._linear(h, model.output)
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.softcap is not None:
            logits = c.softcap * mx.tanh(logits / c.softcap)
        return logits.reshape(c.vocab), keys, values

    def _linear(self, x: mx.array, weight) -> mx.array:
        return ops.linear(x, weight, rounded=self.rounded)

    def _layer(self, block, x, h, position, keys, values, next_norm):
        """Block.__call__ for one token at `position` (array): x, h [1, hidden] -> (x, h, keys,
        values), as one node where every product has a compiled format, else as several."""
        attention_in, attention_out, ffn_in, ffn_out = self._layer_weights(block)
        weights = [*attention_in, attention_out, *ffn_in, ffn_out]
        if self.layer_primitive and all(w.ggml_type in cpu_ext.FORMATS for w in weights):
            return self._layer_node(block, x, h, position, keys, values, next_norm)
        return self._layer_nodes(block, x, h, position, keys, values, next_norm)

    @staticmethod
    def _layer_weights(block) -> tuple:
        """The layer's product weights: (the attention's input groups, its output, the
        feed-forward's input groups, its output)."""
        attention, feed_forward = block.attention, block.feed_forward
        return ([stacked for stacked, _, _ in attention.input_proj.groups], attention.o_proj.weight_tensor,
                [stacked for stacked, _, _ in feed_forward.input_proj.groups], feed_forward.down_proj.weight_tensor)

    def _attention_settings(self, attention) -> dict:
        """attention_decode's keyword arguments for `attention` (shapes, offsets, rope, ...)."""
        c = self.model.config
        rope = None
        if attention.rotates:
            rope = dict(dims=c.rotary_dim, traditional=c.rope_traditional, base=attention.rope_base)
        offsets = attention.input_proj.offsets
        return dict(heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                    offsets=(offsets["q"], offsets["k"], offsets["v"]), gate=offsets.get("gate"),
                    bias=attention.qkv_bias if c.qkv_bias else None, rope=rope, eps=c.eps,
                    scale=c.attention_scale)

    def _layer_node(self, block, x, h, position, keys, values, next_norm):
        """The layer as one node (cpu_ext.decode_layer)."""
        c = self.model.config
        sandwich = c.sandwich_norms
        attention, feed_forward = block.attention, block.feed_forward
        norms = {"ffn": block.ffn_norm, "next": next_norm}
        if c.qk_norm:
            norms.update(q=attention.q_norm, k=attention.k_norm)
        if sandwich:
            norms.update(post_attention=block.post_attention_norm, post_ffw=block.post_ffw_norm)
        attention_in, attention_out, ffn_in, ffn_out = self._layer_weights(block)

        def product(w):
            return w.data, w.ggml_type

        return cpu_ext.decode_layer(
            x, h, keys, values, position, attention_in=[product(w) for w in attention_in],
            attention_out=product(attention_out), ffn_in=[product(w) for w in ffn_in],
            ffn_out=product(ffn_out), norms=norms,
            post_eps=c.eps if c.post_norm_eps is None else c.post_norm_eps,
            activation=feed_forward.activation_name, rounded=self.rounded,
            **self._attention_settings(attention))

    def _layer_nodes(self, block, x, h, position, keys, values, next_norm):
        """The layer as seven graph nodes and the products."""
        c = self.model.config
        post_eps = c.eps if c.post_norm_eps is None else c.post_norm_eps
        sandwich = c.sandwich_norms
        attention = block.attention
        projections = attention.input_proj
        y = mx.concatenate([self._linear(h, stacked) for stacked, _, _ in projections.groups], axis=-1) \
            if len(projections.groups) > 1 else self._linear(h, projections.groups[0][0])
        o, keys, values = cpu_ext.attention_decode(
            y, keys, values, position, q_norm=attention.q_norm if c.qk_norm else None,
            k_norm=attention.k_norm if c.qk_norm else None, **self._attention_settings(attention))
        a = self._linear(o, attention.o_proj.weight_tensor)
        x, h = cpu_ext.residual_norm(x, a, block.post_attention_norm if sandwich else None,
                                     block.ffn_norm, post_eps, c.eps)
        feed_forward = block.feed_forward
        gate_up = feed_forward.input_proj
        if len(gate_up.groups) == 1:
            gate, up = mx.split(self._linear(h, gate_up.groups[0][0]), 2, axis=-1)
        else:
            gate, up = (self._linear(h, stacked) for stacked, _, _ in gate_up.groups)
        f = self._linear(cpu_ext.gated_activation(gate, up, feed_forward.activation_name),
                         feed_forward.down_proj.weight_tensor)
        x, h = cpu_ext.residual_norm(x, f, block.post_ffw_norm if sandwich else None, next_norm,
                                     post_eps, c.eps)
        return x, h, keys, values


def generation_cache(model) -> list:
    """A new cache for generation: float16 where this step serves and the extension takes
    float16 caches (GENERATION_CACHE_DTYPE); elsewhere make_cache()'s own dtype."""
    if serves(model) and cpu_ext.half_cache():
        return model.make_cache(GENERATION_CACHE_DTYPE)
    return model.make_cache()


def rounds(model) -> bool:
    """Whether generate()'s one-token steps of `model` round their products' inputs here."""
    return serves(model) and model.cpu_step.rounded


def serves(model) -> bool:
    """Whether generate()'s one-token steps of `model` run CPUDecodeStep: on the CPU, with
    the extension available and head_dim a multiple of 16 (its attention's vectors)."""
    return kernels.backend() == "cpu" and cpu_ext.available() and model.config.head_dim % 16 == 0
