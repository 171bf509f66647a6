"""Free the sampler's device memory while it is dead, and allocate it again before the next decode.

A weight update marks every live slot stale and the next round re-prefills them from position
0 (``Sampler._install``), so across a weight update nothing in the cache is ever read again. A
colocated RL run (``rl.placement = "colocated"``) therefore deletes the cache buffers before the
train step and allocates a zero cache after the handoff: the train step then has the cache's
HBM, the way colocated RL frameworks offload the rollout engine's cache between phases. The
sampler's weights are dead across the update too (the handoff installs fresh copies of the new
version, never reusing the old buffers), so ``release(sampler, weights=True)`` deletes them as
well (``rl.release_sampler_weights``) and the handoff refills them. With LoRA the frozen base
the sampler keeps for adapter-only handoffs (``SamplerWeights``) stays: only the merged params
go, and the next handoff merges them again.

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
    """Whether the KV cache is released (the weights may be, too: ``sampler.params is None``)."""
    return sampler.cache is None


def release(sampler: Any, weights: bool = False) -> None:
    """Delete the KV cache buffers (and with ``weights`` the sampler's params, until the next
    ``update_weights`` or ``load_weights``); every live slot re-prefills after ``restore``. A
    no-op for what is released already."""
    with sampler._lock:
        if sampler.cache is not None:
            # The last dispatched call writes the cache: let it finish before its buffers go.
            jax.block_until_ready(sampler.cache)
            _delete(sampler.cache)
            sampler.cache = None
            sampler.slots.mark_stale()
            if sampler.pages:  # no page written before this holds its entries any more
                sampler.pages.new_epoch()
        if weights and sampler.params is not None:
            jax.block_until_ready(sampler.params)  # a dispatched program may still read them
            _delete(sampler.params, keep=sampler.weights.kept_base())
            sampler.params = None


def _delete(tree: Any, keep: Any = None) -> None:
    """Delete ``tree``'s buffers now (not when the last reference goes), except those that are
    leaves of ``keep`` too."""
    kept = {id(x) for x in jax.tree.leaves(keep)}
    for leaf in jax.tree.leaves(tree):
        if id(leaf) not in kept:
            leaf.delete()


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
