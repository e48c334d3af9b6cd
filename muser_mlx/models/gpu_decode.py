"""The GPU's one-token decode step: eight launches a layer, compiled once per cache shape.

A layer (layers.decoder_layer) here is: the q/k/v(/gate) products (one launch per two
stacked weights, kernel product), kernel attention_decode with its combine (the per-head norm,
RoPE, the cache write in place, split attention, the gate, x quantized for the next product),
the o-projection, the seam (kernel residual_norm_quant: post-norm, residual add, next norm and
x's int8 blocks in one launch), the gate/up product with the activation and quantization in
its epilogue (product_glu), ffn_down, the seam again. The LM head carries logit scale, softcap
and the greedy argmax's first pass in its epilogue. Every launch's arguments are fixed here,
at load, from the model's Settings.

Products take x as int8 blocks (q8x: a scale per 32 values), converted once per input and
shared by every product of it: logits stay within the bound tests/test_decode_kernels.py
derives, and greedy tokens match the general step's.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from muser_mlx import kernels, ops
from muser_mlx.models.layers import decoder_layer


class GPUDecodeStep:
    """`model`'s fused one-token step. Built at load; `available` says whether the model has
    its kernels (every product's format has a q8x kernel, head_dim a multiple of 64, hidden a
    multiple of 32): on any device, so that the CPU renderings of the same launches can be
    tested without a GPU."""

    def __init__(self, model, compiled: bool | None = None):
        """compiled: trace the step with mx.compile on a GPU (None: the settings' compile_decode)."""
        self.model = model
        c, settings = model.config, model.settings
        self.compiled = settings.compile_decode if compiled is None else compiled
        self._compiled = {}  # thread id -> the traced graph (it runs on the tracing thread's streams)
        self._next_position = {}  # id(cache[0]) -> (offset, the position array the last step computed)
        self.layers = None
        if c.head_dim % 64 or c.hidden % 32:
            return
        try:
            self.layers = [self._launches(block, settings) for block in model.layers]
            self.head = ops.Product(model.output, head=(c.logit_scale, c.softcap or 0.0), settings=settings)
        except ops.NoProductKernelError:
            self.layers = None

    @staticmethod
    def _launches(block, settings) -> dict:
        """One layer's products, their arguments fixed: the input projections two stacks a
        launch, the o-projection (its x written woven by attention_combine), gate/up, down."""
        stacks = block.attention.input_proj.stacks
        feed_forward = block.feed_forward
        return dict(
            inputs=[ops.Product(*stacks[i : i + 2], settings=settings) for i in range(0, len(stacks), 2)],
            output=ops.Product(block.attention.o_proj.weight_tensor, woven=True, settings=settings),
            gate_up=ops.GatedProduct(feed_forward.gate, feed_forward.up, feed_forward.activation_name,
                                     settings=settings),
            down=ops.Product(feed_forward.down_proj.weight_tensor, settings=settings))

    @property
    def available(self) -> bool:
        return self.layers is not None

    def __call__(self, token: mx.array, cache: list):
        """token: int32 [1, 1], which may be lazy (sampled from this model's logits, so in range:
        no host check). cache: from model.make_cache(mx.float16). Returns (logits [1, 1, vocab]
        float32, the greedy token int32 [1])."""
        c = self.model.config
        if not self.available:
            raise ValueError(f"this {c.architecture} model has no fused decode step (a format without a q8x "
                             f"kernel, or head_dim {c.head_dim} not a multiple of 64)")
        position = cache[0].offset
        c.check_context(position + 1)
        if len(cache) != c.layers or any(layer_cache.dtype != mx.float16 for layer_cache in cache):
            raise ValueError("the fused decode step needs this model's caches in float16: make_cache(mx.float16)")
        for layer_cache in cache:
            layer_cache.reserve(1, c.kv_heads, c.head_dim, position + 1)
        graph = self._graph
        if kernels.backend() != "cpu" and self.compiled:
            thread = threading.get_ident()
            if thread not in self._compiled:
                self._compiled[thread] = mx.compile(self._graph)
            graph = self._compiled[thread]
        # The position as a device array: the last step's graph computed it, so the host writes
        # none (a host-written array moves its managed page to the host, and the step's first
        # kernel to touch that page waits for it: kernels.MIN_ARRAY_VALUES); the host makes one
        # when there is none for this offset (the first step, a trimmed cache).
        made = self._next_position.get(id(cache[0]))
        if made is not None and made[0] == position:
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

    def retrace(self) -> None:
        """Forget the traced graphs (a bench that changed what the trace reads)."""
        self._compiled = {}

    def _graph(self, token: mx.array, position: mx.array, after: mx.array, keys: list, values: list):
        """The step as a function of arrays alone (so that mx.compile can trace it): token int32
        [1, 1], position int32 [1] (or padded), the array the cache writes must follow, every
        layer's cache arrays. On a GPU the caches are written in place and returned as given; on
        the CPU new arrays are returned. The last output is the next step's position."""
        model, c = self.model, self.model.config
        x = ops.embedding_unchecked(model.token_embd.data, token, model.token_embd.ggml_type,
                                    c.hidden, c.vocab).reshape(1, c.hidden)
        x, h = ops.residual_norm_quant(None, x, model.unit_norm if c.embed_norm else None,
                                       model.layers[0].attn_norm, c.eps, c.eps, c.embed_scale)
        keys, values = list(keys), list(values)
        for i, (block, next_norm) in enumerate(zip(model.layers, model.next_norms)):
            x, h, (keys[i], values[i], _, _) = decoder_layer(self, i, block, x, h, next_norm,
                                                             (keys[i], values[i], position, after))
        logits, best = self.head(h)
        return logits.reshape(1, 1, c.vocab), ops.greedy(best), keys, values, position + 1

    # -- layers.LayerPieces --

    def attention(self, index: int, block, h, state):
        """h as q8x [1, hidden] -> (the o-projection's output [1, hidden] float32, state), in
        three launches: the projections, attention_decode with its combine, the o-projection."""
        c, launches = self.model.config, self.layers[index]
        keys, values, position, after = state
        pieces = [launch(h) for launch in launches["inputs"]]
        y = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
        attention = block.attention
        offsets = attention.input_proj.offsets
        o, keys, values = ops.attention_decode(
            y, keys, values, position, after, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
            offsets=(offsets["q"], offsets["k"], offsets["v"]), gate=offsets.get("gate"),
            q_weight=attention.q_norm if c.qk_norm else None, k_weight=attention.k_norm if c.qk_norm else None,
            bias=attention.qkv_bias if c.qkv_bias else None, rope=c.rope(index), eps=c.eps,
            scale=c.attention_scale, woven=launches["output"].x_woven, qk_norm_whole=c.qk_norm_whole,
            softcap=c.attn_softcap,
            splits=self.model.settings.attention_splits, head_group=self.model.settings.attention_head_group)
        return launches["output"](o), (keys, values, position, after)

    def seam(self, x, branch, branch_weight, next_weight):
        c = self.model.config
        return ops.residual_norm_quant(x, branch, branch_weight, next_weight, c.post_eps, c.eps)

    def feed_forward(self, index: int, block, h):
        """h as q8x [1, hidden] -> [1, hidden] float32: gate/up with the activation and the q8x
        epilogue, then down."""
        launches = self.layers[index]
        return launches["down"](launches["gate_up"](h))
