"""Compiling a sampler's programs ahead of a run: every variant a run may reach, run for real
on padding rows (their writes are dropped) and inactive slots, so nothing in the cache that
matters changes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from meshrl.inference import prefix


def warm_up(sampler: Any, recompute: bool) -> None:
    """Run each prefill (prompt bucket; with ``recompute`` also the re-prefill lengths),
    paged-cache group start (``prefix``) and decode (window x row bucket) variant of an idle
    ``Sampler``."""
    for p in sampler.prompt_buckets:
        sampler._run_prefill([], [], [], p, True)
    if recompute:
        for p in sampler.recompute_buckets:
            sampler._run_prefill([], [], [], p, False)
    if sampler.pages:
        prefix.warm_up(sampler, recompute)
    S = sampler.cfg.slots
    for w in sampler.window_buckets:
        for rows in sampler.row_buckets:  # padding rows only, or every (inactive) slot
            slots_R = np.arange(S, dtype=np.int32) if rows == S else np.full((rows,), S, np.int32)
            sampler.cache, sampler.state, _ = sampler._decode(
                sampler.params, sampler._bound(), sampler.state, slots_R, window=w)
    jax.block_until_ready(sampler.cache)
