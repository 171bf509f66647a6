"""The decoder's forward over a ``PagedKVCache`` (the sampler's paged path) against the dense
``KVCache``, in both layer layouts, and the paged cache's window."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import ModelConfig
from meshrl.models import KVCache, create_model, forward, split_model
from meshrl.models.paged_attention import PagedKVCache

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)
B, T, S = 2, 32, 8  # slots, positions per slot, page size


def _paged(cfg, table):
    pool = PagedKVCache.init(cfg, B * T // S + 1, S, stacked=cfg.scan_layers)
    return pool.replace(page_table=jnp.asarray(table, jnp.int32))


# The default run checks paged decode against the dense cache through the sampler
# (tests/inference/test_paged_sampler.py); this checks the forward itself.
@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_prefill_then_decode_over_pages_equals_dense_cache(scan_layers):
    cfg = dataclasses.replace(CFG, scan_layers=scan_layers)
    graphdef, params = split_model(create_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    prompt_BxP = jnp.asarray(rng.integers(1, 64, (B, 6)), jnp.int32)
    pos_BxP = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (B, 6))
    # Pages out of order and interleaved between the slots; page 0 belongs to no one.
    table = np.array([[3, 1, 7, 5], [2, 8, 4, 6]])
    dense = KVCache.init(cfg, B, T)
    tmp = KVCache.init(cfg, B, 6)
    _, tmp = jax.jit(lambda c: forward(graphdef, params, prompt_BxP, pos_BxP, None, c))(tmp)
    dense = dense.put_slots(tmp, jnp.arange(B))
    paged = _paged(cfg, table).put_slots(tmp, jnp.arange(B))
    tok_B = jnp.asarray([5, 9], jnp.int32)
    step = jax.jit(lambda c, t, p: forward(graphdef, params, t[:, None], p[:, None], None, c))
    for pos in range(6, 10):  # crosses from the first page into the second
        p_B = jnp.full((B,), pos, jnp.int32)
        want, dense = step(dense, tok_B, p_B)
        got, paged = step(paged, tok_B, p_B)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        tok_B = jnp.argmax(want[:, 0], axis=-1).astype(jnp.int32)
    assert paged.is_stacked == scan_layers
    assert not np.asarray(paged.layer(0)[0][0]).any()  # the unlisted page was never written


def test_window_lists_the_first_pages_of_its_rows_and_put_band_restores_the_table():
    cache = _paged(CFG, np.arange(8).reshape(B, 4))

    win = cache.window(16, rows=1, lo=1)
    back = cache.put_band(win, jnp.zeros((1,), jnp.int32), 4, lo=1)

    np.testing.assert_array_equal(np.asarray(win.page_table), [[4, 5]])
    assert win.max_len == 16 and win.k[0] is cache.k[0]  # the same pool: nothing copied
    np.testing.assert_array_equal(np.asarray(back.page_table), np.asarray(cache.page_table))


def test_window_not_whole_pages_is_rejected():
    with pytest.raises(ValueError, match="paged cache window 12: must be a multiple of the "
                                         "page size 8"):
        _paged(CFG, np.zeros((B, 4))).window(12)
