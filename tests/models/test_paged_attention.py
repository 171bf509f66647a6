"""The paged KV cache attention equals the dense cache attention on ragged lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.models import paged_attention as pa
from meshrl.models.attention import _attend_cache

B, N, K, H, S, M = 3, 4, 2, 8, 4, 5  # slots, q heads, kv heads (GQA 2), head dim, page, pages/seq
P = B * M + 2


def _setup(lengths, seed=0):
    """Random k/v of each slot's positions, written into pages scattered out of order."""
    rng = np.random.default_rng(seed)
    T = M * S
    k_BxTxKxH = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v_BxTxKxH = rng.standard_normal((B, T, K, H)).astype(np.float32)
    table = rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32)
    cache = pa.PagedKVCache((jnp.zeros((P, S, K, H)),), (jnp.zeros((P, S, K, H)),))
    pos_BxT = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T), -1)
    cache = pa.write(cache, 0, jnp.asarray(k_BxTxKxH), jnp.asarray(v_BxTxKxH),
                     jnp.asarray(pos_BxT, jnp.int32), jnp.asarray(table))
    return cache, table, k_BxTxKxH, v_BxTxKxH


def _dense(q, k_BxTxKxH, v_BxTxKxH, positions, lengths):
    T = k_BxTxKxH.shape[1]
    live = (np.arange(T)[None] < np.asarray(lengths)[:, None])[..., None, None]
    k, v = np.where(live, k_BxTxKxH, 0.0), np.where(live, v_BxTxKxH, 0.0)
    mask = np.arange(T)[None, None, :] <= np.asarray(positions)[:, :, None]
    return _attend_cache(jnp.asarray(q), jnp.asarray(k.transpose(0, 2, 3, 1)),
                         jnp.asarray(v.transpose(0, 2, 1, 3)), jnp.asarray(mask))


@pytest.mark.parametrize("L", [1, 4])  # decode, chunked prefill
def test_paged_equals_dense_on_ragged_lengths(L):
    lengths = [5, 20, 11]
    cache, table, k, v = _setup(lengths)
    q = np.random.default_rng(1).standard_normal((B, L, N, H)).astype(np.float32)
    positions = np.asarray(lengths)[:, None] - L + np.arange(L)[None]
    got = jax.jit(pa.paged_attention)(q, cache.k[0], cache.v[0], jnp.asarray(table),
                                      jnp.asarray(positions, jnp.int32))
    want = _dense(q, k, v, positions, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_padding_positions_are_dropped_and_pages_stay_untouched():
    cache, table, _, _ = _setup([3, 3, 3])
    k = np.asarray(cache.k[0])
    used = set(table[:, 0].tolist())
    untouched = [p for p in range(P) if p not in used]
    assert not k[untouched].any()
    # Within each slot's first page, the offset past its 3 positions stays empty too (a -1
    # position must not wrap to the page's last offset).
    assert not k[table[:, 0], 3:].any() and k[table[:, 0], :3].all(axis=(-1, -2)).all()


def test_sliding_window_masks_old_positions():
    lengths = [20, 20, 20]
    cache, table, k, v = _setup(lengths)
    q = np.random.default_rng(2).standard_normal((B, 1, N, H)).astype(np.float32)
    positions = np.full((B, 1), 19, np.int32)
    got = pa.paged_attention(q, cache.k[0], cache.v[0], jnp.asarray(table),
                             jnp.asarray(positions), sliding_window=4)
    # Only positions 16..19 are visible: equal to dense attention over that band.
    want = _dense(q, k[:, 16:], v[:, 16:], positions - 16, [4] * B)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_shared_prefix_pages_are_read_by_every_slot():
    cache, table, k, v = _setup([8, 8, 8])
    shared = table.copy()
    shared[1:, :2] = table[0, :2]  # slots 1, 2 reference slot 0's two full pages
    q = np.random.default_rng(3).standard_normal((B, 1, N, H)).astype(np.float32)
    positions = np.full((B, 1), 7, np.int32)
    got = pa.paged_attention(q, cache.k[0], cache.v[0], jnp.asarray(shared),
                             jnp.asarray(positions))
    k0 = np.broadcast_to(k[:1], k.shape)
    v0 = np.broadcast_to(v[:1], v.shape)
    want = _dense(q, k0, v0, positions, [8] * B)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_pool_size_names_the_values():
    class Cfg:
        num_kv_heads, resolved_head_dim = K, H

    with pytest.raises(ValueError, match="num_pages=0, page_size=4"):
        pa.PagedKVCache.shape(Cfg, 0, 4)


def test_equals_jax_ragged_paged_attention_reference():
    """Same numbers as JAX's reference for its TPU ragged paged attention kernel (decode)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    lengths = [5, 20, 11]
    cache, table, _, _ = _setup(lengths)
    q = np.random.default_rng(4).standard_normal((B, 1, N, H)).astype(np.float32)
    positions = np.asarray(lengths, np.int32)[:, None] - 1
    got = pa.paged_attention(q, cache.k[0], cache.v[0], jnp.asarray(table),
                             jnp.asarray(positions))
    # The reference interleaves k and v on the head axis: [P, S, 2K, H].
    kv = jnp.stack([cache.k[0], cache.v[0]], axis=3).reshape(P, S, 2 * K, H)
    want = ref_ragged_paged_attention(
        jnp.asarray(q[:, 0]), kv, jnp.asarray(lengths, jnp.int32), jnp.asarray(table),
        jnp.arange(B + 1, dtype=jnp.int32), jnp.asarray([B], jnp.int32), sm_scale=H ** -0.5)
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_tensor_sharded_pool_matches_single_device():
    from meshrl.configs.schema import MeshConfig
    from meshrl.mesh import create_mesh, rules_for

    mesh = create_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])

    class Cfg:
        num_kv_heads, resolved_head_dim, num_layers = K, H, 1

    sh = pa.PagedKVCache.shardings(Cfg, P, S, mesh, rules_for("sample"))
    assert sh.k[0].shard_shape((P, S, K, H)) == (P, S, K // 2, H)  # kv heads over tensor
    lengths = [5, 20, 11]
    cache, table, _, _ = _setup(lengths)
    q = np.random.default_rng(5).standard_normal((B, 1, N, H)).astype(np.float32)
    positions = jnp.asarray(np.asarray(lengths, np.int32)[:, None] - 1)
    want = pa.paged_attention(q, cache.k[0], cache.v[0], jnp.asarray(table), positions)
    k, v = jax.device_put(cache.k[0], sh.k[0]), jax.device_put(cache.v[0], sh.v[0])
    got = jax.jit(pa.paged_attention)(q, k, v, jnp.asarray(table), positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_positions_on_unassigned_pages_are_dropped():
    """A table entry of -1 (no page yet, the allocator's empty mark) must not write page 0."""
    cache = pa.PagedKVCache((jnp.zeros((P, S, K, H)),), (jnp.zeros((P, S, K, H)),))
    table = np.full((1, M), -1, np.int32)
    table[0, 0] = 3
    ones = jnp.ones((1, 2 * S, K, H))
    cache = pa.write(cache, 0, ones, ones, jnp.arange(2 * S, dtype=jnp.int32)[None],
                     jnp.asarray(table))
    written = np.asarray(cache.k[0]).any(axis=(1, 2, 3))
    assert written.tolist() == [p == 3 for p in range(P)]


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_combined_pool_holds_what_separate_pools_hold(stacked):
    rng = np.random.default_rng(7)
    k_BxLxKxH, v_BxLxKxH = (jnp.asarray(rng.standard_normal((B, 3, K, H)), jnp.float32)
                            for _ in range(2))
    table = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    positions = jnp.asarray([[0, 1, 2], [4, 5, -1], [17, 18, 19]], jnp.int32)
    zeros = jnp.zeros((2, P, S, K, H)) if stacked else (jnp.zeros((P, S, K, H)),) * 2
    separate = pa.PagedKVCache(zeros, zeros, table)
    combined = pa.PagedKVCache(jnp.zeros((2, P, S, 2 * K, H)) if stacked
                               else (jnp.zeros((P, S, 2 * K, H)),) * 2, None, table)

    separate, combined = (pa.write(c, 1, k_BxLxKxH, v_BxLxKxH, positions)
                          for c in (separate, combined))

    assert combined.combined and not separate.combined
    for got, want in zip(combined.layer(1), separate.layer(1), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(combined.k[0]).any()  # the other layer untouched


def test_combined_pool_shards_whole_key_value_pairs_or_none():
    from meshrl.configs.schema import MeshConfig
    from meshrl.mesh import create_mesh, rules_for

    mesh = create_mesh(MeshConfig(data=1, tensor=2), jax.devices()[:2])

    def combined_shard(kv_heads):
        class Cfg:
            num_kv_heads, resolved_head_dim, num_layers = kv_heads, H, 1

        sh = pa.PagedKVCache.shardings(Cfg, P, S, mesh, rules_for("sample"), combined=True)
        assert sh.v is None
        return sh.k[0].shard_shape((P, S, 2 * kv_heads, H))

    assert combined_shard(2) == (P, S, 2, H)  # one (key, value) pair a device
    assert combined_shard(1) == (P, S, 2, H)  # a pair is never split: replicated


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
def test_put_slots_writes_a_stacked_pool_as_it_writes_per_layer_pools(combined):
    from meshrl.models.kv_cache import TRANSPOSED, KVCache

    rng = np.random.default_rng(3)
    T, layers = 2 * S + 1, 2  # a partial last page
    keys = [jnp.asarray(rng.standard_normal((2, K, H, T)), jnp.float32) for _ in range(layers)]
    values = [jnp.asarray(rng.standard_normal((2, K, T, H)), jnp.float32) for _ in range(layers)]
    table = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    slots = jnp.asarray([2, B], jnp.int32)  # slot 2 and a padding row (dropped)
    heads = 2 * K if combined else K

    def cache(stacked):
        pools = (jnp.zeros((layers, P, S, heads, H)) if stacked
                 else tuple(jnp.zeros((P, S, heads, H)) for _ in range(layers)))
        return pa.PagedKVCache(pools, None if combined else pools, table)

    per_layer = cache(False).put_slots(KVCache(tuple(keys), tuple(values), TRANSPOSED), slots)
    stacked = cache(True).put_slots(
        KVCache(jnp.stack(keys), jnp.stack(values), TRANSPOSED), slots)

    for layer in range(layers):
        for got, want in zip(stacked.layer(layer), per_layer.layer(layer), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    written = np.asarray(per_layer.layer(1)[1])
    np.testing.assert_array_equal(  # position S + 1 of slot 2: page table[2, 1], offset 1
        written[int(table[2, 1]), 1], np.asarray(values[1][0, :, S + 1]))
    assert np.count_nonzero(written.any(axis=(1, 2, 3))) == 3  # slot 2's three pages only


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_sharded_take_and_put_equal_the_global_ones(stacked):
    # 4 slots over 2 shards, 12 pages: slots 0-1 list pages 0-5, slots 2-3 pages 6-11 (a
    # missing page, -1, is out of range: clipped on reads, dropped on writes).
    rng = np.random.default_rng(7)
    shape = ((2,) if stacked else ()) + (12, S, K, H)
    pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    table = jnp.asarray([[4, 0, 2], [1, 5, 3], [9, 6, 11], [7, 10, 8]], jnp.int32)
    pages = jnp.asarray([[4, 2], [12, 3], [6, 11], [12, 8]], jnp.int32)  # 12: dropped
    offs = jnp.asarray([[1, 3], [0, 2], [0, 1], [3, 3]], jnp.int32)
    x = jnp.asarray(rng.standard_normal(shape[:-4] + (4, 2, K, H)), jnp.float32)
    pools = pool if stacked else (pool,)
    xs = x if stacked else (x,)

    np.testing.assert_array_equal(pa.take_pages(pool, table, 2), pa.take_pages(pool, table))
    got = pa.put_entries(pools, pages, offs, xs, shards=2)
    want = pa.put_entries(pools, pages, offs, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(jax.tree.leaves(got)[0], pool)  # the writes landed
