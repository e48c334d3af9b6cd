"""KV caches, one per attention layer, passed into the model (never hidden inside it).

Both caches hand attention the keys and values it may see plus each key's position, so the
mask is built from positions in one place (`attention_mask`), whatever order the keys are in.

- `KVCache`: every position; storage grows in steps of `STEP` entries so that appending one
  token is a slice write, not a copy of everything so far.
- `SlidingWindowCache`: a ring buffer of `window` entries. A one-token step overwrites the
  oldest slot; a chunk of T tokens briefly needs window-1 + T keys (its first query still sees
  window-1 older keys), then the cache keeps the newest `window`.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class KVCache:
    """keys/values: [B, kv_heads, capacity, head_dim]; positions: [capacity] int32."""

    def __init__(self):
        self.keys = None
        self.values = None
        self.positions = None
        self.offset = 0  # tokens seen so far = position of the next token

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append keys/values [B, kv_heads, T, head_dim]; return the keys, values and key
        positions attention may see: [B, kv_heads, S, head_dim] twice and [S]."""
        tokens = keys.shape[2]
        start = self.offset
        if self.keys is None or start + tokens > self.keys.shape[2]:
            capacity = -(-(start + tokens) // STEP) * STEP
            self.keys = self._grow(self.keys, keys, capacity)
            self.values = self._grow(self.values, values, capacity)
            self.positions = mx.arange(capacity, dtype=mx.int32)
        self.keys[:, :, start : start + tokens] = keys
        self.values[:, :, start : start + tokens] = values
        self.offset += tokens
        end = self.offset
        return self.keys[:, :, :end], self.values[:, :, :end], self.positions[:end]

    def trim(self, tokens: int) -> None:
        """Forget the last `tokens` positions (their slots are overwritten by what comes next)."""
        if not 0 <= tokens <= self.offset:
            raise ValueError(f"cannot trim {tokens} of {self.offset} cached positions")
        self.offset -= tokens

    @staticmethod
    def _grow(stored, new, capacity):
        batch, heads, _, dim = new.shape
        grown = mx.zeros((batch, heads, capacity, dim), dtype=new.dtype)
        if stored is not None:
            grown[:, :, : stored.shape[2]] = stored
        return grown

    @property
    def size(self) -> int:
        """Entries attention can see from this cache."""
        return self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SlidingWindowCache:
    """A ring buffer of the last `window` positions. keys/values: [B, kv_heads, <=window, head_dim];
    positions: [<=window] int32, the position of the key in each slot."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"sliding window must be at least 1, got {window}")
        self.window = window
        self.keys = None
        self.values = None
        self.positions = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        tokens = keys.shape[2]
        start = self.offset
        new_positions = mx.arange(start, start + tokens, dtype=mx.int32)
        self.offset += tokens
        if tokens == 1 and self.keys is not None and self.keys.shape[2] == self.window:
            slot = start % self.window
            self.keys[:, :, slot : slot + 1] = keys
            self.values[:, :, slot : slot + 1] = values
            self.positions[slot : slot + 1] = new_positions
            return self.keys, self.values, self.positions
        if tokens == 1 and self.keys is not None and self.keys.shape[2] == start:
            # Not full yet: slots 0..start-1 hold positions 0..start-1, so the new key goes at
            # the end (slot = position) with no sorting.
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
            self.positions = mx.concatenate([self.positions, new_positions])
            return self.keys, self.values, self.positions
        if self.keys is None:
            seen_keys, seen_values, seen_positions = keys, values, new_positions
        else:
            seen_keys = mx.concatenate([self.keys, keys], axis=2)
            seen_values = mx.concatenate([self.values, values], axis=2)
            seen_positions = mx.concatenate([self.positions, new_positions])
        # Keep the newest `window` entries, in position order: slot = position % window
        # holds again once the buffer is full, so one-token steps can overwrite in place.
        kept = min(self.window, seen_keys.shape[2])
        order = mx.argsort(seen_positions)[-kept:]
        if kept == self.window:
            order = order[mx.argsort(mx.take(seen_positions, order) % self.window)]
        self.keys = mx.take(seen_keys, order, axis=2)
        self.values = mx.take(seen_values, order, axis=2)
        self.positions = mx.take(seen_positions, order)
        return seen_keys, seen_values, seen_positions

    def trim(self, tokens: int) -> None:
        """Forget the last position (at most one: a full ring has already overwritten the
        oldest key the one before it would need). Its slot is marked never visible, and the
        next token writes there again."""
        if tokens == 0:
            return
        if tokens != 1 or self.offset < 1:
            raise ValueError(f"a sliding-window cache can trim one position, not {tokens} of {self.offset}")
        self.offset -= 1
        if self.keys.shape[2] == self.window:
            slot = self.offset % self.window
            self.positions[slot : slot + 1] = mx.array([-(2**30)], dtype=mx.int32)
        else:
            self.keys, self.values = self.keys[:, :, :-1], self.values[:, :, :-1]
            self.positions = self.positions[:-1]

    @property
    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def attention_mask(query_positions: mx.array, key_positions: mx.array, window: int | None):
    """Boolean [T, S]: query i may see key j when j is not in its future and, for a
    sliding-window layer, when it is one of the last `window` positions (p-window+1 … p)."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    return visible
