"""Device programs of the paged cache's shared prompt prefixes (``prefix``): a sequence starting
from prompt pages another holds (its group leader's, the prefix cache's), and a sequence's tail
re-prefilled over pages it shares.

Pure functions over (params, ``PagedKVCache`` carrying the slots' page table, ``SlotState``);
``SlotPages`` jits them with donation. Prefill is the dense sampler's own program
(``programs``); decode is too, run over a dense window gathered from the pages once per chunk,
or over the pages in place (``make_decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.inference.programs import (
    SlotState,
    first_token,
    in_passes,
    pass_rows,
    real_tokens,
)
from meshrl.inference.programs import make_decode as make_dense_decode
from meshrl.models import KVCache
from meshrl.models.cascade_attention import CascadeWindow, SharedPrefix
from meshrl.models.decoder import apply_head, forward
from meshrl.models.kv_cache import TRANSPOSED, with_layer_index
from meshrl.models.paged_attention import PagedKVCache, put_entries, slot_index, take_pages


def rows_view(cache: PagedKVCache, slots_N: jax.Array) -> PagedKVCache:
    """``cache`` with the page-table rows of ``slots_N`` (out of range: no pages, so a padding
    row's writes are dropped)."""
    return cache.replace(page_table=jnp.take(cache.page_table, slots_N, axis=0, mode="fill",
                                             fill_value=-1), slot_rows=False)


def copy_pages(cache: PagedKVCache, src_N: jax.Array, dst_N: jax.Array) -> PagedKVCache:
    """Page ``src_N[i]``'s keys and values copied to page ``dst_N[i]`` in every layer
    (out-of-range destinations are padding, dropped)."""
    src_N = jnp.clip(src_N, 0, cache.num_pages - 1)

    def cp(pool: jax.Array) -> jax.Array:
        if cache.is_stacked:
            return pool.at[with_layer_index(pool.shape[0], dst_N)].set(
                pool[with_layer_index(pool.shape[0], src_N)], mode="drop")
        return pool.at[dst_N].set(pool[src_N], mode="drop")

    def layers(pools: tuple[jax.Array, ...] | jax.Array | None,
               ) -> tuple[jax.Array, ...] | jax.Array | None:
        if pools is None:  # a combined pool's values are in its keys' array
            return None
        return cp(pools) if cache.is_stacked else tuple(map(cp, pools))

    return cache.replace(k=layers(cache.k), v=layers(cache.v))


def extend_rows(n: int, length: int, max_tokens: int) -> int:
    """Rows per pass of an extend call of ``n`` rows of ``length`` tokens: n / 8 (at least 1;
    a row's cost is its attention over its prompt's pages more than its few tokens), and for
    rows of several tokens (a prompt run after cached pages) no more than ``max_tokens``
    tokens a pass (at least one row), as a prefill pass (``programs.pass_rows``)."""
    rows = max(1, n // 8)
    if length == 1:  # group members: one token each
        return pass_rows(n, 1, rows)
    return pass_rows(n, length, min(rows * length, max(max_tokens, length)))


def make_extend(graphdef: nnx.GraphDef, max_len: int, max_tokens: int) -> Callable:
    """extend(params, cache, st, src_N, dst_N, tokens_NxL, pos_NxL, lens_N, slots_N, settings,
    n_rows).

    Starts sequences whose first prompt pages are already listed in their slots' page tables
    (a prompt group's leader's, or the prefix cache's): page ``src_N[i]`` is first copied to
    ``dst_N[i]`` (out of range: no copy; a group member's own page holding its last prompt
    token), then one forward of the rest of each prompt (``tokens_NxL`` at ``pos_NxL``, -1:
    padding) writes its entries over those pages and gives the logits after the prompt's
    ``lens_N`` tokens, which its first token is sampled from, under its own settings. The
    forward runs in passes of ``extend_rows`` rows (N / 8, of at most ``max_tokens`` tokens
    where a row holds several) over the first ``n_rows`` (traced) rows only
    (``programs.in_passes``)."""

    def extend(params: nnx.State, cache: PagedKVCache, st: SlotState, src_N: jax.Array,
               dst_N: jax.Array, tokens_NxL: jax.Array, pos_NxL: jax.Array, lens_N: jax.Array,
               slots_N: jax.Array, settings: dict[str, jax.Array], n_rows: jax.Array,
               ) -> tuple[PagedKVCache, SlotState, tuple]:
        table = cache.page_table

        def one_pass(carry: tuple[PagedKVCache, SlotState], rows: tuple) -> tuple[tuple, tuple]:
            cache, st = carry
            tokens_RxL, pos_RxL, lens_R, slots_R, settings_R = rows
            hidden_RxLxD, cache = forward(graphdef, params, tokens_RxL, pos_RxL,
                                          real_tokens(graphdef, params, pos_RxL >= 0),
                                          rows_view(cache, slots_R), return_hidden=True)
            last_R = jnp.clip(lens_R - 1 - pos_RxL[:, 0], 0, tokens_RxL.shape[1] - 1)
            last_RxD = jnp.take_along_axis(hidden_RxLxD, last_R[:, None, None], axis=1)[:, 0]
            st, out = first_token(st, apply_head(graphdef, params, last_RxD), lens_R, slots_R,
                                  settings_R, max_len)
            return (cache.replace(page_table=table, slot_rows=True), st), out

        (cache, st), out = in_passes(
            one_pass, (copy_pages(cache, src_N, dst_N), st),
            (tokens_NxL, pos_NxL, lens_N, slots_N, settings), n_rows,
            extend_rows(*tokens_NxL.shape, max_tokens))
        return cache, st, out

    return extend


def make_tail(graphdef: nnx.GraphDef, max_tokens: int) -> Callable:
    """tail(params, cache, tokens_NxL, pos_NxL, slots_N, n_rows) -> cache: write the keys and values
    of ``tokens_NxL`` at ``pos_NxL`` (-1: padding, dropped) into the pages of ``slots_N``,
    attending over those pages (causal by position): the part of a sequence after the prompt
    pages it shares, re-prefilled once those pages hold the new weights' entries. Passes of at
    most ``max_tokens`` tokens (``programs.pass_rows``) over the first ``n_rows`` (traced) rows
    only. It reads no slot state, so a sampler's sampling level does not key its programs."""

    def tail(params: nnx.State, cache: PagedKVCache, tokens_NxL: jax.Array, pos_NxL: jax.Array,
             slots_N: jax.Array, n_rows: jax.Array) -> PagedKVCache:
        table = cache.page_table

        def one_pass(cache: PagedKVCache, rows: tuple) -> tuple[PagedKVCache, tuple]:
            tokens_RxL, pos_RxL, slots_R = rows
            _, cache = forward(graphdef, params, tokens_RxL, pos_RxL,
                               real_tokens(graphdef, params, pos_RxL >= 0),
                               rows_view(cache, slots_R), return_hidden=True)
            return cache.replace(page_table=table, slot_rows=True), ()

        cache, _ = in_passes(one_pass, cache, (tokens_NxL, pos_NxL, slots_N), n_rows,
                             pass_rows(*tokens_NxL.shape, max_tokens))
        return cache

    return tail


# The ``window`` a chunk split over shared prefixes is called with: its ``SharedPrefix``
# shapes fix the program, so every plain window it stands in for shares one.
SPLIT_WINDOW = 0


def make_decode(graphdef: nnx.GraphDef, max_len: int, chunk: int,
                on_trace: Callable[[tuple[int, ...]], Any], routing: bool = False) -> Callable:
    """decode(params, cache, st, slots_R, window) on the paged cache (``slots_R``: every slot,
    in order): every slot's positions
    [0, window) gathered from its pages into a dense window (``dense_window``), the dense
    sampler's ``chunk`` steps over it, then the band of positions the chunk wrote scattered
    back into the pages (``put_band``). Attention over pages gathers each slot's pages on every
    step; a chunk over a gathered window reads them once, as the dense cache's window copy
    does. Only a band past the shared prompt pages is written back, so no shared page changes.

    A cache carrying ``shared`` (``SharedPrefix``) decodes over its ``CascadeWindow``
    instead (``cascade_window``, gathered ahead by a program of its own): each shared prefix
    gathered once for the slots listing it, each slot's older positions after it in blocks of
    whole pages, and its newest ones in the band the chunk writes, attention split over the
    three (``cascade_attention``); ``window`` is then ``SPLIT_WINDOW``, the shapes of
    ``shared`` fix the program.

    A ``combined`` pool (``sampler.paged_decode = in_place``) is decoded in place instead: the
    dense sampler's steps over the ``PagedKVCache`` itself, each step writing its entries into
    the pages and attending over them (the TPU kernel, or a gather per layer)."""
    dense = make_dense_decode(graphdef, max_len, chunk, on_trace, routing)

    def decode(params: nnx.State, cache: PagedKVCache, st: SlotState, slots_R: jax.Array,
               window: int) -> tuple[PagedKVCache, SlotState, tuple]:
        assert slots_R.shape == (cache.slots,), (slots_R.shape, cache.slots)  # paged_shapes
        if cache.combined:  # decoding in place: every step reads and writes the pages
            return dense(params, cache, st, slots_R, window=window)
        shared = cache.shared
        if shared is None:
            win, st_out, out = dense(params, dense_window(cache, window), st, slots_R,
                                     window=window)
            return put_band(cache, win, st.pos_B, chunk), st_out, out
        assert shared.window is not None, "gather the windows first (SlotPages.bind_plan)"
        win, st_out, out = dense(params, shared.window, st, slots_R,
                                 window=shared.window.max_len)
        cache = put_band(cache, win.suffix, st.pos_B, chunk, shared.band_BxW, win.offset_B)
        return cache.replace(shared=None), st_out, out

    return decode


def cascade_window(cache: PagedKVCache, shared: SharedPrefix) -> CascadeWindow:
    """The prefix rows, the blocks and each slot's band of ``shared`` gathered from the pages.

    Its own program (``SlotPages.bind_plan``): inside the decode program XLA:CPU ran these
    gathers 2-3x slower than alone (BUILD_NOTES.md, paged GRPO decode)."""
    # Rows, blocks and bands gather from the whole pool (``SlotPages.bind_decode``).
    assert cache.shards == 1, cache.shards
    valid_NxC = jnp.repeat(shared.blocks_NxQ >= 0, cache.page_size, axis=1)
    return CascadeWindow(gather_window(cache, shared.band_BxW),
                         gather_window(cache, shared.rows_RxP), shared.members_RxG,
                         shared.band_start_B, gather_window(cache, shared.blocks_NxQ),
                         shared.owners_N, valid_NxC)


def dense_window(cache: PagedKVCache, window: int) -> KVCache:
    """Positions [0, ``window``) of every slot as a dense ``KVCache`` (``gather_window``)."""
    return gather_window(cache, cache.page_table[:, :window // cache.page_size])


def gather_window(cache: PagedKVCache, table_BxM: jax.Array) -> KVCache:
    """The pages of each row of ``table_BxM`` side by side as a dense ``KVCache`` (keys
    [B, K, H, M x S], values [B, K, M x S, H]); a -1 entry gives some page's data (page 0, or
    the first of the row's shard), which attention masks (past the slot's position) and
    ``put_band`` never writes back."""
    assert not cache.combined, "a combined pool decodes in place (sampler.paged_decode)"
    S = cache.page_size
    table_BxM = jnp.clip(table_BxM, 0, cache.num_pages - 1)
    B, M = table_BxM.shape

    def gather(pool: jax.Array) -> jax.Array:  # [.., P, S, K, H] -> [.., B, T, K, H]
        # Per shard only where the rows are the slots in order (a shard's pages are its slots').
        x = take_pages(pool, table_BxM,
                       cache.shards if cache.slot_rows and B == cache.slots else 1)
        return x.reshape(*x.shape[:-5], B, M * S, *x.shape[-2:])

    def keys(pool: jax.Array) -> jax.Array:
        return jnp.moveaxis(gather(pool), -3, -1)

    def values(pool: jax.Array) -> jax.Array:
        return jnp.swapaxes(gather(pool), -2, -3)

    if cache.is_stacked:
        return KVCache(keys(cache.k), values(cache.v), TRANSPOSED)
    return KVCache(tuple(map(keys, cache.k)), tuple(map(values, cache.v)), TRANSPOSED)


def put_band(cache: PagedKVCache, win: KVCache, start_B: jax.Array, width: int,
             table_BxM: jax.Array | None = None, offset: int | jax.Array = 0) -> PagedKVCache:
    """``cache`` with positions [start_B[b], start_B[b] + width) of each slot b copied from the
    dense ``win`` into its pages (``KVCache.put_band``'s band, shifted left to fit the window);
    positions on no page of the slot are dropped. ``win`` holds positions [offset, offset + T)
    (``offset``: one for all slots or one a slot) on the pages of ``table_BxM`` (default: the
    page table's first columns)."""
    T = win.max_len
    width = min(width, T)
    if table_BxM is None:
        table_BxM = cache.page_table[:, :T // cache.page_size]
    idx_BxC = jnp.clip(start_B - offset, 0, T - width)[:, None] + jnp.arange(width)
    page_BxC, off_BxC = slot_index(table_BxM, idx_BxC, cache.page_size)

    def band_k(k_BxKxHxT: jax.Array) -> jax.Array:  # -> [B, C, K, H]
        return jnp.take_along_axis(k_BxKxHxT, idx_BxC[:, None, None, :], axis=3
                                   ).transpose(0, 3, 1, 2)

    def band_v(v_BxKxTxH: jax.Array) -> jax.Array:
        return jnp.take_along_axis(v_BxKxTxH, idx_BxC[:, None, :, None], axis=2
                                   ).transpose(0, 2, 1, 3)

    if cache.is_stacked:
        bands_k, bands_v = jax.vmap(band_k)(win.k), jax.vmap(band_v)(win.v)
    else:
        bands_k, bands_v = tuple(map(band_k, win.k)), tuple(map(band_v, win.v))
    return cache.replace(k=put_entries(cache.k, page_BxC, off_BxC, bands_k, cache.shards),
                         v=put_entries(cache.v, page_BxC, off_BxC, bands_v, cache.shards))
