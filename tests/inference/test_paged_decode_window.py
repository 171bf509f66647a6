"""The paged decode's dense window: gathered from the pages, and its band written back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import ModelConfig
from meshrl.inference.paged_programs import dense_window, gather_window, put_band
from meshrl.models.paged_attention import PagedKVCache

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=64)
SIZE, PAGES = 4, 8
# Slots 0 and 1 share page 0 (a prompt prefix); slot 2 holds no pages (a free slot).
TABLE = np.array([[0, 1, 2, -1], [0, 3, 4, -1], [-1, -1, -1, -1]], np.int32)


def _cache(stacked: bool) -> PagedKVCache:
    cache = PagedKVCache.init(CFG, PAGES, SIZE, stacked=stacked)
    rng = np.random.default_rng(0)

    def fill(x: jnp.ndarray) -> jnp.ndarray:
        return jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    if stacked:
        return cache.replace(k=fill(cache.k), v=fill(cache.v), page_table=jnp.asarray(TABLE))
    return cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)),
                         page_table=jnp.asarray(TABLE))


def _pool(cache: PagedKVCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(cache.k[layer]), np.asarray(cache.v[layer])


def _assert_only_written(after, before: list, bands: dict[int, slice]) -> None:
    """Every layer's pool holds 7.0 at ``bands`` ({page: offsets}) and ``before``'s values
    everywhere else."""
    for layer in range(CFG.num_layers):
        for got, was in zip(_pool(after, layer), before[layer], strict=True):
            written = np.zeros(got.shape[:2], bool)
            for page, offsets in bands.items():
                written[page, offsets] = True
            np.testing.assert_array_equal(got[written], 7.0)
            np.testing.assert_array_equal(got[~written], was[~written])


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_dense_window_holds_each_slots_positions_from_its_pages(stacked):
    cache = _cache(stacked)

    win = dense_window(cache, 3 * SIZE)

    k_pool, v_pool = _pool(cache, 1)
    keys_BxKxHxT, values_BxKxTxH = np.asarray(win.k[1]), np.asarray(win.v[1])
    assert keys_BxKxHxT.shape == (3, 1, 8, 3 * SIZE), keys_BxKxHxT.shape
    for b in range(2):
        for t in range(3 * SIZE):
            page, off = TABLE[b, t // SIZE], t % SIZE
            np.testing.assert_array_equal(keys_BxKxHxT[b, :, :, t], k_pool[page, off])
            np.testing.assert_array_equal(values_BxKxTxH[b, :, t], v_pool[page, off])


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_put_band_writes_only_the_band_into_the_slots_own_pages(stacked):
    cache = _cache(stacked)
    before = [_pool(cache, i) for i in range(CFG.num_layers)]
    win = dense_window(cache, 3 * SIZE)
    marked = win.replace(k=jnp.full_like(jnp.asarray(win.k), 7.0) if stacked else
                         tuple(jnp.full_like(k, 7.0) for k in win.k),
                         v=jnp.full_like(jnp.asarray(win.v), 7.0) if stacked else
                         tuple(jnp.full_like(v, 7.0) for v in win.v))
    # Slot 0 wrote positions 5-6, slot 1 positions 10-11 (the band's end: the window's), slot 2
    # (no pages) position 0: only the first two bands may land, in pages 1 and 4.
    start_B = jnp.asarray([5, 10, 0], jnp.int32)

    after = put_band(cache, marked, start_B, 2)

    _assert_only_written(after, before, {1: slice(1, 3), 4: slice(2, 4)})


def test_put_band_of_a_suffix_window_writes_its_positions_into_the_suffix_pages():
    cache = _cache(False)
    before = [_pool(cache, i) for i in range(CFG.num_layers)]
    # Suffix windows from position 4 (one shared page): slot 0's pages 1-2, slot 1's 3-4.
    suffix_BxM = jnp.asarray(TABLE[:, 1:3])
    win = gather_window(cache, suffix_BxM)
    marked = win.replace(k=tuple(jnp.full_like(k, 7.0) for k in win.k),
                         v=tuple(jnp.full_like(v, 7.0) for v in win.v))

    # Slot 0 wrote positions 5-6 (suffix entries 1-2), slot 1 positions 9-10 (entries 5-6).
    after = put_band(cache, marked, jnp.asarray([5, 9, 0], jnp.int32), 2, suffix_BxM, SIZE)

    _assert_only_written(after, before, {1: slice(1, 3), 4: slice(1, 3)})


def test_put_band_with_a_start_a_slot_writes_each_slots_positions_into_its_own_pages():
    cache = _cache(False)
    before = [_pool(cache, i) for i in range(CFG.num_layers)]
    # Bands of two pages from each slot's own page: slot 0 from position 4 (pages 1-2), slot 1
    # from position 8 (page 4, then none), slot 2 (no pages) from 4.
    band_BxW = jnp.asarray([[1, 2], [4, -1], [-1, -1]], jnp.int32)
    offset_B = jnp.asarray([4, 8, 4], jnp.int32)
    win = gather_window(cache, band_BxW)
    marked = win.replace(k=tuple(jnp.full_like(k, 7.0) for k in win.k),
                         v=tuple(jnp.full_like(v, 7.0) for v in win.v))

    # Slot 0 wrote positions 5-6 (band entries 1-2), slot 1 positions 9-10 (entries 1-2).
    after = put_band(cache, marked, jnp.asarray([5, 9, 4], jnp.int32), 2, band_BxW, offset_B)

    _assert_only_written(after, before, {1: slice(1, 3), 4: slice(1, 3)})
