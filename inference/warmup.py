"""Compiling a sampler's programs ahead of a run: every variant a run may reach, run for real
on padding rows (their writes are dropped) and inactive slots, so nothing in the cache that
matters changes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from meshrl.inference import prefix


def warm_up(sampler: Any, recompute: bool) -> None:
    """Run each prefill (prompt x insert bucket; with ``recompute`` also the re-prefill
    variants), paged-cache group start (``prefix``), decode (window x row shape) and slot-swap variant of an idle ``Sampler``."""
    for p in sampler.prompt_buckets:
        for n in sampler.insert_buckets:
            sampler._run_prefill([], [], [], p, n, True)
    if recompute:
        for p in sampler.recompute_buckets:
            for n in sampler.insert_buckets:
                sampler._run_prefill([], [], [], p, n, False)
    if sampler.pages:
        prefix.warm_up(sampler, recompute)
    for w in sampler.window_buckets:
        for lo, rows in sampler.decode_shapes:
            sampler.cache, sampler.state, _ = sampler._decode(
                sampler.params, sampler._bound(), sampler.state, window=w, rows=rows, lo=lo)
    if len(sampler.row_buckets) > 1:
        for m in sampler.swap_buckets:
            pad_M = np.full((m,), sampler.cfg.slots, np.int32)
            sampler.cache, sampler.state = sampler._swap(sampler.cache, sampler.state, pad_M,
                                                         pad_M)
    jax.block_until_ready(sampler.cache)
