"""The batched decode step: one token for each of B sequences, every weight read once for all B.

Sequences of a batch share a slotted KV store per layer (`BatchKV`: [rows, kv_heads, capacity,
head_dim], row i the i-th sequence of the batch, position p at slot p, or p % window in a
sliding-window layer: the layout of cache.KVCache / SlidingWindowCache, so a sequence's own cache
is copied in when it joins and out when it leaves). Each row has its own length; a step's
attention sees, for each row, its slots 0 .. min(length, window) - 1 (one mask per step and
layer kind, [B, 1, 1, S]).

A layer is layers.decoder_layer with this step's pieces:
- on a GPU with the fused step's kernels (`q8x`): x as int8 blocks (ops.residual_norm_quant) and
  the fused step's products in their grouped form (kernels product / product_glu GROUPED, 8 rows
  a threadgroup) below Settings.batch_tiles_from sequences, tile products from there on
  (ops.TileProduct, kernel product_tiles: int8 matrix products of 16-row weight tiles and up to
  64 rows of x staged in threadgroup memory, f16 ones of their values from
  Settings.tile_half_from rows on, on tensor cores on NVIDIA GPUs). Either way the
  launch count per layer does not depend on B; the rows are padded to a multiple of 8.
- elsewhere (the CPU): ops.linear on [B, 1, hidden] rows (the compiled CPU products, rounded
  inputs as generate()'s CPU steps: Settings.cpu_rounded) and the general step's seams.
In the GPU form a layer's attention is the fused step's two kernels over the batch's rows
(ops.attention_decode with rows: each row's q/k norms, RoPE at its own position, its key and
value written into its store row in place, attention over its own slots), so the store is
written in place and MLX ops that touch it wait for the last step first (BatchKV.finish_writes).
Elsewhere attention, the q/k norms and RoPE (per-row positions) are MLX ops over the store; on
the CPU the attention runs per row over its own keys (the compiled primitive takes no batch
mask).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from muser_mlx import cpu_ext, kernels, ops
from muser_mlx.cache import STEP, KVCache, SlidingWindowCache, finish_fused_writes
from muser_mlx.models import cpu_decode
from muser_mlx.models.layers import decoder_layer, rms_norm

GROUP = 8  # rows a threadgroup of a grouped product takes (kernel product's TOKENS)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class BatchKV:
    """The KV store of a batch: per layer keys and values [row capacity, kv_heads, capacity,
    head_dim] in `dtype`; `lengths[i]` the positions row i holds (the position of its next
    token). Rows are kept dense: removing row i moves the last row into it."""

    def __init__(self, model, dtype):
        c = model.config
        self.kv_heads, self.head_dim, self.dtype = c.kv_heads, c.head_dim, dtype
        self.windows = [c.sliding_window if sliding else None for sliding in c.swa_layers]
        self.keys = [None] * c.layers
        self.values = [None] * c.layers
        self.lengths: list[int] = []
        # An output of the last GPU step, whose kernels wrote the store in place (MLX sees no
        # such write): the next step's attention launches take it as an input, and MLX ops
        # that read or write the store wait for it first (finish_writes).
        self.written_by = None

    def finish_writes(self) -> None:
        """Wait for the step that last wrote the store in place before MLX ops read or write it."""
        if self.written_by is not None:
            mx.eval(self.written_by)
            self.written_by = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def _capacity(self, window, end: int) -> int:
        capacity = _round_up(max(end, 1), STEP)
        return capacity if window is None else min(window, capacity)

    def reserve(self, rows: int, end: int) -> None:
        """Room for `rows` rows (whole powers of two) and positions up to end - 1 in each."""
        for i, window in enumerate(self.windows):
            have = self.keys[i]
            need_rows = 1 << max(rows - 1, 0).bit_length()
            capacity = self._capacity(window, end)
            if have is not None and have.shape[0] >= rows and have.shape[2] >= capacity:
                continue
            self.finish_writes()  # the copy below reads what the last step may still be writing
            shape = (max(need_rows, have.shape[0] if have is not None else 0), self.kv_heads,
                     max(capacity, have.shape[2] if have is not None else 0), self.head_dim)
            for store in (self.keys, self.values):
                grown = mx.zeros(shape, dtype=self.dtype)
                if store[i] is not None:
                    old = store[i]
                    grown[: old.shape[0], :, : old.shape[2]] = old
                store[i] = grown

    def add(self, cache: list) -> int:
        """Copy a sequence's own cache (model.make_cache()'s layers) in as a new last row;
        returns the row."""
        length = cache[0].offset
        row = self.rows
        self.reserve(row + 1, length + 1)
        self.finish_writes()
        for i, layer_cache in enumerate(cache):
            finish_fused_writes(layer_cache)
            if layer_cache.offset != length:
                raise ValueError(f"layer {i}'s cache holds {layer_cache.offset} positions, layer 0's {length}")
            if isinstance(layer_cache, SlidingWindowCache) and layer_cache.stale is not None:
                raise ValueError("a sliding-window cache stepped back after wrapping cannot join a batch")
            held = min(length, layer_cache.keys.shape[2]) if layer_cache.keys is not None else 0
            if held:
                self.keys[i][row, :, :held] = layer_cache.keys[0, :, :held].astype(self.dtype)
                self.values[i][row, :, :held] = layer_cache.values[0, :, :held].astype(self.dtype)
        self.lengths.append(length)
        return row

    def take(self, row: int) -> list:
        """Row `row` as a sequence's own cache (copies), as model.make_cache() makes them."""
        length = self.lengths[row]
        self.finish_writes()
        out = []
        for i, window in enumerate(self.windows):
            layer_cache = KVCache(self.dtype) if window is None else SlidingWindowCache(window, self.dtype)
            if length:
                held = self._capacity(window, length)
                layer_cache.keys = mx.contiguous(self.keys[i][row : row + 1, :, :held])
                layer_cache.values = mx.contiguous(self.values[i][row : row + 1, :, :held])
                layer_cache.advance(length)
            out.append(layer_cache)
        # Copied now: a lazy copy holds the whole store (every row, its full capacity) until it
        # runs, and a server's prompt cache keeps finished caches for long (16 kept caches
        # counted 100 MB and held 816).
        mx.eval([a for layer_cache in out for a in (layer_cache.keys, layer_cache.values) if a is not None])
        return out

    def remove(self, row: int) -> None:
        """Drop row `row`; the last row moves into its place."""
        last = self.rows - 1
        self.finish_writes()
        if row != last:
            for store in (self.keys, self.values):
                for i, array in enumerate(store):
                    array[row] = array[last]
        self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        if not self.lengths:  # nothing running: the memory goes
            self.keys = [None] * len(self.windows)
            self.values = [None] * len(self.windows)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)


class BatchStep:
    """`model`'s batched decode step: tokens int32 [B] (may be lazy; in range) and a BatchKV
    with B rows -> float32 logits [B, vocab]; the rows' lengths advance by one."""

    def __init__(self, model, q8x: bool | None = None, tiles: bool | None = None, launch_settings=None):
        """q8x: the GPU form (int8 x, tile or grouped products); None: where the fused step
        runs. tiles: its products as tile products (True) or grouped (False) at every B; None:
        tiles from Settings.batch_tiles_from sequences on. launch_settings: the Settings its
        products' launches and form are made from (default the model's; benchmarks compare
        launch shapes on one model with it: every weight shared)."""
        self.model = model
        self.launch_settings = model.settings if launch_settings is None else launch_settings
        self.q8x = model.fused if q8x is None else q8x
        self.tiles = tiles
        self._launches = {}
        self.rounded = cpu_decode.rounds(model)  # as generate()'s CPU steps
        # The CPU extension's decode attention, where generate()'s CPU step runs it: per-row
        # attention as MLX ops took ~28 of a SmolLM2 8-row step's 44 ms.
        self.compiled_attention = not self.q8x and cpu_decode.serves(model)
        # Where generate()'s CPU step makes a layer one node, the batched step's layers are that
        # node over B rows, compiled as that step (SmolLM2 8 rows: 16.7 ms against 19.8).
        self.layer_nodes = self.compiled_attention and model.cpu_step.takes_rows

    def attention_splits(self, padded: int) -> int:
        """The splits of a cache kernel attention_decode aims for in a step of `padded` rows
        (Settings.batch_attention_splits; 0: the model's attention_splits)."""
        aim = self.launch_settings.batch_attention_splits
        if not aim:
            return self.model.settings.attention_splits
        return max(1, min(128, aim // ops.TileProduct.tokens(padded)))

    def uses_tiles(self, batch: int) -> bool:
        """Whether a step of `batch` sequences runs tile products."""
        return self.tiles if self.tiles is not None else batch >= self.launch_settings.batch_tiles_from

    def launches(self, tiles: bool):
        """The products of every layer and the LM head, built on first use of each form: tile
        products (ops.TileProduct), or kernel product's and product_glu's grouped form."""
        if tiles not in self._launches:
            model, settings = self.model, self.launch_settings
            grouped = dict(tokens=GROUP, settings=settings, grouped=True)

            def product(weight, second=None):
                return (ops.TileProduct(weight, second, settings=settings) if tiles
                        else ops.Product(weight, second, **grouped))

            layers = []
            for block in model.layers:
                stacks = block.attention.input_proj.stacks
                ff = block.feed_forward
                layers.append(dict(
                    inputs=[product(*stacks[i : i + 2]) for i in range(0, len(stacks), 2)],
                    output=product(block.attention.o_proj.weight_tensor),
                    gate_up=(ops.GatedProduct(ff.gate, ff.up, ff.activation_name, **grouped) if not tiles
                             else ops.TileProduct(ff.gate, ff.up, ff.activation_name, settings=settings)),
                    down=product(ff.down_proj.weight_tensor)))
            self._launches[tiles] = (layers, product(model.output))
        return self._launches[tiles]

    @staticmethod
    def feed_forward(launches: dict, h, summed: bool = True):
        """A layer's gated FFN on q8x h [padded, hidden] with its launches: float32 [padded,
        hidden]. A tile product's gated half comes as q8x for the down projection (gated_q8x).
        summed False: a tile product's down projection as its chunks' partial sums [chunks,
        padded, hidden] (the seam adds them)."""
        if not isinstance(launches["gate_up"], ops.TileProduct):
            return launches["down"](launches["gate_up"](h))
        return launches["down"](launches["gate_up"].gated_q8x(h), summed=summed)

    def __call__(self, tokens: mx.array, kv: BatchKV) -> mx.array:
        model, c = self.model, self.model.config
        batch = kv.rows
        if tokens.shape != (batch,):
            raise ValueError(f"a batched step takes one token per row: {batch} rows, tokens {list(tokens.shape)}")
        if batch == 0:
            raise ValueError("a batched step needs at least one sequence")
        lengths = list(kv.lengths)
        c.check_context(max(lengths) + 1)
        kv.reserve(batch, max(lengths) + 1)
        self._step = _StepState(c, lengths, kv)
        if self.q8x:
            logits = self._q8x(tokens, kv, batch)
            if kernels.backend() != "cpu":  # the attention kernels wrote the store in place
                kv.written_by = logits
        elif self.layer_nodes:
            logits = self._layer_nodes(tokens, kv)
        else:
            with ops.rounded_products(self.rounded):
                x = model.embed(tokens.reshape(batch, 1).astype(mx.int32))
                first = model.layers[0].attn_norm
                h = x if first is None else rms_norm(x, first, c.eps)
                for i, (block, next_norm) in enumerate(zip(model.layers, model.next_norms)):
                    x, h, _ = decoder_layer(_FloatPieces(self), i, block, x, h, next_norm, kv)
                logits = model.logits(h)[:, 0]
        kv.lengths = [n + 1 for n in lengths]
        return logits

    def _layer_nodes(self, tokens, kv):
        """The CPU form as one node a layer (CPUDecodeStep.rows over the store's rows)."""
        keys, values = kv.keys, kv.values
        # The store's arrays are let go of before the step runs, so that its writes take their
        # buffers (MLX donates an input no one else holds) instead of copying the whole store.
        kv.keys, kv.values = [None] * len(keys), [None] * len(values)
        logits, kv.keys, kv.values = self.model.cpu_step.rows(tokens, self._step.positions, keys, values)
        return logits

    def _q8x(self, tokens, kv, batch):
        model, c = self.model, self.model.config
        layers, head = self.launches(self.uses_tiles(batch))
        padded = _round_up(batch, GROUP)
        ids = tokens.astype(mx.int32)
        if padded > batch:
            ids = mx.concatenate([ids, mx.zeros((padded - batch,), dtype=mx.int32)])
        x = ops.embedding_unchecked(model.token_embd.data, ids.reshape(padded, 1), model.token_embd.ggml_type,
                                    c.hidden, c.vocab).reshape(padded, c.hidden)
        x, h = ops.residual_norm_quant(None, x, model.unit_norm if c.embed_norm else None,
                                       model.layers[0].attn_norm, c.eps, c.eps, c.embed_scale)
        pieces = _Q8XPieces(self, layers, batch, padded)
        for i, (block, next_norm) in enumerate(zip(model.layers, model.next_norms)):
            x, h, _ = decoder_layer(pieces, i, block, x, h, next_norm, kv)
        logits = head(h)[:batch]
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.softcap is not None:
            logits = c.softcap * mx.tanh(logits / c.softcap)
        return logits

    def attend(self, index: int, block, parts: dict, kv: BatchKV) -> mx.array:
        """Layer `index`'s attention for the batch's rows: parts q, k, v (and gate) float32 [B,
        width] (biases added) -> float32 [B, heads * head_dim] (gated)."""
        c, step = self.model.config, self._step
        batch = len(step.lengths)
        attention = block.attention
        rope = c.rope(index)
        q, k = parts["q"], parts["k"]
        if c.qk_norm_whole:  # OLMo 2: each projection normed whole before the head split
            q, k = rms_norm(q, attention.q_norm, c.eps), rms_norm(k, attention.k_norm, c.eps)
        norm = c.qk_norm and not c.qk_norm_whole
        split = lambda y, heads, weight: ops.split_heads(  # noqa: E731
            y.reshape(batch, 1, -1), heads, c.head_dim, weight, c.eps, rope, start=step.positions)
        q = split(q, c.heads, attention.q_norm if norm else None)
        k = split(k, c.kv_heads, attention.k_norm if norm else None)
        v = parts["v"].reshape(batch, 1, c.kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        window = kv.windows[index]
        slots = step.slots(window)
        # The store's arrays are let go of before the write, so that the write can take their
        # buffers (MLX donates an input no one else holds) instead of copying the whole store.
        keys, values = kv.keys[index], kv.values[index]
        kv.keys[index] = kv.values[index] = None
        keys[step.rows, :, slots] = k[:, :, 0].astype(kv.dtype)
        values[step.rows, :, slots] = v[:, :, 0].astype(kv.dtype)
        kv.keys[index], kv.values[index] = keys, values
        seen = step.seen(window)
        if kernels.backend() == "cpu":
            # The compiled attention per row, over its own keys (it takes no [B, 1, 1, S] mask;
            # MLX's CPU attention with one took SmolLM2's 8-row step from 45 to 63 ms).
            o = mx.concatenate([
                ops.attention(q[b : b + 1], keys[b : b + 1, :, :n], values[b : b + 1, :, :n], c.attention_scale,
                              None, softcap=c.attn_softcap)
                for b, n in enumerate(seen)], axis=0)
        else:
            width = max(seen)
            o = ops.attention(q, keys[:batch, :, :width], values[:batch, :, :width], c.attention_scale,
                              step.mask(window, kv.dtype), softcap=c.attn_softcap)
        o = o.transpose(0, 2, 1, 3).reshape(batch, c.heads * c.head_dim)
        if c.attn_gate:
            o = o * mx.sigmoid(parts["gate"])
        return o


class _StepState:
    """What a step's layers share: the rows' positions (a device array), their slots and
    masks per layer kind, made once a step."""

    def __init__(self, config, lengths: list[int], kv: BatchKV):
        self.lengths = lengths
        self.rows = mx.arange(len(lengths))
        self.positions = mx.array(lengths, dtype=mx.int32)
        self._made = {}

    def slots(self, window):
        key = ("slots", window)
        if key not in self._made:
            self._made[key] = self.positions if window is None else self.positions % window
        return self._made[key]

    def seen(self, window) -> list[int]:
        """Keys each row's query sees: its positions so far and its own, the last `window`."""
        return [n + 1 if window is None else min(n + 1, window) for n in self.lengths]

    def mask(self, window, dtype):
        """None when every row sees the same keys; else additive [B, 1, 1, S] in `dtype`."""
        key = ("mask", window)
        if key not in self._made:
            seen = self.seen(window)
            width = max(seen)
            mask = None
            if min(seen) != width:
                visible = np.arange(width)[None, :] < np.array(seen)[:, None]
                mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32)).astype(dtype)[:, None, None, :]
            self._made[key] = mask
        return self._made[key]


class _FloatPieces:
    """layers.LayerPieces of the CPU form: x float32 [B, 1, hidden]."""

    def __init__(self, step: BatchStep):
        self.step = step
        self.config = step.model.config

    def attention(self, index: int, block, h, kv):
        batch = h.shape[0]
        if self.step.compiled_attention:
            o = self._compiled_attention(index, block, h.reshape(batch, -1), kv)
        else:
            parts = block.attention.input_proj(h)
            o = self.step.attend(index, block, {n: p.reshape(batch, -1) for n, p in parts.items()}, kv)
        return block.attention.o_proj(o.reshape(batch, 1, -1)), kv

    def _compiled_attention(self, index: int, block, h, kv):
        """The CPU extension's decode attention over the store's rows (cpu_ext.attention_decode
        with B rows: the q/k norms, RoPE at each row's position, the key and value writes and
        each row's attention over its own slots, three primitives a layer for any B)."""
        attention = block.attention
        stacks = attention.input_proj.stacks
        y = mx.concatenate([ops.linear(h, w) for w in stacks], axis=-1) if len(stacks) > 1 \
            else ops.linear(h, stacks[0])
        keys, values = kv.keys[index], kv.values[index]
        kv.keys[index] = kv.values[index] = None  # the writes may take the store's buffers
        c = self.config
        o, kv.keys[index], kv.values[index] = cpu_ext.attention_decode(
            y, keys, values, self.step._step.positions, q_norm=attention.q_norm if c.qk_norm else None,
            k_norm=attention.k_norm if c.qk_norm else None,
            **self.step.model.cpu_step._attention_settings(index, attention))
        return o

    def seam(self, x, branch, branch_weight, next_weight):
        c = self.config
        return ops.residual_norm(x, branch, branch_weight, next_weight, c.post_eps, c.eps)

    def feed_forward(self, index: int, block, h):
        return block.feed_forward(h)


class _Q8XPieces:
    """layers.LayerPieces of the GPU form: x float32 [padded, hidden], h q8x [padded, hidden]."""

    def __init__(self, step: BatchStep, layers: list, batch: int, padded: int):
        self.step, self.layers, self.batch, self.padded = step, layers, batch, padded
        self.config = step.model.config

    def attention(self, index: int, block, h, kv):
        """The fused step's attention kernels over the batch's rows (ops.attention_decode with
        rows: each row's norm, RoPE at its position, key and value written into its store row
        in place, attention over its own slots, the gate, o as q8x for the o-projection)."""
        c, launches, step = self.config, self.layers[index], self.step._step
        pieces = [launch(h) for launch in launches["inputs"]]
        y = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
        attention = block.attention
        offsets = attention.input_proj.offsets
        keys, values = kv.keys[index], kv.values[index]
        kv.keys[index] = kv.values[index] = None  # the CPU rendering's writes may take their buffers
        o, kv.keys[index], kv.values[index] = ops.attention_decode(
            y, keys, values, step.positions, kv.written_by if kv.written_by is not None else step.positions,
            heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
            offsets=(offsets["q"], offsets["k"], offsets["v"]), gate=offsets.get("gate"),
            q_weight=attention.q_norm if c.qk_norm else None, k_weight=attention.k_norm if c.qk_norm else None,
            bias=attention.qkv_bias if c.qkv_bias else None, rope=c.rope(index), eps=c.eps,
            scale=c.attention_scale, woven=getattr(launches["output"], "x_woven", False),
            qk_norm_whole=c.qk_norm_whole, softcap=c.attn_softcap, rows=self.batch, out_rows=self.padded,
            splits=self.step.attention_splits(self.padded),
            head_group=self.step.model.settings.attention_head_group)
        return _unsummed(launches["output"], o), kv

    def seam(self, x, branch, branch_weight, next_weight):
        """A tile product's branch comes as its chunks' partial sums, added in the seam's kernel."""
        c = self.config
        return ops.residual_norm_quant(x, branch, branch_weight, next_weight, c.post_eps, c.eps,
                                       chunked=branch.ndim == 3)

    def feed_forward(self, index: int, block, h):
        return BatchStep.feed_forward(self.layers[index], h, summed=False)


def _unsummed(launch, x):
    """launch(x), a tile product's chunks left unsummed ([chunks, rows, out]) for the seam."""
    return launch(x, summed=False) if isinstance(launch, ops.TileProduct) else launch(x)
