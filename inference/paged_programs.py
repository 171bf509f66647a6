"""Device programs of the paged cache's shared prompt prefixes (``prefix``): a sequence starting
from prompt pages another holds (its group leader's, the prefix cache's), and a sequence's tail
re-prefilled over pages it shares.

Pure functions over (params, ``PagedKVCache`` carrying the slots' page table, ``SlotState``);
``SlotPages`` jits them with donation. Prefill and decode proper are the dense sampler's own
programs (``programs``): the paged cache is a drop-in for them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.inference.programs import SlotState, first_token
from meshrl.models.decoder import apply_head, forward
from meshrl.models.paged_attention import PagedKVCache


def rows_view(cache: PagedKVCache, slots_N: jax.Array) -> PagedKVCache:
    """``cache`` with the page-table rows of ``slots_N`` (out of range: no pages, so a padding
    row's writes are dropped)."""
    return cache.replace(page_table=jnp.take(cache.page_table, slots_N, axis=0, mode="fill",
                                             fill_value=-1))


def copy_pages(cache: PagedKVCache, src_N: jax.Array, dst_N: jax.Array) -> PagedKVCache:
    """Page ``src_N[i]``'s keys and values copied to page ``dst_N[i]`` in every layer
    (out-of-range destinations are padding, dropped)."""
    src_N = jnp.clip(src_N, 0, cache.num_pages - 1)

    def cp(pool: jax.Array) -> jax.Array:
        if cache.is_stacked:
            return pool.at[:, dst_N].set(pool[:, src_N], mode="drop")
        return pool.at[dst_N].set(pool[src_N], mode="drop")

    if cache.is_stacked:
        return cache.replace(k=cp(cache.k), v=cp(cache.v))
    return cache.replace(k=tuple(map(cp, cache.k)), v=tuple(map(cp, cache.v)))


def make_extend(graphdef: nnx.GraphDef, max_len: int) -> Callable:
    """extend(params, cache, st, src_N, dst_N, tokens_NxL, pos_NxL, lens_N, slots_N, settings).

    Starts sequences whose first prompt pages are already listed in their slots' page tables
    (a prompt group's leader's, or the prefix cache's): page ``src_N[i]`` is first copied to
    ``dst_N[i]`` (out of range: no copy; a group member's own page holding its last prompt
    token), then one forward of the rest of each prompt (``tokens_NxL`` at ``pos_NxL``, -1:
    padding) writes its entries over those pages and gives the logits after the prompt's
    ``lens_N`` tokens, which its first token is sampled from, under its own settings."""

    def extend(params: nnx.State, cache: PagedKVCache, st: SlotState, src_N: jax.Array,
               dst_N: jax.Array, tokens_NxL: jax.Array, pos_NxL: jax.Array, lens_N: jax.Array,
               slots_N: jax.Array, settings: dict[str, jax.Array],
               ) -> tuple[PagedKVCache, SlotState, tuple]:
        table = cache.page_table
        cache = copy_pages(cache, src_N, dst_N)
        hidden_NxLxD, cache = forward(graphdef, params, tokens_NxL, pos_NxL, None,
                                      rows_view(cache, slots_N), return_hidden=True)
        last_N = jnp.clip(lens_N - 1 - pos_NxL[:, 0], 0, tokens_NxL.shape[1] - 1)
        last_NxD = jnp.take_along_axis(hidden_NxLxD, last_N[:, None, None], axis=1)[:, 0]
        st, out = first_token(st, apply_head(graphdef, params, last_NxD), lens_N, slots_N,
                              settings, max_len)
        return cache.replace(page_table=table), st, out

    return extend


def make_tail(graphdef: nnx.GraphDef) -> Callable:
    """tail(params, cache, st, tokens_NxL, pos_NxL, slots_N): write the keys and values of
    ``tokens_NxL`` at ``pos_NxL`` (-1: padding, dropped) into the pages of ``slots_N``,
    attending over those pages (causal by position): the part of a sequence after the prompt
    pages it shares, re-prefilled once those pages hold the new weights' entries."""

    def tail(params: nnx.State, cache: PagedKVCache, st: SlotState, tokens_NxL: jax.Array,
             pos_NxL: jax.Array, slots_N: jax.Array) -> tuple[PagedKVCache, SlotState]:
        table = cache.page_table
        _, cache = forward(graphdef, params, tokens_NxL, pos_NxL, None,
                           rows_view(cache, slots_N), return_hidden=True)
        return cache.replace(page_table=table), st

    return tail
