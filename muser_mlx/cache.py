"""KV caches, one per attention layer, passed into the model (never hidden inside it).

Both caches keep their keys and values in one preallocated array each, [B, kv_heads,
capacity, head_dim], in a fixed slot layout that two kinds of step share:
- a prefill chunk or a step of several tokens (`update_and_fetch`, MLX ops) writes its keys
  into their slots and gets back the keys it may see with each one's position, so the mask is
  built from positions in one place (`attention_mask`);
- a fused one-token decode step (ops.attention_decode) reads the arrays as they are and writes
  the token's key into its slot itself, in place on a GPU.

- `KVCache`: every position; position s at slot s. Capacity grows in steps of `STEP` slots.
- `SlidingWindowCache`: a ring of `window` slots; position s at slot s % window, so a new
  position overwrites the one that just left the window (a ring that has wrapped can step back
  one position, not more: `can_trim`). Until the window has filled, its
  capacity grows in steps of `STEP` as `KVCache`'s does (slot s = position s either way): a
  short context's fused attention then launches for the slots it has, not for the window.
The dtype is float16 on a GPU (half the bytes attention reads per step), float32 on the CPU.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

STEP = 256
NOWHERE = -(2**30)  # the position of an empty or invalidated slot: no query sees it


class KVCache:
    """keys/values: [B, kv_heads, capacity, head_dim] in `dtype`, position s at slot s."""

    def __init__(self, dtype=mx.float32):
        self.dtype = dtype
        self.keys = None
        self.values = None
        self.offset = 0  # tokens seen so far = position of the next token
        self.written_by = None  # the token of the last fused step, which wrote keys/values in place

    def reserve(self, batch: int, kv_heads: int, head_dim: int, end: int) -> None:
        """Make room for positions up to end - 1 (whole STEPs; the stored keys are copied)."""
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        finish_fused_writes(self)  # the copy below reads what a fused step may still be writing
        capacity = -(-end // STEP) * STEP
        self.keys = _grown(self.keys, (batch, kv_heads, capacity, head_dim), self.dtype)
        self.values = _grown(self.values, (batch, kv_heads, capacity, head_dim), self.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array, dtype=mx.float32):
        """Append keys/values [B, kv_heads, T, head_dim]; return the keys, values (in `dtype`)
        and key positions attention may see: [B, kv_heads, S, head_dim] twice and [S], and
        whether key j holds position j for every j (here always: slot s holds position s)."""
        batch, kv_heads, tokens, head_dim = keys.shape
        finish_fused_writes(self)
        start = self.offset
        self.reserve(batch, kv_heads, head_dim, start + tokens)
        self.keys[:, :, start : start + tokens] = keys.astype(self.dtype)
        self.values[:, :, start : start + tokens] = values.astype(self.dtype)
        self.advance(tokens)
        end = self.offset
        return (self.keys[:, :, :end].astype(dtype), self.values[:, :, :end].astype(dtype),
                _shared_positions(("full", end), lambda: mx.arange(end, dtype=mx.int32)), True)

    def advance(self, tokens: int) -> None:
        """Count `tokens` positions as written (a fused decode step wrote them itself)."""
        self.offset += tokens

    def can_trim(self, tokens: int) -> bool:
        return 0 <= tokens <= self.offset

    def trim(self, tokens: int) -> None:
        """Forget the last `tokens` positions (their slots are overwritten by what comes next)."""
        if not self.can_trim(tokens):
            raise ValueError(f"cannot trim {tokens} of {self.offset} cached positions")
        self.offset -= tokens

    @property
    def size(self) -> int:
        """Entries attention can see from this cache."""
        return self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SlidingWindowCache:
    """The last `window` positions, a ring: keys/values [B, kv_heads, capacity, head_dim] in
    `dtype`, position s at slot s % window. capacity = window once the positions reserved reach
    it; before, the positions reserved rounded up to STEP (no slot wraps until then)."""

    def __init__(self, window: int, dtype=mx.float32):
        if window < 1:
            raise ValueError(f"sliding window must be at least 1, got {window}")
        self.window = window
        self.dtype = dtype
        self.keys = None
        self.values = None
        self.offset = 0
        self.peak = 0  # the most positions ever written: past `window`, the ring has wrapped
        self.stale = None  # a slot whose position a trim took back, until it is written again
        self.written_by = None  # the token of the last fused step, which wrote keys/values in place

    def reserve(self, batch: int, kv_heads: int, head_dim: int, end: int) -> None:
        capacity = min(self.window, -(-end // STEP) * STEP)
        if self.keys is None or self.keys.shape[2] < capacity:
            finish_fused_writes(self)  # the copy below reads what a fused step may still be writing
            self.keys = _grown(self.keys, (batch, kv_heads, capacity, head_dim), self.dtype)
            self.values = _grown(self.values, (batch, kv_heads, capacity, head_dim), self.dtype)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def positions(self) -> np.ndarray:
        """int32 [capacity]: the position each slot holds (NOWHERE for none)."""
        slots = np.arange(self.capacity)
        held = slots + self.window * ((self.offset - 1 - slots) // self.window)
        held = np.where(slots < self.offset, held, NOWHERE)
        if self.stale is not None:
            held[self.stale] = NOWHERE
        return held.astype(np.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array, dtype=mx.float32):
        """Add keys/values [B, kv_heads, T, head_dim]; return what attention may see: the ring's
        keys before this chunk and the chunk's own (a chunk's first query still sees window-1
        older keys), in `dtype`, with their positions, and whether key j holds position j for
        every j: so while nothing has left the window (the chunk ends within it, no slot
        stale), when the ring's filled slots come first, in order. One token is written first
        and the ring returned as it is (its mask drops the key that just left the window)."""
        batch, kv_heads, tokens, head_dim = keys.shape
        finish_fused_writes(self)
        self.reserve(batch, kv_heads, head_dim, self.offset + tokens)
        start = self.offset
        if tokens > 1 and start + tokens <= self.window and self.stale is None:
            seen = (mx.concatenate([self.keys[:, :, :start].astype(dtype), keys.astype(dtype)], axis=2),
                    mx.concatenate([self.values[:, :, :start].astype(dtype), values.astype(dtype)], axis=2),
                    mx.arange(start + tokens, dtype=mx.int32), True)
        elif tokens > 1:
            seen = (mx.concatenate([self.keys.astype(dtype), keys.astype(dtype)], axis=2),
                    mx.concatenate([self.values.astype(dtype), values.astype(dtype)], axis=2),
                    self._chunk_positions(start, tokens), False)
        kept = min(tokens, self.window)  # the chunk's last `window` keys stay
        # Their slots run from `first` to the ring's end, then on from slot 0: written as one
        # or two slices (no index array: one made on the host lives in managed memory, and the
        # first kernel to read it waits for its page to move to the GPU).
        first = (start + tokens - kept) % self.window
        head = min(kept, self.window - first)
        for ring, new in ((self.keys, keys), (self.values, values)):
            new = new[:, :, tokens - kept :].astype(self.dtype)
            ring[:, :, first : first + head] = new[:, :, :head]
            if head < kept:
                ring[:, :, : kept - head] = new[:, :, head:]
        self.advance(tokens)
        if tokens > 1:
            return seen
        return self.keys.astype(dtype), self.values.astype(dtype), mx.array(self.positions()), False

    def _chunk_positions(self, start: int, tokens: int) -> mx.array:
        """int32 [capacity + tokens]: the ring's positions (before the chunk is written), then the
        chunk's. Every window layer of a model holds the same slots, so the one array made for
        the first serves the rest of the chunk's layers (and attention_mask reuses its mask)."""
        return _shared_positions(
            ("ring", self.window, self.capacity, start, tokens, self.stale),
            lambda: mx.array(np.concatenate([self.positions(), np.arange(start, start + tokens, dtype=np.int32)])))

    def advance(self, tokens: int) -> None:
        self.offset += tokens
        self.peak = max(self.peak, self.offset)
        self.stale = None

    def can_trim(self, tokens: int) -> bool:
        """Any number of positions while the ring has never wrapped (slot s still holds position
        s); after that, the last position only, once: a query at position p sees p - window + 1
        .. p, and a wrapped ring has overwritten position offset - window - 1, which a query two
        positions back would need."""
        if not 0 <= tokens <= self.offset:
            return False
        return self.peak <= self.window or tokens == 0 or (tokens == 1 and self.stale is None)

    def trim(self, tokens: int) -> None:
        """Forget the last `tokens` positions (can_trim says how many may go). After a wrap, the
        one slot given back is marked never visible until the next token writes there again."""
        if not self.can_trim(tokens):
            raise ValueError(f"a sliding-window cache of window {self.window} that has held {self.peak} "
                             f"positions cannot trim {tokens} of its {self.offset}"
                             + (": once wrapped, only its last position, once" if self.peak > self.window else ""))
        if tokens == 0:
            return
        self.offset -= tokens
        if self.peak > self.window:
            self.stale = self.offset % self.window

    @property
    def size(self) -> int:
        """Entries attention can see from this cache."""
        return min(self.offset, self.window)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def common_prefix(a, b) -> int:
    """The number of leading ids two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def step_back(cache: list, tokens: int) -> bool:
    """Step every layer's cache back to its first `tokens` positions if each one can (True);
    else change nothing (False)."""
    drop = cache[0].offset - tokens
    if not all(layer_cache.can_trim(drop) for layer_cache in cache):
        return False
    for layer_cache in cache:
        layer_cache.trim(drop)
    return True


def finish_fused_writes(cache) -> None:
    """Wait for the fused step that last wrote `cache` in place (MLX cannot order MLX ops after
    a write it does not see) before MLX ops read or write it."""
    if cache.written_by is not None:
        mx.eval(cache.written_by)
        cache.written_by = None


def _grown(stored: mx.array | None, shape: tuple[int, ...], dtype) -> mx.array:
    grown = mx.zeros(shape, dtype=dtype)
    if stored is not None:
        grown[:, :, : stored.shape[2]] = stored
    return grown


# Per thread (an array belongs to the streams of the thread that made it), the last key
# positions of each kind ("full", "ring") and the last mask of each window and form, with what
# they were made from: the layers of a chunk whose caches agree share one array of each (a Muse
# Glimmer chunk past the window: 39 window layers, one mask). One entry each, replaced by the
# next chunk's.
_LAST = threading.local()


def _last(name: str) -> dict:
    table = getattr(_LAST, name, None)
    if table is None:
        table = {}
        setattr(_LAST, name, table)
    return table


def _shared_positions(key: tuple, make) -> mx.array:
    table = _last("positions")
    last = table.get(key[0])
    if last is not None and last[0] == key:
        return last[1]
    positions = make()
    table[key[0]] = (key, positions)
    return positions


def padded_positions(key_positions: mx.array, count: int) -> mx.array:
    """key_positions followed by `count` NOWHEREs (keys padded after the cache's: no query
    sees them). Asked again for the same array (object) and count, it returns the array it
    made last time, so that a chunk's window layers still share one mask (attention_mask)."""
    table = _last("padded")
    last = table.get("last")
    if last is not None and last[0] is key_positions and last[1] == count:
        return last[2]
    padded = mx.concatenate([key_positions, mx.full((count,), NOWHERE, dtype=key_positions.dtype)])
    table["last"] = (key_positions, count, padded)
    return padded


def attention_mask(start: int, tokens: int, key_positions: mx.array, window: int | None, additive=None):
    """[T, S] for the queries at positions start .. start + T - 1: query i may see key j when
    j is not in its future and, for a sliding-window layer, when it is one of the last
    `window` positions (p-window+1 … p). Boolean; or, with `additive` a float dtype, 0 where
    visible and -inf elsewhere in that dtype: MLX's fused attention on CUDA turns a boolean
    mask into that itself, but only after broadcasting it to every head (a [B, heads, T, S]
    select and bias, ~84 MB a Muse Glimmer layer at a 2,560-key chunk). Asked again for the
    same key positions array (the same object: a chunk's window layers, `_chunk_positions`),
    start, tokens, window and form, it returns the mask it made last time."""
    table = _last("masks")
    last = table.get((window, additive))
    if last is not None and last[0] is key_positions and last[1] == (start, tokens):
        return last[2]
    q = mx.arange(start, start + tokens, dtype=mx.int32)[:, None]
    k = key_positions[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    if additive is not None:
        visible = mx.where(visible, mx.array(0.0, dtype=additive), mx.array(-np.inf, dtype=additive))
    table[window, additive] = (key_positions, (start, tokens), visible)
    return visible
