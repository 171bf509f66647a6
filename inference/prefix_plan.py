"""Which leading pages the slots of a paged decode chunk share, planned on the host from the
page table (``models.cascade_attention``).

A chunk's attention may split at P pages: every slot attends to positions [0, P x S) through
a prefix row it shares with the slots listing the same first P pages (read once per row), and
to its own positions from P x S on through its suffix window. A split is exact for any P with
P x S at most the position each slot starts the chunk at (its prompt length: a decode never
writes a prefix page). A sequence listing no one else's pages is a row of its own, so any mix
of groups and lone sequences runs in the same program.

Static shapes (one compiled program each): R rows (``row_buckets``) of G members, R x G one
or two times the slots B (a group larger than G takes several rows), P pages per row, and a
suffix window W from ``suffix_buckets``. A plan reads ``R x P x S + B x W`` cache entries a
step against ``B x window`` for the plain window; the shapes reading the fewest are taken
(then the fewest padded queries), when they read at most ``CASCADE_SHARE`` of the plain
window's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from meshrl.inference.requests import buckets_up_to
from meshrl.utils.buckets import bucket_for

# A split chunk gathers two windows and merges two partial softmaxes a step: taken only when
# it reads at most this share of the plain window's entries.
CASCADE_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Host arrays of a ``SharedPrefix``: prefix pages [R, P] (-1: padding row), members
    [R, G] (slot count B: padding), each slot's pages from P on [B, W / S]."""

    rows_RxP: np.ndarray  # noqa: N815
    members_RxG: np.ndarray  # noqa: N815
    suffix_BxM: np.ndarray  # noqa: N815


def suffix_buckets(max_len: int, page_size: int) -> tuple[int, ...]:
    """Suffix window widths: whole pages, 2^k and 1.5 x 2^k from two pages up to ``max_len``
    (a suffix is often far shorter than the windows of whole sequences)."""
    return tuple(sorted({-(-w // page_size) * page_size
                         for w in buckets_up_to(max_len, 2 * page_size)}))


def row_buckets(slots: int) -> tuple[int, ...]:
    """Prefix row counts a plan is padded to: B / 8, B / 4, B / 2 and B."""
    return tuple(sorted({max(1, slots // d) for d in (8, 4, 2, 1)}))


def plan_prefixes(table_BxM: np.ndarray, prompt_lens: Mapping[int, int], page_size: int,
                  window: int, reach: int, windows: Sequence[int]) -> PrefixPlan | None:
    """The cheapest split of a chunk whose slots ``prompt_lens`` (slot -> prompt length; the
    live slots) hold the pages of ``table_BxM`` and reach positions below ``reach``, its
    suffix window one of ``windows``; None when the plain ``window`` reads fewer entries (over
    ``CASCADE_SHARE``)."""
    B, M = table_BxM.shape
    S = page_size
    live = sorted(s for s in prompt_lens if table_BxM[s, 0] >= 0)
    if len(live) < 2:
        return None
    top = min(prompt_lens[s] // S for s in live)  # a prefix page is never written in the chunk
    best: tuple[tuple[int, int], int, list[list[int]], int, int, int] | None = None
    for p in sorted({min((prompt_lens[s] - 1) // S, top) for s in live} - {0}):
        groups = _groups(table_BxM, live, p)
        suffix = min(bucket_for(reach - p * S, windows), (M - p) * S)
        for rows, width in _row_shapes(B):
            # A plan whose rows are as many as the live slots shares nothing.
            if _rows_needed(groups, width) > rows or rows >= len(live):
                continue
            # Entries read a step; then the padded queries a row batch computes.
            cost = (rows * p * S + B * suffix, rows * width)
            if best is None or cost < best[0]:
                best = (cost, p, groups, rows, width, suffix)
    if best is None or best[0][0] > CASCADE_SHARE * B * window:
        return None
    _, p, groups, rows, width, suffix = best
    return _arrays(table_BxM, groups, p, rows, width, suffix // S)


def _row_shapes(slots: int) -> list[tuple[int, int]]:
    """(rows R, members per row G) a plan may take: R from ``row_buckets``, R x G one or two
    times the slots (query rows computed against a prefix: at most twice the live ones)."""
    return [(r, min(w, slots)) for r in row_buckets(slots)
            for w in sorted({-(-slots // r), 2 * -(-slots // r)})]


def _groups(table_BxM: np.ndarray, live: Sequence[int], p: int) -> list[list[int]]:
    """The ``live`` slots by their first ``p`` pages, in slot order."""
    by_pages: dict[bytes, list[int]] = collections.defaultdict(list)
    for s in live:
        by_pages[table_BxM[s, :p].tobytes()].append(s)
    return list(by_pages.values())


def _rows_needed(groups: Sequence[Sequence[int]], width: int) -> int:
    return sum(-(-len(g) // width) for g in groups)


def _arrays(table_BxM: np.ndarray, groups: Sequence[Sequence[int]], p: int, rows: int,
            width: int, suffix_pages: int) -> PrefixPlan:
    B = table_BxM.shape[0]
    rows_RxP = np.full((rows, p), -1, np.int32)
    members_RxG = np.full((rows, width), B, np.int32)
    r = 0
    for g in groups:
        for lo in range(0, len(g), width):
            part = g[lo:lo + width]
            rows_RxP[r] = table_BxM[part[0], :p]
            members_RxG[r, :len(part)] = part
            r += 1
    suffix_BxM = np.ascontiguousarray(table_BxM[:, p:p + suffix_pages], np.int32)
    return PrefixPlan(rows_RxP, members_RxG, suffix_BxM)


def warm_plans(slots: int, max_len: int, page_size: int, prompt_lengths: Sequence[int],
               windows: Sequence[int], suffix_windows: Sequence[int],
               ) -> list[tuple[int, PrefixPlan]]:
    """(plain window, plan of padding rows) of every split ``plan_prefixes`` may take for a
    chunk whose live prompts are all ``n`` tokens long, for each ``n`` of ``prompt_lengths``
    (the prompt buckets: prompts filling them): what warming up compiles."""
    S, M = page_size, max_len // page_size
    out = []
    for n in sorted(set(prompt_lengths)):
        p = (n - 1) // S
        reaches = range(n + 1, max_len + 1)
        sizes = {(bucket_for(r, windows), min(bucket_for(r - p * S, suffix_windows), (M - p) * S))
                 for r in reaches} if p else set()
        for window, suffix in sorted(sizes):
            for rows, width in _row_shapes(slots):
                if rows >= slots or rows * p * S + slots * suffix > CASCADE_SHARE * slots * window:
                    continue
                out.append((window, PrefixPlan(np.full((rows, p), -1, np.int32),
                                               np.full((rows, width), slots, np.int32),
                                               np.full((slots, suffix // S), -1, np.int32))))
    return out
