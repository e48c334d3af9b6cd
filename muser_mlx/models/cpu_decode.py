"""The CPU's one-token decode step, as one compiled graph (generate()'s loop on the CPU).

The general step (`Transformer.__call__`) serves any number of tokens: its Python builds ~20
MLX ops a layer every step (5-6 ms for SmolLM2's 30 layers) and MLX's CPU runs each op alone
(3-30 us each). Here the same layers are written as a function of arrays alone (the token,
its position, every layer's cache arrays), so `mx.compile` traces it once per thread and
cache shape, and a layer is one graph node (cpu_ext.decode_layer) where every product of the
layer has a compiled format, else about ten (layers.decoder_layer with this step's pieces):
its products, the two residual seams (cpu_ext.residual_norm) and attention's three
(cpu_ext.attention_decode: the key and value written into the cache at the position *array*,
in the cache's own memory, then attention over the slots written so far). The one node calls
the ten's functions in their order, so the two give the same logits; it saves MLX's cost per
node and keeps the products' thread pool awake between a layer's phases (SmolLM2 7.85 against
9.10 ms a step).

`rounded` (Settings.cpu_rounded for generate()): every product's input is rounded to int8 inside the
compiled product, which then multiplies with integer dot products, as llama.cpp's CPU products
do: blocks of 32 values with one scale for the 32-value formats (q8_0,
formats.quantize_activations), of 256 for the K-quants (q8_K,
formats.quantize_activations_super: a super-block then sums in integers). Each value is off by
at most max|x| / 254 of its block: ~0.5-0.7 % of each product's output for normal activations,
0.5-3.6 % of the logits of the tiny test models (README "The CPU decode step",
tests/test_cpu_decode.py). `model(...)` keeps the exact products.

Where a layer is one node, it writes each token's keys and values into the caches' own memory
(cpu_ext's in_place), as the GPU's fused step does: generate()'s loop builds the next step while
the last runs, MLX holds the last step's buffers until it has run, and a write that waited for MLX
to hand the memory over copied every cache the last step had not reached yet (SmolLM2 at 3,000
positions: 16.2 ms a step, 10.7 in place). So an array taken from a cache before a step sees that
step's write; the cache objects are the step's to extend (the store of a batch, BatchKV,
likewise). The separate nodes write as MLX hands them the memory: there the next step's write is
not ordered after this step's attention (another node), which a ring's oldest slot needs when
several steps are evaluated at once.

The caches may be float32 or float16 (`generation_cache`: generate()'s, float16 where the
compiler has _Float16): a key or value is rounded to float16 as it is written and widened to float32 as
attention reads it, so a long context's attention reads half the bytes (llama.cpp's default
cache type; a GPU's caches are float16 too).
"""

from __future__ import annotations

import threading

import mlx.core as mx

from muser_mlx import cpu_ext, kernels, ops
from muser_mlx.models.layers import decoder_layer


class CPUDecodeStep:
    """generate()'s one-token step of `model` on the CPU: compiled once per thread (a traced
    graph runs on the streams of the thread that traced it) and per cache shape (mx.compile
    retraces when the caches grow)."""

    def __init__(self, model, rounded: bool, layer_primitive: bool = True):
        """layer_primitive: one node a layer where every product has a compiled format (False:
        the separate nodes, which give the same values bit for bit: a test compares them)."""
        self.model = model
        self.rounded = rounded
        self.layer_primitive = layer_primitive
        self._compiled = {}  # thread id -> compiled graph

    def __call__(self, token: mx.array, cache: list) -> mx.array:
        """token: int32 [1, 1], in range (may be lazy); cache: model.make_cache() (float32) or
        generation_cache(model) (float16).
        Returns float32 logits [vocab]; the caches hold the token afterwards."""
        c = self.model.config
        position = cache[0].offset
        c.check_context(position + 1)
        if len(cache) != c.layers:
            raise ValueError(f"cache has {len(cache)} layers; the model has {c.layers}")
        for layer_cache in cache:
            layer_cache.reserve(1, c.kv_heads, c.head_dim, position + 1)
        logits, keys, values = self._traced()(
            token.reshape(1).astype(mx.int32), mx.array([position], dtype=mx.int32),
            [layer_cache.keys for layer_cache in cache], [layer_cache.values for layer_cache in cache])
        for layer_cache, layer_keys, layer_values in zip(cache, keys, values):
            layer_cache.keys, layer_cache.values = layer_keys, layer_values
            layer_cache.advance(1)
        return logits.reshape(c.vocab)

    @property
    def takes_rows(self) -> bool:
        """Whether rows() serves this model: every layer one node (each product's format
        compiled, the activation SiLU or GELU's tanh form)."""
        return all(self._one_node(block) for block in self.model.layers)

    def rows(self, tokens: mx.array, positions: mx.array, keys: list, values: list):
        """A batched step's B rows (models/batch_decode.py), compiled as the one-token step
        (once per thread and shape): tokens int32 [B] (in range, may be lazy), positions int32
        [B], each layer's keys and values [at least B, kv_heads, capacity, head_dim], row b the
        cache of row b. Returns (logits float32 [B, vocab], each layer's keys, values), row b's
        token written at slot positions[b] % capacity in the arrays' own memory (a store that no
        one else reads: cpu_ext.decode_layer's in_place). Needs takes_rows."""
        return self._traced()(tokens.astype(mx.int32), positions, list(keys), list(values))

    def _traced(self):
        """This thread's compiled _graph (a traced graph runs on the streams of the thread
        that traced it; mx.compile retraces for new shapes: B, the caches' capacity)."""
        thread = threading.get_ident()
        if thread not in self._compiled:
            self._compiled[thread] = mx.compile(self._graph)
        return self._compiled[thread]

    def _graph(self, tokens: mx.array, positions: mx.array, keys: list, values: list):
        """tokens int32 [B], positions int32 [B], each layer's keys/values [at least B,
        kv_heads, capacity, head_dim] -> (logits [B, vocab], new keys, new values)."""
        model, c = self.model, self.model.config
        batch = tokens.shape[0]
        x = model.embed(tokens.reshape(batch, 1)).reshape(batch, c.hidden)
        x, h = cpu_ext.residual_norm(None, x, None, model.layers[0].attn_norm, c.eps, c.eps)
        keys, values = list(keys), list(values)
        for i, (block, next_norm) in enumerate(zip(model.layers, model.next_norms)):
            x, h, keys[i], values[i] = self._layer(i, block, x, h, positions, keys[i], values[i], next_norm)
        return model.logits(h, rounded=self.rounded), keys, values

    def _linear(self, x: mx.array, weight) -> mx.array:
        return ops.linear(x, weight, rounded=self.rounded)

    def _one_node(self, block) -> bool:
        """Whether `block` runs as one node: every product's format compiled, the activation
        SiLU or GELU's tanh form."""
        attention_in, attention_out, ffn_in, ffn_out = self._layer_weights(block)
        return self.layer_primitive and block.feed_forward.activation_name in ("silu", "gelu_tanh") \
            and all(w.ggml_type in cpu_ext.FORMATS for w in [*attention_in, attention_out, *ffn_in, ffn_out])

    def _layer(self, index, block, x, h, position, keys, values, next_norm):
        """Layer `index` for one token a row at `position` (array [B]): x, h [B, hidden] -> (x,
        h, keys, values), as one node where _one_node says so, else as several."""
        if self._one_node(block):
            return self._layer_node(index, block, x, h, position, keys, values, next_norm, in_place=True)
        x, h, (keys, values, _) = decoder_layer(self, index, block, x, h, next_norm, (keys, values, position))
        return x, h, keys, values

    @staticmethod
    def _layer_weights(block) -> tuple:
        """The layer's product weights: (the attention's input groups, its output, the
        feed-forward's input groups, its output)."""
        attention, feed_forward = block.attention, block.feed_forward
        return (attention.input_proj.stacks, attention.o_proj.weight_tensor,
                feed_forward.input_proj.stacks, feed_forward.down_proj.weight_tensor)

    def _attention_settings(self, index: int, attention) -> dict:
        """attention_decode's keyword arguments for layer `index`'s attention (shapes, offsets, rope, ...)."""
        c = self.model.config
        offsets = attention.input_proj.offsets
        return dict(heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                    offsets=(offsets["q"], offsets["k"], offsets["v"]), gate=offsets.get("gate"),
                    bias=attention.qkv_bias if c.qkv_bias else None, rope=c.rope(index), eps=c.eps,
                    scale=c.attention_scale, qk_norm_whole=c.qk_norm_whole, softcap=c.attn_softcap)

    def _layer_node(self, index, block, x, h, position, keys, values, next_norm, in_place: bool = False):
        """The layer as one node (cpu_ext.decode_layer; in_place: the caches are a store no one
        else reads, written in their memory even while a step in flight holds them)."""
        c = self.model.config
        attention, feed_forward = block.attention, block.feed_forward
        norms = {name: norm for name, norm in (("ffn", block.ffn_norm), ("next", next_norm)) if norm is not None}
        if c.qk_norm:
            norms.update(q=attention.q_norm, k=attention.k_norm)
        if c.sandwich_norms:
            norms.update(post_attention=block.post_attention_norm, post_ffw=block.post_ffw_norm)
        attention_in, attention_out, ffn_in, ffn_out = self._layer_weights(block)

        def product(w):
            return w.data, w.ggml_type

        return cpu_ext.decode_layer(
            x, h, keys, values, position, attention_in=[product(w) for w in attention_in],
            attention_out=product(attention_out), ffn_in=[product(w) for w in ffn_in],
            ffn_out=product(ffn_out), norms=norms, post_eps=c.post_eps,
            activation=feed_forward.activation_name, rounded=self.rounded, in_place=in_place,
            **self._attention_settings(index, attention))

    # -- layers.LayerPieces: the separate nodes --

    def attention(self, index: int, block, h, state):
        """h [1, hidden] -> (the o-projection's output [1, hidden], (keys, values, position))."""
        c = self.model.config
        keys, values, position = state
        attention = block.attention
        stacks = attention.input_proj.stacks
        y = mx.concatenate([self._linear(h, w) for w in stacks], axis=-1) if len(stacks) > 1 \
            else self._linear(h, stacks[0])
        o, keys, values = cpu_ext.attention_decode(
            y, keys, values, position, q_norm=attention.q_norm if c.qk_norm else None,
            k_norm=attention.k_norm if c.qk_norm else None, **self._attention_settings(index, attention))
        return self._linear(o, attention.o_proj.weight_tensor), (keys, values, position)

    def seam(self, x, branch, branch_weight, next_weight):
        c = self.model.config
        return cpu_ext.residual_norm(x, branch, branch_weight, next_weight, c.post_eps, c.eps)

    def feed_forward(self, index: int, block, h):
        feed_forward = block.feed_forward
        stacks = feed_forward.input_proj.stacks
        if len(stacks) == 1:
            gate, up = mx.split(self._linear(h, stacks[0]), 2, axis=-1)
        else:
            gate, up = (self._linear(h, w) for w in stacks)
        return self._linear(cpu_ext.gated_activation(gate, up, feed_forward.activation_name),
                            feed_forward.down_proj.weight_tensor)


def generation_cache(model) -> list:
    """A new cache for generation: float16 where this step serves and the extension takes
    float16 caches; elsewhere make_cache()'s own dtype."""
    if serves(model) and cpu_ext.half_cache():
        return model.make_cache(mx.float16)
    return model.make_cache()


def rounds(model) -> bool:
    """Whether generate()'s one-token steps of `model` round their products' inputs here."""
    return serves(model) and model.cpu_step.rounded


def serves(model) -> bool:
    """Whether generate()'s one-token steps of `model` run CPUDecodeStep: on the CPU, with
    the extension available and head_dim a multiple of 16 (its attention's vectors)."""
    return kernels.backend() == "cpu" and cpu_ext.available() and model.config.head_dim % 16 == 0
