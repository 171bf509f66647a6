"""Admission and re-prefill on the paged cache, with shared prompt prefixes.

Requests with identical prompt token ids (a GRPO group's G samples) form a group: the first
admitted (the leader) is prefilled as usual; every later member, admitted in the same round or
while a live sequence holds the prompt's pages under the current weights, lists the leader's
full prompt pages as its own (refcounted, ``PageAllocator.share``) and gets a copy of the page
holding the last prompt token, whose entry it writes again in a one-token forward that gives
its first token's logits (``paged_programs.make_extend``). The prompt runs through the model
once per group (per shard of a sharded pool, whose slots list only their own shard's pages),
and its pages are held once. With a prefix cache (``prefix_cache``), a leader lists the cached
pages of its prompt's longest cached prefix and runs only the rest of its prompt. Pages are
reserved in admission order (priority, then arrival): the first request no shard of the pool
can hold stops admission until pages return.

After a weight update every live sequence is re-prefilled under the new weights. A group's
shared pages are re-prefilled once, by the first live member's full re-prefill; the other
members re-prefill only their tail (the positions after the shared pages) over those pages
(``paged_programs.make_tail``).

Functions over a ``Sampler`` (duck-typed: this module sits below ``sampler``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshrl.inference import admission
from meshrl.inference.paged_programs import SPLIT_WINDOW
from meshrl.inference.prefix_plan import warm_plans
from meshrl.inference.requests import Completion, Request, slot_settings
from meshrl.utils.buckets import bucket_for

Admitted = list[tuple[tuple[Any, ...], list[Completion]]]
Row = tuple[int, Request, int, int, int]  # slot, request, first position to run, page copy


def admit(sampler: Any, free: Sequence[int], ending: Sequence[int]) -> Admitted:
    """``Sampler._admit`` on the paged cache: reserve pages, prefill each group's leader (only
    the part past its cached prefix, if any), start the other members from the leader's pages."""
    pages, queue = sampler.pages, sampler._queue
    pages.release(ending)
    # A live sequence whose prompt pages hold this epoch's entries leads its prompt's later
    # samples too: a group admitted over several rounds (slots free up one by one) runs its
    # prompt once, not once per round.
    # With a sharded pool a slot lists only its own shard's pages: a group leads per shard.
    shard = pages.alloc.shard_of_slot
    leaders = {(tuple(p), shard(s)): s for s, (p, v) in pages.owner.items()
               if v == pages.epoch}
    solo: list[tuple[int, Request]] = []
    cached: list[Row] = []
    members: list[Row] = []
    table, no_page = pages.alloc.table, pages.num_pages
    free = list(free)
    while free and queue:
        r = queue.head()
        s, lead = _place(pages, free, r, leaders)
        if s is None:
            break
        free.remove(s)
        queue.popleft()
        if lead is not None:
            k = pages.shared_pages(r)
            members.append((s, r, len(r.prompt_ids) - 1, table[lead, k], table[s, k]))
            continue
        leaders[(tuple(r.prompt_ids), shard(s))] = s
        start = pages.start.pop(s, 0)
        if start:
            cached.append((s, r, start, no_page, no_page))
        else:
            solo.append((s, r))
    admitted = admission.prefill_admitted(sampler, solo)
    pages.prompt_prefills += len(solo)
    # Leaders first: a member copies its leader's page, which a cached leader's call writes.
    by_length: dict[int, list[Row]] = collections.defaultdict(list)
    for row in cached:
        by_length[bucket_for(len(row[1].prompt_ids) - row[2], sampler.prompt_buckets)].append(row)
    step = sampler.cfg.slots
    for length, rows in [*by_length.items(), (1, members)]:
        for lo in range(0, len(rows), step):
            admitted.append(_start(sampler, rows[lo:lo + step], length))
    pages.fanouts += len(members)
    return admitted


def _place(pages: Any, free: Sequence[int], request: Request,
           leaders: dict[tuple[tuple[int, ...], int], int]) -> tuple[int | None, int | None]:
    """(slot, leader) for ``request``, its pages reserved: the first free slot of a shard where
    its prompt already leads (it lists the leader's pages), else of the first shard whose pages
    can hold it; (None, None) when none can. One pool (one shard): the first free slot. A shard
    tried and found short may have dropped cached prefix pages making room."""
    shard, key = pages.alloc.shard_of_slot, tuple(request.prompt_ids)
    firsts: dict[int, int] = {}
    for s in free:
        firsts.setdefault(shard(s), s)
    for d in sorted(firsts, key=lambda d: ((key, d) not in leaders, firsts[d])):
        lead = leaders.get((key, d))
        if pages.reserve(firsts[d], request, lead):
            return firsts[d], lead
    return None, None


def _start(sampler: Any, rows: Sequence[Row], length: int,
           ) -> tuple[tuple[Any, ...], list[Completion]]:
    """One extend call (``slots`` rows, ``rows`` first) over ``length`` prompt positions: each
    (slot, request, start, src page, dst page) row copies its page, runs its prompt from
    ``start`` and samples its first token."""
    pages, n = sampler.pages, sampler.cfg.slots
    src_N = np.zeros((n,), np.int32)
    dst_N = np.full((n,), pages.num_pages, np.int32)  # out of range: padding rows copy nothing
    tokens_NxL = np.zeros((n, length), np.int32)
    pos_NxL = np.full((n, length), -1, np.int32)  # -1: padding, never written
    lens_N, slots_N = np.ones((n,), np.int32), np.full((n,), sampler.cfg.slots, np.int32)
    for i, (s, r, start, src, dst) in enumerate(rows):
        src_N[i], dst_N[i], lens_N[i], slots_N[i] = src, dst, len(r.prompt_ids), s
        tokens_NxL[i, :len(r.prompt_ids) - start] = r.prompt_ids[start:]
        pos_NxL[i, :len(r.prompt_ids) - start] = np.arange(start, len(r.prompt_ids))
    reqs = [r for _, r, *_ in rows]
    sampler.cache, sampler.state, out = pages.extend(
        sampler.params, sampler._bound(), sampler.state, src_N, dst_N, tokens_NxL, pos_NxL,
        lens_N, slots_N, slot_settings(reqs, n, sampler.cfg), np.int32(len(rows)))
    comps = [Completion(r, [-1], [0.0], [0.0], [sampler.version]) for r in reqs]
    for (s, *_), c in zip(rows, comps):
        sampler.slots.out[s] = c
    return out, comps


def recompute(sampler: Any, live: Sequence[tuple[int, Completion]]) -> None:
    """``Sampler._recompute`` on the paged cache: one full re-prefill per group of sequences
    listing the same shared prompt pages (and per sequence sharing none), then the tails."""
    pages = sampler.pages
    table, size = pages.alloc.table, sampler.cfg.page_size
    first: set[tuple[int, ...]] = set()
    full: list[tuple[int, Completion]] = []
    tails: dict[int, list[tuple[int, list[int], int]]] = collections.defaultdict(list)
    for s, c in live:
        if s in pages.owner:  # re-prefilled now: its prompt pages hold this epoch's entries
            pages.owner[s] = (c.request.prompt_ids, pages.epoch)
        k = pages.shared_pages(c.request)
        key = tuple(int(p) for p in table[s, :k])
        seq = list(c.request.prompt_ids) + c.tokens[:-1]
        # A released slot (-1 pages: its sequence ends in the round in flight) writes nothing
        # that matters: never group it.
        shared = bool(key) and min(key) >= 0
        if shared and key in first:
            tails[bucket_for(len(seq) - k * size, sampler.recompute_buckets)].append(
                (s, seq, k * size))
            continue
        full.append((s, c))
        if shared:
            first.add(key)
    admission.reprefill(sampler, full)
    pages.prompt_prefills += len(full)
    step = sampler.cfg.slots
    for length, group in tails.items():
        for lo in range(0, len(group), step):
            _tail(sampler, group[lo:lo + step], length)
    pages.tail_prefills += sum(map(len, tails.values()))


def _tail(sampler: Any, part: Sequence[tuple[int, list[int], int]], length: int) -> None:
    """One tail call (``slots`` rows, ``part`` first): each (slot, sequence, start) writes
    positions [start, len(sequence))."""
    n = sampler.cfg.slots
    tokens_NxL = np.zeros((n, length), np.int32)
    pos_NxL = np.full((n, length), -1, np.int32)  # -1: padding, never written
    slots_N = np.full((n,), sampler.cfg.slots, np.int32)
    for i, (s, seq, start) in enumerate(part):
        tokens_NxL[i, :len(seq) - start] = seq[start:]
        pos_NxL[i, :len(seq) - start] = np.arange(start, len(seq))
        slots_N[i] = s
    sampler.cache = sampler.pages.tail(sampler.params, sampler._bound(), tokens_NxL, pos_NxL,
                                       slots_N, np.int32(len(part)))


def warm_up(sampler: Any, recompute: bool) -> None:
    """Compile the extend (group members; with a prefix cache, every prompt bucket too) and,
    with ``recompute``, the tail variants on padding rows; then the decode chunks split over
    shared prompts (``prefix_plan.warm_plans``: prompts filling their bucket) on padding rows,
    unless the decode runs in place."""
    cached = sampler.prompt_buckets if sampler.pages.prefix_cache else ()
    for length in (1, *cached):
        _start(sampler, [], length)
    for length in sampler.recompute_buckets if recompute else ():
        _tail(sampler, [], length)
    pages, cfg = sampler.pages, sampler.cfg
    if pages.in_place or pages.shards > 1:  # no split chunks (``SlotPages.bind_decode``)
        return
    for plan in warm_plans(cfg.slots, cfg.max_len, cfg.page_size, sampler.prompt_buckets,
                           sampler.window_buckets, cfg.decode_chunk):
        sampler.cache, sampler.state, _ = sampler._decode(
            sampler.params, pages.bind_plan(sampler.cache, plan), sampler.state,
            np.arange(cfg.slots, dtype=np.int32), window=SPLIT_WINDOW)
