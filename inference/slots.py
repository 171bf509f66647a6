"""The host's mirror of the sampler's slots: the completion each slot holds and the slots whose
KV cache predates the sampler's weights.

Host-only bookkeeping; ``Sampler`` applies the same slot swaps to the device cache and state
(``programs.swap``) whenever it applies them here, so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        """Empty the slot holding ``c``, unless a new request has taken it over already (swaps
        may have moved ``c`` since its round was dispatched)."""
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

    def swap(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Exchange the records of each (a, b) slot pair; staleness moves with its sequence."""
        for x, y in pairs:
            self.out[x], self.out[y] = self.out[y], self.out[x]
            if (x in self.stale) != (y in self.stale):
                self.stale ^= {x, y}

    def gathering(self, keep: Sequence[Completion], lo: int, hi: int) -> list[tuple[int, int]]:
        """The swaps that move the completions ``keep`` into slots [lo, hi): each one outside
        the range trades places with a slot inside it that holds none of them."""
        where = {id(c): s for s, c in enumerate(self.out) if c is not None}
        slots = {where[id(c)] for c in keep}
        incoming = sorted(s for s in slots if not lo <= s < hi)
        outgoing = [s for s in range(lo, hi) if s not in slots]
        return list(zip(incoming, outgoing))
