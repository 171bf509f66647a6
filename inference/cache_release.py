"""Free the sampler's KV cache while it is dead, and allocate it again before the next decode.

A weight update marks every live slot stale and the next round re-prefills them from position
0 (``Sampler._install``), so across a weight update nothing in the cache is ever read again. A
colocated RL run (``rl.placement = "colocated"``) therefore deletes the cache buffers before the
train step and allocates a zero cache after the handoff: the train step then has the cache's
HBM, the way colocated RL frameworks offload the rollout engine's cache between phases.

Releasing keeps every sequence: the round in flight stays queued for read-back, each live slot
is marked stale (its prompt and tokens so far are re-prefilled into the new cache), and queued
requests stay queued. Both functions take the sampler's lock; the caller makes sure no decode
runs in between (``AsyncSampler.release_cache`` pauses its loop until ``restore_cache``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax

from meshrl.models import KVCache

# One jitted zero-cache program per sampler: a restore every RL step must not retrace it.
_INIT: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()


def new_cache(sampler: Any) -> Any:
    """A zero KV cache (or page pool) in the sampler's shardings."""
    if sampler.pages:
        return sampler.pages.init_cache()
    return dense_cache(sampler)


def dense_cache(sampler: Any) -> Any:
    """An empty ``slots x max_len`` dense cache laid out and sharded as the sampler's own."""
    init = _INIT.get(sampler)
    if init is None:
        m, c, sh = sampler.model_cfg, sampler.cfg, sampler._cache_sh
        init = _INIT[sampler] = jax.jit(
            lambda: KVCache.init(m, c.slots, c.max_len, c.dtype, sh.key_layout), out_shardings=sh)
    return init()


def is_released(sampler: Any) -> bool:
    return sampler.cache is None


def release(sampler: Any) -> None:
    """Delete the KV cache buffers; every live slot re-prefills after ``restore``. A no-op
    when already released."""
    with sampler._lock:
        if sampler.cache is None:
            return
        # The last dispatched call writes the cache: let it finish before its buffers go.
        jax.block_until_ready(sampler.cache)
        for leaf in jax.tree.leaves(sampler.cache):
            leaf.delete()
        sampler.cache = None
        sampler.slots.mark_stale()
        if sampler.pages:  # the prefix cache's pages lived in the pool
            sampler.pages.new_version(sampler.version)


def restore(sampler: Any) -> None:
    """Allocate a zero KV cache again (the next round re-prefills the live slots into it). A
    no-op when the cache is there."""
    with sampler._lock:
        if sampler.cache is None:
            sampler.cache = new_cache(sampler)


def check_cache(sampler: Any) -> None:
    """Raise when the sampler would run a program on a released cache."""
    if sampler.cache is None:
        raise RuntimeError("the sampler's KV cache is released: call restore_cache() before "
                           "it decodes again")
