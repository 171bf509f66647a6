"""The inputs handed to JAX's TPU ragged paged attention kernel: its portable reference over
them equals ``paged_attention`` (the kernel itself compiles for a TPU slice in
tests/jobs/test_compile_tpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.mesh import create_mesh
from meshrl.models import paged_attention as pa
from meshrl.models import paged_kernel as pk
from meshrl.models.paged_attention import interleave
from meshrl.models.sharding import ShardingContext

B, N, K, H, S, M = 3, 4, 2, 8, 4, 5  # slots, q heads, kv heads (GQA 2), head dim, page, pages/seq
P = B * M + 2


def _pool(seed: int = 0):
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.standard_normal((P, S, K, H)), jnp.float32) for _ in range(2))
    table = rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32)
    table[1, 0] = table[0, 0]  # a shared prompt page
    table[2, 3:] = -1  # slot 2 holds at most 12 positions
    return k, v, jnp.asarray(table)


def test_combined_pool_interleaves_each_kv_heads_key_and_value():
    k, v, _ = _pool()

    kv = interleave(k, v)

    assert kv.shape == (P, S, 2 * K, H)
    np.testing.assert_array_equal(kv[:, :, 0::2], k)
    np.testing.assert_array_equal(kv[:, :, 1::2], v)


@pytest.mark.parametrize("L", [1, 3])  # decode, a chunk of queries
def test_kernel_reference_on_the_converted_inputs_equals_portable_paged_attention(L):
    k, v, table = _pool(1)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((B, L, N, H)), jnp.float32)
    last_B = np.array([6, 19, 11])  # ragged lengths; slot 2 within its 3 pages
    positions = jnp.asarray(last_B[:, None] - L + 1 + np.arange(L)[None], jnp.int32)

    got = pk.ragged_paged_attention(q, interleave(k, v), table, positions, reference=True)
    want = pa.paged_attention(q, k, v, table, positions)

    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kernel_reads_a_layer_of_a_stacked_pool_through_offset_page_indices():
    k, v, table = _pool(3)
    other_k, other_v, _ = _pool(4)
    stacked = jnp.stack([interleave(other_k, other_v), interleave(k, v)])  # [layers, P, S, 2K, H]
    q = jnp.asarray(np.random.default_rng(5).standard_normal((B, 1, N, H)), jnp.float32)
    positions = jnp.asarray([[6], [19], [11]], jnp.int32)

    got = pk.ragged_paged_attention(q, stacked, table, positions, layer=1, reference=True)
    want = pa.paged_attention(q, k, v, table, positions)

    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_free_slots_get_a_nonempty_window_and_missing_pages_an_existing_page():
    table = jnp.asarray([[3, -1], [-1, -1]], jnp.int32)
    positions = jnp.asarray([[5], [-1]], jnp.int32)

    kv_lens, pages, cu_q_lens, num_seqs = pk.kernel_inputs(table, positions, num_pages=4,
                                                           page_size=4)

    assert kv_lens.tolist() == [6, 1] and pages.tolist() == [[3, 0], [0, 0]]
    assert cu_q_lens.tolist() == [0, 1, 2] and num_seqs.tolist() == [2]


def test_pool_sharded_with_the_slots_reads_each_shards_pages_renumbered():
    # data = 2: slots 0-1 and their pages [0, 8) on one device, slots 2-3 and [8, 16) on the
    # other. Each shard runs attention on its own pages, numbered from its first.
    mesh = create_mesh(MeshConfig(data=2, tensor=1), jax.devices()[:2])
    ctx = ShardingContext.for_role(mesh, "sample")
    rng = np.random.default_rng(6)
    k, v = (jnp.asarray(rng.standard_normal((16, S, K, H)), jnp.float32) for _ in range(2))
    table = np.array([[3, 0, 5, -1], [6, 1, -1, -1], [12, 8, 15, 9], [10, -1, -1, -1]], np.int32)
    q = jnp.asarray(rng.standard_normal((4, 1, N, H)), jnp.float32)
    positions = jnp.asarray([[10], [6], [13], [2]], jnp.int32)

    def portable(q, kv, table, pos, layer):
        return pa.paged_attention(q, kv[:, :, 0::2], kv[:, :, 1::2], table, pos)

    got = jax.jit(lambda q, kv, t, p: pk.sharded_ragged_paged_attention(
        q, kv, t, p, 0, ctx, attend=portable, page_axes=("data",)))(
        q, interleave(k, v), jnp.asarray(table), positions)
    want = pa.paged_attention(q, k, v, jnp.asarray(table), positions)

    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
