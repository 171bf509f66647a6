"""MoE math: the grouped kernels equal a per-expert loop and the dense masked path (values and
gradients), routing laws, capacity drops, padding, router losses against transformers, and the
collectives of the compiled expert-parallel step."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.logits import Hidden
from meshrl.algorithms.losses import router_terms
from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import create_model, split_model
from meshrl.models.decoder import forward
from meshrl.models.moe_math import (
    MoESpec,
    capacity,
    dense_moe_ffn,
    moe_ffn,
    route,
    router_stats,
    to_copies,
    to_tokens,
)
from meshrl.tests.trees import assert_trees_close

T, D, E, F, K = 24, 16, 4, 8, 2
RTOL, ATOL = 1e-5, 1e-6  # float32; the paths only reorder sums


def _weights(seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, D))
    router = jax.random.normal(ks[1], (D, E))
    wg, wu = (0.3 * jax.random.normal(k, (E, D, F)) for k in ks[2:4])
    wd = 0.3 * jax.random.normal(ks[4], (E, F, D))
    return x, router, wg, wu, wd


def _loop_reference(x, mask, router, wg, wu, wd, spec: MoESpec, cap: int | None = None):
    """One expert at a time, its tokens in token order; with ``cap`` only its first ``cap``."""
    w_TxK, e_TxK = route(x @ router, spec)
    y = np.zeros(x.shape, np.float32)
    x, w_TxK, e_TxK, mask, wg, wu, wd = map(np.asarray, (x, w_TxK, e_TxK, mask, wg, wu, wd))
    for e in range(spec.num_experts):
        toks = [t for t in range(x.shape[0]) for j in range(spec.top_k)
                if e_TxK[t, j] == e and mask[t]]
        for n, t in enumerate(toks):
            if cap is not None and n >= cap:
                continue
            g = x[t] @ wg[e]
            h = g / (1.0 + np.exp(-g)) * (x[t] @ wu[e])
            j = list(e_TxK[t]).index(e)
            y[t] += w_TxK[t, j] * (h @ wd[e])
    return y


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
def test_grouped_moe_equals_the_per_expert_loop(impl, router):
    x, r, wg, wu, wd = _weights()
    mask = jnp.ones((T,), bool).at[3].set(False)
    spec = MoESpec(E, K, norm_topk=False, router=router, impl=impl)

    y, stats, _ = moe_ffn(x, mask, r, wg, wu, wd, spec)

    np.testing.assert_allclose(np.asarray(y), _loop_reference(x, mask, r, wg, wu, wd, spec),
                               rtol=RTOL, atol=ATOL)
    assert float(stats["rows"]) == T - 1 and float(stats["counts"].sum()) == (T - 1) * K
    assert not np.asarray(y[3]).any()  # a padding token gets no expert


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot"])
def test_grouped_and_dense_paths_agree_in_values_and_gradients(impl):
    x, r, wg, wu, wd = _weights(1)
    mask = jnp.ones((T,), bool)
    spec = MoESpec(E, K, impl=impl)
    probe = jax.random.normal(jax.random.key(9), (T, D))

    def loss(fn, *args):
        y, stats, _ = fn(*args[:1], mask, *args[1:], spec)
        return (y * probe).sum() + stats["prob_sum"].sum()

    grouped = jax.value_and_grad(lambda *a: loss(moe_ffn, *a), argnums=range(5))(x, r, wg, wu, wd)
    dense = jax.value_and_grad(lambda *a: loss(dense_moe_ffn, *a), argnums=range(5))(
        x, r, wg, wu, wd)

    np.testing.assert_allclose(grouped[0], dense[0], rtol=RTOL, atol=ATOL)
    assert_trees_close(grouped[1], dense[1], rtol=1e-4, atol=1e-5)


def test_copy_dispatch_and_combine_equal_a_gather_and_a_scatter_add_with_their_gradients():
    k = 3
    order_A = jax.random.permutation(jax.random.key(4), T * k).astype(jnp.int32)
    tok_A = order_A // k
    slot_TxK = jnp.zeros((T * k,), jnp.int32).at[order_A].set(
        jnp.arange(T * k, dtype=jnp.int32)).reshape(T, k)
    x_TxD, v_AxD = (jax.random.normal(jax.random.key(s), (n, D)) for s, n in ((5, T), (6, T * k)))
    probe_AxD, probe_TxD = jax.random.normal(jax.random.key(7), (T * k, D)), x_TxD + 1

    def plain_combine(v):
        return jnp.zeros((T, D)).at[tok_A].add(v)

    pairs = ((lambda x: to_copies(x, tok_A, slot_TxK), lambda x: x[tok_A], x_TxD, probe_AxD),
             (lambda v: to_tokens(v, tok_A, slot_TxK), plain_combine, v_AxD, probe_TxD))
    for ours, plain, arg, probe in pairs:
        got = jax.value_and_grad(lambda a, f=ours, p=probe: (f(a) * p).sum())(arg)
        want = jax.value_and_grad(lambda a, f=plain, p=probe: (f(a) * p).sum())(arg)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=1e-4)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=RTOL, atol=ATOL)


def test_topk_then_softmax_equals_renormalised_softmax_then_topk():
    logits = jax.random.normal(jax.random.key(3), (T, E))

    w_mixtral, e_mixtral = route(logits, MoESpec(E, K, router="topk_softmax"))
    w_qwen, e_qwen = route(logits, MoESpec(E, K, norm_topk=True, router="softmax_topk"))

    np.testing.assert_array_equal(np.asarray(e_mixtral), np.asarray(e_qwen))
    np.testing.assert_allclose(np.asarray(w_mixtral), np.asarray(w_qwen), rtol=1e-6, atol=1e-7)


def test_capacity_drops_the_later_copies_of_an_overfull_expert_and_counts_them():
    x, r, wg, wu, wd = _weights(2)
    mask = jnp.ones((T,), bool)
    spec = MoESpec(E, K, capacity_factor=0.5)
    cap = capacity(T, spec)
    _, e_TxK = route(x @ r, spec)
    counts = np.bincount(np.asarray(e_TxK).ravel(), minlength=E)

    y, stats, _ = moe_ffn(x, mask, r, wg, wu, wd, spec)
    roomy, roomy_stats, _ = moe_ffn(x, mask, r, wg, wu, wd, dataclasses.replace(
        spec, capacity_factor=float(E)))

    assert float(stats["dropped"]) == np.maximum(counts - cap, 0).sum() > 0
    np.testing.assert_allclose(np.asarray(y), _loop_reference(x, mask, r, wg, wu, wd, spec, cap),
                               rtol=RTOL, atol=ATOL)
    assert float(roomy_stats["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(roomy), np.asarray(moe_ffn(x, mask, r, wg, wu, wd,
                                                                     MoESpec(E, K))[0]),
                               rtol=0, atol=0)


def test_load_balancing_loss_equals_transformers_over_layers_with_padding():
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    B, L = 3, 8
    mask_BxL = np.ones((B, L), np.int64)
    mask_BxL[1, 5:] = 0
    layers = [rng.normal(size=(B * L, E)).astype(np.float32) for _ in range(2)]
    total = None
    for logits in layers:
        _, e_TxK = route(jnp.asarray(logits), MoESpec(E, K))
        s = router_stats(jnp.asarray(logits), e_TxK, jnp.asarray(mask_BxL.reshape(-1)),
                         jnp.zeros(()))
        total = s if total is None else jax.tree.map(jnp.add, total, s)
    out = Hidden(jnp.zeros((B, L, 4)), jnp.zeros((4, 5)), chunk=0, router=total,
                 aux_loss_coef=1.0)

    loss, aux = router_terms(out, jnp.zeros(()), jnp.ones(()), {})
    expected = load_balancing_loss_func(tuple(torch.tensor(g) for g in layers), E, K,
                                        torch.tensor(mask_BxL))

    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    np.testing.assert_allclose(float(aux["moe/aux_loss"]), float(expected), rtol=1e-5)


TINY_MOE = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=32,
                       intermediate_size=48, moe_intermediate_size=16, num_layers=2, num_heads=4,
                       num_kv_heads=2, num_experts=4, num_experts_per_tok=2)


def _compiled_grad_hlo(mesh_cfg: MeshConfig, devices: int = 8) -> str:
    mesh = create_mesh(mesh_cfg, jax.devices()[:devices])
    one_layer = dataclasses.replace(TINY_MOE, num_layers=1)
    graphdef, params = split_model(create_model(one_layer, mesh=mesh, rules=rules_for("train")))
    ids = jnp.zeros((8, 16), jnp.int32)

    def loss(p):
        return forward(graphdef, p, ids).astype(jnp.float32).mean()

    return jax.jit(jax.grad(loss)).lower(params).compile().as_text()


@pytest.mark.distributed
def test_expert_parallel_step_uses_all_to_all_and_never_gathers_expert_weights():
    ep = _compiled_grad_hlo(MeshConfig(data=1, expert=2, expert_tensor=2), devices=4)
    no_ep = _compiled_grad_hlo(MeshConfig(data=2), devices=2)

    assert "all-to-all" in ep
    assert "all-to-all" not in no_ep
    # The expert weights (gate/up [4, 32, 16], down [4, 16, 32]) are never rebuilt whole on a
    # device: no all-gather yields an array with all 4 experts of an expert's weight shape.
    whole = ("f32[4,32,16]", "f32[4,16,32]")
    outputs = [m.group(1) for m in re.finditer(r"= (.+?) all-gather(?:-start)?\(", ep)]
    gathers = [out for out in outputs if any(shape in out for shape in whole)]
    assert not gathers, gathers
