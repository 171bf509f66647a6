"""MoE routing replay: a forward given expert ids routes exactly to them (one device and an
``expert`` = 2 mesh), keeps the trainer's router probabilities as the combine weights (so the
router gets gradients), and with the ids the model itself picked changes nothing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import KVCache, create_model, split_model
from meshrl.models.decoder import forward, forward_hidden
from meshrl.models.moe_math import MoESpec, route

# Layer 1 dense (mlp_only_layers): its routing rows are -1 and replay ignores them.
MOE = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=32,
                  intermediate_size=48, moe_intermediate_size=16, num_layers=3, num_heads=4,
                  num_kv_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(1,),
                  max_position_embeddings=64)
B, L = 2, 8
IDS = jax.random.randint(jax.random.key(3), (B, L), 0, 64)


def _model(mesh_cfg: MeshConfig | None, devices: int = 1, cfg: ModelConfig = MOE):
    mesh = None if mesh_cfg is None else create_mesh(mesh_cfg, jax.devices()[:devices])
    return split_model(create_model(cfg, mesh=mesh, rules=rules_for("train"), seed=1))


def _routing(graphdef: nnx.GraphDef, params: nnx.State, ids: jax.Array = IDS):
    """(logits, routing) of the plain forward, jitted (eager MoE ops are slow)."""
    return jax.jit(lambda p: forward(graphdef, p, ids, return_routing=True))(params)


def _replayed(graphdef: nnx.GraphDef, params: nnx.State, replay: jax.Array):
    return jax.jit(lambda p, r: nnx.merge(graphdef, p)(IDS, replay_NxBxLxK=r))(params, replay)


def _perturbed_router(params: nnx.State, scale: float) -> nnx.State:
    """Every router matrix plus noise large enough to change which experts win."""
    def bump(path, x):
        if "router" not in str(path):
            return x
        return x + scale * jax.random.normal(jax.random.key(7), x.shape, x.dtype)
    return jax.tree_util.tree_map_with_path(bump, params)


def test_replayed_ids_replace_the_selection_and_keep_the_router_weights():
    logits = jax.random.normal(jax.random.key(0), (5, 6))
    replay = jnp.array([[0, 1], [5, 2], [-1, -1], [3, 4], [-1, -1]], jnp.int32)
    for spec in (MoESpec(6, 2, norm_topk=True), MoESpec(6, 2, norm_topk=False),
                 MoESpec(6, 2, router="topk_softmax")):
        w, e = route(logits, spec, replay)
        own_w, own_e = route(logits, spec)
        given = np.asarray(replay[:, 0] >= 0)
        np.testing.assert_array_equal(np.asarray(e)[given], np.asarray(replay)[given])
        np.testing.assert_array_equal(np.asarray(e)[~given], np.asarray(own_e)[~given])
        np.testing.assert_allclose(np.asarray(w)[~given], np.asarray(own_w)[~given], atol=1e-7)
        probs = np.asarray(jax.nn.softmax(logits, -1))
        picked = np.take_along_axis(probs, np.asarray(e), -1)[given]
        if spec.norm_topk or spec.router == "topk_softmax":
            picked = picked / picked.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w)[given], picked, rtol=1e-6)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_replaying_the_models_own_routing_gives_the_same_logits(scan):
    cfg = dataclasses.replace(MOE, scan_layers=True, mlp_only_layers=()) if scan else MOE
    graphdef, params = _model(None, cfg=cfg)

    logits, routing = _routing(graphdef, params)
    replayed = _replayed(graphdef, params, routing)

    assert routing.shape == (cfg.num_layers, B, L, 2) and routing.dtype == jnp.int32
    assert (np.asarray(routing[1]) == -1).all() != scan  # the dense layer of the list form
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(logits), rtol=1e-6, atol=1e-6)


def test_sampler_decode_records_the_routing_the_trainer_forward_computes():
    graphdef, params = _model(None)
    _, full = _routing(graphdef, params)
    cache = KVCache.init(MOE, B, L, "float32")
    step = jax.jit(lambda p, tok, pos, c: forward(graphdef, p, tok, pos, None, c,
                                                  return_routing=True))
    steps = []
    for t in range(L):
        _, cache, routing = step(params, IDS[:, t:t + 1], jnp.full((B, 1), t, jnp.int32),
                                 cache)
        steps.append(routing[:, :, 0])

    np.testing.assert_array_equal(np.stack(steps, axis=2), np.asarray(full))


@pytest.mark.parametrize("mesh_cfg, devices", [
    (None, 1), pytest.param(MeshConfig(data=1, expert=2), 2,
                 marks=[pytest.mark.distributed, pytest.mark.slow])])
def test_replay_routes_a_perturbed_router_to_the_recorded_experts_with_router_grads(
        mesh_cfg, devices):
    graphdef, params = _model(mesh_cfg, devices)
    _, recorded = _routing(graphdef, params)
    moved = _perturbed_router(params, 3.0)
    _, own = _routing(graphdef, moved)
    assert (np.asarray(own) != np.asarray(recorded)).any()  # the perturbation changes routing

    def loss(p):
        model = nnx.merge(graphdef, p)
        logits, used = model(IDS, replay_NxBxLxK=recorded, return_routing=True)
        return logits.astype(jnp.float32).std(), used

    (_, used), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(moved)

    np.testing.assert_array_equal(np.asarray(used), np.asarray(recorded))
    router_grads = [np.abs(np.asarray(g)).sum() for path, g in
                    jax.tree_util.tree_leaves_with_path(grads) if "router" in str(path)]
    assert len(router_grads) == 2 and min(router_grads) > 0


def test_forward_hidden_with_replay_equals_the_replayed_logits():
    graphdef, params = _model(None)
    _, recorded = _routing(graphdef, params)
    moved = _perturbed_router(params, 3.0)

    hidden, head, tied = jax.jit(lambda p, r: forward_hidden(graphdef, p, IDS,
                                                             replay_NxBxLxK=r))(moved, recorded)
    logits = _replayed(graphdef, moved, recorded)

    np.testing.assert_allclose(np.asarray(hidden @ head), np.asarray(logits), rtol=1e-5,
                               atol=1e-5)
    assert not tied
