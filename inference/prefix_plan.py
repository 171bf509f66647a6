"""Which leading pages the slots of a paged decode chunk share, planned on the host from the
page table (``models.cascade_attention``).

A chunk's attention may split at P pages: every slot attends to positions [0, P x S) through
a prefix row it shares with the slots listing the same first P pages (read once per row), to
its own older positions through blocks of whole pages that only it reads, and to the newest
ones through its band, where the chunk writes. A split is exact for any P with P x S at most
the position each slot starts the chunk at (its prompt length: a decode never writes a prefix
page). A sequence listing no one else's pages is a row of its own, so any mix of groups and
lone sequences runs in the same program.

A slot at position n has its band start at the page holding n (``band_start``) and span
``band_width`` entries, enough for the chunk's writes; its pages from P up to the band form
its blocks of ``BLOCK_PAGES`` pages (the last one partial), so each slot reads about its own
length, not the chunk's longest.

Static shapes (one compiled program each): R rows (``row_buckets``) of G members, R x G one
or two times the slots B (a group larger than G takes several rows), P pages per row, and N
blocks (``block_buckets``). A plan reads ``R x P x S + N x BLOCK_PAGES x S + B x band_width``
cache entries a step against ``B x window`` for the plain window; the shapes reading the
fewest are taken (then the fewest padded queries), when they read at most ``CASCADE_SHARE`` of
the plain window's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from meshrl.inference.requests import buckets_up_to
from meshrl.utils.buckets import bucket_for

# A split chunk gathers three windows and merges three partial softmaxes a step: taken only
# when it reads at most this share of the plain window's entries.
CASCADE_SHARE = 0.8
# Pages a block holds (of a slot's older positions past the prefix). Each block is a batch row
# of its own small matmuls, so small blocks pay a row's overhead on every step and large ones
# pad each slot's last block; 4 pages (64 entries at the default page size) balanced the two
# in a CPU measurement (BUILD_NOTES.md).
BLOCK_PAGES = 4


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Host arrays of a ``SharedPrefix``: prefix pages [R, P] (-1: padding row), members
    [R, G] (slot count B: padding), block pages [N, BLOCK_PAGES] (-1: none) and each block's
    slot [N] (B: padding), each slot's band pages [B, W / S] and first position [B]."""

    rows_RxP: np.ndarray  # noqa: N815
    members_RxG: np.ndarray  # noqa: N815
    blocks_NxQ: np.ndarray  # noqa: N815
    owners_N: np.ndarray  # noqa: N815
    band_BxW: np.ndarray  # noqa: N815
    band_start_B: np.ndarray  # noqa: N815

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The fields in ``SharedPrefix`` order."""
        return (self.rows_RxP, self.members_RxG, self.blocks_NxQ, self.owners_N, self.band_BxW,
                self.band_start_B)


def band_width(chunk: int, page_size: int) -> int:
    """Entries of a slot's band: from the start of the page its next position is on, through
    the ``chunk`` positions a decode chunk writes, in whole pages."""
    return -(-(page_size - 1 + chunk) // page_size) * page_size


def band_start(position: int, page_size: int) -> int:
    """First position of the band of a slot whose next position is ``position``."""
    return position // page_size * page_size


def block_buckets(slots: int, max_len: int, page_size: int) -> tuple[int, ...]:
    """Block counts a plan is padded to: 2^k and 1.5 x 2^k from slots / 4 up to every slot's
    whole cache in blocks."""
    most = slots * -(-max_len // (BLOCK_PAGES * page_size))
    return buckets_up_to(most, max(1, slots // 4))


def row_buckets(slots: int) -> tuple[int, ...]:
    """Prefix row counts a plan is padded to: 2^k and 1.5 x 2^k from B / 8 up to B. A padding
    row is read on every step like a real one, and a first-come-first-served GRPO run holds
    6 to 11 prompts at once in 32 slots: halving steps padded 9 prompts to 16 rows."""
    return buckets_up_to(slots, max(1, slots // 8))


def plan_prefixes(table_BxM: np.ndarray, prompt_lens: Mapping[int, int],
                  positions: Mapping[int, int], page_size: int, window: int, chunk: int
                  ) -> PrefixPlan | None:
    """The cheapest split of a chunk of ``chunk`` steps whose slots ``prompt_lens`` (slot ->
    prompt length) hold the pages of ``table_BxM``, the slots that decode feeding their next
    token at ``positions`` (slot -> position); None when the plain ``window`` reads fewer
    entries (over ``CASCADE_SHARE``)."""
    B, M = table_BxM.shape
    S = page_size
    live = sorted(s for s in prompt_lens if table_BxM[s, 0] >= 0)
    if len(live) < 2:
        return None
    starts = {s: band_start(positions[s], S) for s in live if s in positions}
    top = min(prompt_lens[s] // S for s in live)  # a prefix page is never written in the chunk
    buckets = block_buckets(B, M * S, S)
    band = B * band_width(chunk, S)
    best: tuple[tuple[int, int], int, list[list[int]], int, int, int] | None = None
    for p in sorted({min((prompt_lens[s] - 1) // S, top) for s in live} - {0}):
        groups = _groups(table_BxM, live, p)
        blocks = bucket_for(max(1, sum(_blocks(start // S - p) for start in starts.values())),
                            buckets)
        for rows, width in _row_shapes(B):
            # A plan whose rows are as many as the live slots shares nothing.
            if _rows_needed(groups, width) > rows or rows >= len(live):
                continue
            # Entries read a step; then the padded queries a row batch computes.
            cost = (rows * p * S + blocks * BLOCK_PAGES * S + band, rows * width)
            if best is None or cost < best[0]:
                best = (cost, p, groups, rows, width, blocks)
    if best is None or best[0][0] > CASCADE_SHARE * B * window:
        return None
    _, p, groups, rows, width, blocks = best
    rows_RxP, members_RxG = _rows(table_BxM, groups, p, rows, width)
    blocks_NxQ, owners_N = _own_blocks(table_BxM, starts, p, blocks, S)
    band_BxW, band_start_B = _bands(table_BxM, starts, p, band_width(chunk, S) // S, S)
    return PrefixPlan(rows_RxP, members_RxG, blocks_NxQ, owners_N, band_BxW, band_start_B)


def _blocks(pages: int) -> int:
    return -(-pages // BLOCK_PAGES)


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


def _rows(table_BxM: np.ndarray, groups: Sequence[Sequence[int]], p: int, rows: int,
          width: int) -> tuple[np.ndarray, np.ndarray]:
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
    return rows_RxP, members_RxG


def _own_blocks(table_BxM: np.ndarray, starts: Mapping[int, int], p: int, blocks: int,
                page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each decoding slot's pages from ``p`` up to its band, ``BLOCK_PAGES`` a block (-1:
    padding), and each block's slot (the slot count: a padding block)."""
    B = table_BxM.shape[0]
    blocks_NxQ = np.full((blocks, BLOCK_PAGES), -1, np.int32)
    owners_N = np.full((blocks,), B, np.int32)
    n = 0
    for slot in sorted(starts):
        pages = table_BxM[slot, p:starts[slot] // page_size]
        for lo in range(0, len(pages), BLOCK_PAGES):
            part = pages[lo:lo + BLOCK_PAGES]
            blocks_NxQ[n, :len(part)] = part
            owners_N[n] = slot
            n += 1
    return blocks_NxQ, owners_N


def _bands(table_BxM: np.ndarray, starts: Mapping[int, int], p: int, pages: int,
           page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's band pages (-1 past its table) and first position: a decoding slot's from
    its ``band_start``, any other's from the prefix end (what it writes is never read)."""
    B, M = table_BxM.shape
    start_B = np.array([starts.get(b, p * page_size) for b in range(B)], np.int32)
    cols_BxW = start_B[:, None] // page_size + np.arange(pages)
    band_BxW = np.where(cols_BxW < M, np.take_along_axis(table_BxM, np.minimum(cols_BxW, M - 1),
                                                         axis=1), -1).astype(np.int32)
    return band_BxW, start_B


def warm_plans(slots: int, max_len: int, page_size: int, prompt_lengths: Sequence[int],
               windows: Sequence[int], chunk: int) -> list[PrefixPlan]:
    """A plan of padding rows for every shape ``plan_prefixes`` may take for a chunk whose
    live prompts are all ``n`` tokens long, for each ``n`` of ``prompt_lengths`` (the prompt
    buckets: prompts filling them), its slots at any positions: what warming up compiles."""
    S, W = page_size, band_width(chunk, page_size)
    buckets = block_buckets(slots, max_len, page_size)
    shapes = set()
    for n in sorted(set(prompt_lengths)):
        p = (n - 1) // S
        if not p:
            continue
        # (plain window, most blocks) for each position of the chunk's furthest slot.
        sizes = {(bucket_for(min(pos + chunk, max_len), windows),
                  bucket_for(max(1, slots * _blocks(band_start(pos, S) // S - p)), buckets))
                 for pos in range(n - 1, max_len)}
        for window, most in sizes:
            for blocks in (b for b in buckets if b <= most):  # the others nearer the prompt
                for rows, width in _row_shapes(slots):
                    cost = rows * p * S + blocks * BLOCK_PAGES * S + slots * W
                    if rows < slots and cost <= CASCADE_SHARE * slots * window:
                        shapes.add((p, rows, width, blocks))
    return [PrefixPlan(np.full((rows, p), -1, np.int32), np.full((rows, width), slots, np.int32),
                       np.full((blocks, BLOCK_PAGES), -1, np.int32),
                       np.full((blocks,), slots, np.int32), np.full((slots, W // S), -1, np.int32),
                       np.full((slots,), p * S, np.int32))
            for p, rows, width, blocks in sorted(shapes)]
