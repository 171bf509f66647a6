"""Context-parallel attention: all-gather and ring equal unsharded attention in values and
gradients on context meshes (balanced and not, packed or not, GQA and MHA); the balanced layout
evens the per-rank work; the ring's compiled step passes K/V blocks, never whole."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import MeshConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models.attention_kernels import causal_segment_mask, einsum_attention
from meshrl.models.context_attention import (
    check_length,
    context_attention,
    rank_work,
    sequence_order,
)
from meshrl.models.sharding import ShardingContext
from meshrl.tests.trees import assert_trees_close

pytestmark = pytest.mark.distributed

B, L, H = 2, 64, 8
MESHES = {"context8": MeshConfig(data=1, context=8),
          "data2_context4": MeshConfig(data=2, context=4),
          "tensor2_context4": MeshConfig(data=1, tensor=2, context=4),
          # More tensor shards than kv heads (gqa): the kv heads are repeated to split.
          "tensor4_context2": MeshConfig(data=1, tensor=4, context=2)}
HEADS = {"gqa": (4, 2), "mha": (4, 4)}
GRID = list(itertools.product(("all_gather", "ring"), sorted(MESHES), (True, False),
                              (False, True), sorted(HEADS)))
# The default run covers every strategy x mesh with the other options varied; -m slow runs all.
DEFAULT = {GRID[i] for i in range(0, len(GRID), 8)} | {
    ("ring", "data2_context4", True, True, "gqa"), ("all_gather", "tensor2_context4", True,
                                                     True, "gqa"),
    ("ring", "context8", False, True, "mha"), ("ring", "tensor4_context2", True, True, "gqa"),
    ("all_gather", "tensor4_context2", False, False, "gqa")}
CASES = [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in GRID]


def _inputs(N: int, K: int, packed: bool):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, L, N, H))
    k = jax.random.normal(ks[1], (B, L, K, H))
    v = jax.random.normal(ks[2], (B, L, K, H))
    probe = jax.random.normal(ks[3], (B, L, N, H))
    seg = np.ones((B, L), np.int32)
    if packed:  # three sequences in row 0 (segment borders off the chunk borders), padding
        seg[0, 21:40], seg[0, 40:] = 2, 3
        seg[1, 50:] = 0
    return q, k, v, jnp.asarray(seg), probe


def _value_and_grads(attend, q, k, v, seg, probe):
    """(attention output, gradients of <output, probe> w.r.t. q, k, v)."""
    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return out, pullback(probe)

    return jax.jit(run)(q, k, v)


@pytest.mark.parametrize("strategy, mesh_name, balanced, packed, heads", CASES)
def test_context_attention_equals_unsharded_attention_in_values_and_gradients(
        strategy, mesh_name, balanced, packed, heads):
    N, K = HEADS[heads]
    q, k, v, seg, probe = _inputs(N, K, packed)
    mesh = create_mesh(MESHES[mesh_name])
    ctx = ShardingContext(mesh, rules_for("train"))
    C = mesh.shape["context"]
    order = sequence_order(L, C, balanced)
    natural = np.argsort(order)

    def sharded(q, k, v, seg):
        out = context_attention(strategy, q[:, order], k[:, order], v[:, order], seg[:, order],
                                order, ctx)
        return out[:, natural]

    def reference(q, k, v, seg):
        return einsum_attention(q, k, v, causal_segment_mask(seg))

    got, got_grads = _value_and_grads(sharded, q, k, v, seg, probe)
    want, want_grads = _value_and_grads(reference, q, k, v, seg, probe)

    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-5)


def test_balanced_layout_gives_every_rank_the_same_causal_work():
    balanced, contiguous = rank_work(4096, 4, True), rank_work(4096, 4, False)

    assert balanced.max() / balanced.mean() == 1.0
    assert contiguous.max() / contiguous.mean() > 1.7
    order = sequence_order(16, 2, True)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def test_length_not_divisible_by_twice_the_context_is_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"sequence length 36: must be divisible by 2 x "
                                          r"mesh.context = 8"):
        check_length(36, 4, balanced=True)
    check_length(36, 4, balanced=False)


def test_ring_step_permutes_kv_blocks_over_context_and_never_gathers_them_whole():
    q, k, v, seg, probe = _inputs(4, 2, False)
    mesh = create_mesh(MeshConfig(data=2, context=4))
    ctx = ShardingContext(mesh, rules_for("train"))
    order = sequence_order(L, 4, True)

    def loss(q, k, v):
        return (context_attention("ring", q, k, v, seg, order, ctx) * probe).sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()

    assert "collective-permute" in hlo
    full_kv = [line for line in hlo.splitlines()
               if "all-gather" in line and f",{L},2,{H}]" in line.split("all-gather")[0]]
    assert not full_kv, full_kv
