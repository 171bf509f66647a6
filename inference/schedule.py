"""How a decode chunk splits over cache windows: pure planning from host-side positions.

A decode call attends over one cache window for all its rows, so when live sequences sit at
very different positions (continuous batching refills slots at different times) one call over
the longest window reads the short sequences' empty entries on every step. The
sampler ranks live slots by position (longest first) and may cut that ranking at the
``split_cuts`` into contiguous slot ranges, each its own call over its own window. A cut pays
when the cache entries it saves outweigh one more call: one more pass over the weights
(``weights_pass_cost``) plus a fixed per-call cost (``SPLIT_CALL_OVERHEAD``). Free slots ride along with the last range, whose
window its live rows set. ``Sampler`` swaps each range's members into place before dispatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

SPLIT_CALL_OVERHEAD = 1 << 20
# What one more pass over the weights costs per decode step, as a share of reading that many
# cache entries. On an accelerator both stream from HBM (1). On a CPU the weights of a small
# model stay in the last-level cache over a chunk's steps while the cache windows stream from
# DRAM: for the 3.4M-parameter model of benchmarks/sampler.py on a 2-core EPYC, splitting a
# 32-row chunk paid from ~1.5M cache entries saved per step, not from 4.4M (weights + fixed).
CPU_WEIGHTS_PASS = 0.125

Call = tuple[int, int, int]  # (lo, rows, window): slots [lo, lo + rows) over entries [0, window)


def weights_pass_cost(weights_size: int, platform: str) -> int:
    """One more read of ``weights_size`` weights per decode step, in cache-entry elements."""
    return int(weights_size * (CPU_WEIGHTS_PASS if platform == "cpu" else 1.0))


def split_cuts(row_buckets: Sequence[int], slots: int) -> tuple[int, ...]:
    """Where a full chunk's ranking may be cut: after the smallest row bucket's worth of the
    longest sequences. More cuts (``Sampler.split_cuts = (4, 16)`` or ``(4, 8, 16)`` on 32
    slots) measured no faster on a 2-core CPU: the extra calls and the swaps that keep each
    range's members in place cost what the shorter windows saved (BUILD_NOTES.md)."""
    return tuple(b for b in row_buckets[:1] if 0 < b < slots)


def decode_shapes(row_buckets: Sequence[int], cuts: Sequence[int], slots: int
                  ) -> tuple[tuple[int, int], ...]:
    """Every (lo, rows) a decode call may have: the packed row buckets, and each slot range
    between two cut points (or the ends) of a split chunk."""
    bounds = (0, *cuts, slots)
    ranges = {(lo, hi - lo) for lo, hi in itertools.combinations(bounds, 2)}
    return tuple(sorted(ranges | {(0, r) for r in row_buckets}))


def plan_windows(positions: Sequence[int], slots: int, cuts: Sequence[int],
                 window_for: Callable[[int], int], fixed_cost: int, entry_size: int
                 ) -> list[Call]:
    """The cheapest split of a full ``slots``-row chunk whose live sequences are at
    ``positions`` (sorted longest first; rank i goes to slot i): the calls, top range first.

    A call costs ``fixed_cost`` plus rows x window x ``entry_size`` elements read per step.
    Cuts are taken only inside the live ranking, so every range has a live row setting its
    window; ties keep the fewer calls.
    """
    assert list(positions) == sorted(positions, reverse=True), positions
    inside = [c for c in cuts if c < len(positions)]
    best: tuple[int, list[Call]] | None = None
    for k in range(len(inside) + 1):
        for chosen in itertools.combinations(inside, k):
            bounds = (0, *chosen, slots)
            calls = [(lo, hi - lo, window_for(positions[lo])) for lo, hi in zip(bounds, bounds[1:])]
            cost = sum(fixed_cost + rows * window * entry_size for _, rows, window in calls)
            if best is None or cost < best[0]:
                best = (cost, calls)
    assert best is not None
    return best[1]
