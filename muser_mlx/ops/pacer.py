"""The GPU prefill's pacer: how many float16 weight pieces a prefill chunk keeps queued.

MLX encodes far ahead of the GPU. A prefill chunk decodes each weight to float16 for the
backend's matmul (~1 GB a Muse Glimmer layer); unpaced, a chunk's temporaries reached 2x the
file. Within `paced_products(settings)` (this thread) every GPU prefill product is queued as it
is built, after the host waits for older ones until
- the float16 pieces queued at once fit Settings.prefill_queued_bytes, and
- MLX's active memory, the slots left out, is within Settings.prefill_headroom of what it was
  when the block began (None: unbounded);
and with Settings.prefill_slots > 0 the pieces are decoded in place into that many reused
buffers (kernel dequant_into) rather than a fresh temporary each. Waiting for a whole layer
instead idled the GPU while the host built each layer.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import mlx.core as mx

from muser_mlx.settings import DEFAULT, Settings

_PACING = threading.local()


class Slot:
    """A reused float16 buffer: `values` (flat, None before its first piece) and `reader`, the
    last output computed from them (a write into the slot must follow it)."""

    def __init__(self):
        self.values = None
        self.reader = None


class Pacer:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.budget = settings.prefill_queued_bytes
        self.queued = collections.deque()  # (output, piece bytes), oldest first
        self.slots = [Slot() for _ in range(settings.prefill_slots)]
        self.turn = 0
        self.headroom = settings.prefill_headroom
        self.start = mx.get_active_memory() if self.headroom is not None else 0

    def over_memory(self) -> bool:
        """Whether MLX's active memory, this pacer's slots left out, is past its start plus headroom."""
        if self.headroom is None:
            return False
        slots = sum(slot.values.nbytes for slot in self.slots if slot.values is not None)
        return mx.get_active_memory() - slots > self.start + self.headroom

    def make_room(self, nbytes: int) -> None:
        """Wait for the oldest queued pieces until one of `nbytes` more fits (one piece is
        queued whatever its size)."""
        while self.queued and (sum(n for _, n in self.queued) + nbytes > self.budget or self.over_memory()):
            mx.eval(self.queued.popleft()[0])

    def queue(self, out: mx.array, nbytes: int) -> None:
        mx.async_eval(out)
        self.queued.append((out, nbytes))

    def slot(self) -> Slot | None:
        """The next slot in turn (None without slots)."""
        if not self.slots:
            return None
        slot = self.slots[self.turn]
        self.turn = (self.turn + 1) % len(self.slots)
        return slot


def current() -> Pacer | None:
    """The pacer of the innermost `paced_products` block of this thread (None outside one)."""
    return getattr(_PACING, "pacer", None)


@contextlib.contextmanager
def paced_products(settings: Settings = DEFAULT):
    """Within this block (this thread), GPU prefill products are paced by `settings`
    (module docstring)."""
    previous = current()
    _PACING.pacer = Pacer(settings)
    try:
        yield
    finally:
        _PACING.pacer = previous
