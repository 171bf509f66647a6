"""The host's mirror of the sampler's slots: the completion each slot holds and the slots whose
KV cache predates the sampler's weights.

Host-only bookkeeping: a sequence keeps its slot from admission to its end (a decode call
names the slots it runs on, so nothing moves).
"""

from __future__ import annotations

from meshrl.inference.requests import Completion


class SlotTable:
    """``out[s]``: the completion in slot ``s`` (None: free). ``stale``: live slots whose cache
    was written by older weights (they re-prefill before they decode again)."""

    def __init__(self, slots: int) -> None:
        self.out: list[Completion | None] = [None] * slots
        self.stale: set[int] = set()

    def free(self) -> list[int]:
        return [s for s, c in enumerate(self.out) if c is None]

    def busy(self) -> bool:
        return any(c is not None for c in self.out)

    def release(self, c: Completion) -> None:
        """Empty the slot holding ``c``, unless a new request has taken it over already."""
        for s, x in enumerate(self.out):
            if x is c:
                self.out[s] = None
                return

    def mark_stale(self) -> None:
        """New weights: every sequence in flight has a cache from the old ones."""
        self.stale = {s for s, c in enumerate(self.out) if c is not None}

    def take_stale(self) -> list[tuple[int, Completion]]:
        """The stale live slots with their completions; none is stale afterwards."""
        live = [(s, c) for s, c in enumerate(self.out) if c is not None and s in self.stale]
        self.stale = set()
        return live
