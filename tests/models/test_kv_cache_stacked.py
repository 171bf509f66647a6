"""The layer-stacked KV cache of ``scan_layers``: same contents as the per-layer one under
every cache operation, same decode, and no whole-cache copy per forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.configs.schema import ModelConfig
from meshrl.models import KVCache, forward
from meshrl.models.kv_cache import TIME_MAJOR
from meshrl.tests.models.layer_stacking import unrolled_and_scanned
from meshrl.tests.trees import assert_trees_close

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)
SCAN = dataclasses.replace(CFG, scan_layers=True)
RTOL, ATOL = 1e-5, 1e-5  # float32, the same math (scan vs unrolled layers)


def _random_cache(batch: int, max_len: int, seed: int = 0) -> KVCache:
    rng = np.random.default_rng(seed)
    empty = KVCache.init(CFG, batch, max_len)
    return KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
                         for k in empty.k),
                   tuple(jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
                         for v in empty.v))


def _assert_same(stacked: KVCache, per_layer: KVCache) -> None:
    assert stacked.is_stacked and not per_layer.is_stacked
    np.testing.assert_array_equal(stacked.k, np.stack(per_layer.k))
    np.testing.assert_array_equal(stacked.v, np.stack(per_layer.v))


def test_init_and_shardings_follow_scan_layers():
    cache = KVCache.init(SCAN, batch=4, max_len=16)

    assert cache.is_stacked and not KVCache.init(CFG, 4, 16).is_stacked
    assert cache.k.shape == (3, 4, 2, 8, 16) and cache.v.shape == (3, 4, 2, 16, 8)
    assert (cache.slots, cache.max_len) == (4, 16)
    assert cache.layer(1)[0].shape == KVCache.shapes(SCAN, 4, 16)[0]


def test_every_cache_operation_gives_the_same_entries_in_both_layouts():
    full, part = _random_cache(6, 16, seed=1), _random_cache(3, 8, seed=2)
    s_full, s_part = full.stacked(), part.stacked()
    start_B, slots_N = jnp.array([0, 3, 7]), jnp.array([5, 6, 1])  # 6: dropped
    rows_R = jnp.array([4, 0, 6])  # 6: a padding row (read clipped, written nowhere)

    _assert_same(s_full.window(8, rows_R), full.window(8, rows_R))
    _assert_same(s_full.put_band(s_part, start_B, 3, rows_R),
                 full.put_band(part, start_B, 3, rows_R))
    _assert_same(s_full.put_slots(s_part, slots_N), full.put_slots(part, slots_N))
    # Keys stored like values (the TPU layout) take the values' scatter.
    t_full, t_part = (c.with_key_layout(TIME_MAJOR) for c in (full, part))
    _assert_same(t_full.stacked().put_slots(t_part.stacked(), slots_N),
                 t_full.put_slots(t_part, slots_N))
    assert s_full.unstacked().stacked().k.shape == s_full.k.shape


def _prefill_then_decode(graphdef, params, cache: KVCache, ids_BxL: np.ndarray, prompt: int
                         ) -> tuple[list[np.ndarray], KVCache]:
    step = jax.jit(forward, static_argnums=0, donate_argnames=("cache",))
    outs = []
    for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids_BxL.shape[1])]:
        pos_BxL = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (ids_BxL.shape[0], hi - lo))
        logits_BxLxV, cache = step(graphdef, params, ids_BxL[:, lo:hi], pos_BxL, None, cache)
        outs.append(np.asarray(logits_BxLxV))
    return outs, cache


def test_scan_layers_prefill_and_decode_on_the_stacked_cache_equal_unrolled_layers():
    (graphdef, params), (s_graphdef, s_params) = unrolled_and_scanned(CFG, seed=3)
    ids_BxL = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)

    want, cache = _prefill_then_decode(graphdef, params, KVCache.init(CFG, 2, 12), ids_BxL, 4)
    got, s_cache = _prefill_then_decode(s_graphdef, s_params, KVCache.init(SCAN, 2, 12),
                                        ids_BxL, 4)

    assert s_cache.is_stacked
    assert_trees_close(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(s_cache.k, np.stack(cache.k), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(s_cache.v, np.stack(cache.v), rtol=RTOL, atol=ATOL)


def _decode_temp_bytes(cache: KVCache) -> int:
    _, (graphdef, params) = unrolled_and_scanned(CFG)
    step = jax.jit(forward, static_argnums=0, donate_argnames=("cache",))
    tok_Bx1, pos_Bx1 = jnp.zeros((8, 1), jnp.int32), jnp.full((8, 1), 5, jnp.int32)
    compiled = step.lower(graphdef, params, tok_Bx1, pos_Bx1, None, cache).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_scan_decode_step_on_the_stacked_cache_copies_no_whole_cache():
    stacked = KVCache.init(SCAN, batch=8, max_len=256)
    cache_bytes = 2 * stacked.k.size * 4  # keys + values, float32

    on_stacked = _decode_temp_bytes(stacked)
    on_tuple = _decode_temp_bytes(stacked.unstacked())  # stacked + unstacked around the scan

    assert on_tuple >= cache_bytes, (on_tuple, cache_bytes)
    assert on_stacked < cache_bytes // 2, (on_stacked, cache_bytes)
