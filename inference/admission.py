"""Admission on the dense cache: queued requests prefilled into free slots by prompt bucket,
and in-flight sequences re-prefilled after a weight update. The paged cache's group-aware
versions live in ``prefix``; both dispatch through ``Sampler._run_prefill``."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from meshrl.inference.requests import Completion, Request
from meshrl.utils.buckets import bucket_for

Admitted = list[tuple[tuple[Any, ...], list[Completion]]]


def prefill_admitted(sampler: Any, picked: Sequence[tuple[int, Request]]) -> Admitted:
    """Prefill each (slot, request) picked, by prompt bucket; returns each prefill's pending
    outputs with the completions it starts (first token a placeholder until read back)."""
    by_bucket: dict[int, list[tuple[int, Request]]] = collections.defaultdict(list)
    for s, r in picked:
        by_bucket[bucket_for(len(r.prompt_ids), sampler.prompt_buckets)].append((s, r))
    step = sampler.cfg.slots
    admitted = []
    for bucket, group in by_bucket.items():
        for lo in range(0, len(group), step):
            part = group[lo:lo + step]
            reqs = [r for _, r in part]
            out = sampler._run_prefill([r.prompt_ids for r in reqs], [s for s, _ in part], reqs,
                                       bucket, True)
            comps = [Completion(r, [-1], [0.0], [0.0], [sampler.version]) for r in reqs]
            for (s, _), c in zip(part, comps):
                sampler.slots.out[s] = c
            admitted.append((out, comps))
    return admitted


def reprefill(sampler: Any, live: Sequence[tuple[int, Completion]]) -> None:
    """Re-prefill each (slot, completion)'s prompt + tokens but the last (not yet in the
    cache), from position 0, under the current weights."""
    by_bucket: dict[int, list[tuple[int, list[int]]]] = collections.defaultdict(list)
    for s, c in live:
        seq = list(c.request.prompt_ids) + c.tokens[:-1]
        by_bucket[bucket_for(len(seq), sampler.recompute_buckets)].append((s, seq))
    step = sampler.cfg.slots
    for bucket, group in by_bucket.items():
        for lo in range(0, len(group), step):
            part = group[lo:lo + step]
            sampler._run_prefill([p for _, p in part], [s for s, _ in part], [], bucket, False)
