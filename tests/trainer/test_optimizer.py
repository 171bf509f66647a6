"""Optimizer from config: schedules, weight-decay masks, state shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshrl.configs.schema import OptimizerConfig
from meshrl.tests.trainer.tiny import make_trainee, mesh_for, tiny_config
from meshrl.trainer.engine import expand_prefix
from meshrl.trainer.optimizer import decay_mask, make_optimizer, make_schedule
from meshrl.trainer.state import state_shardings


@pytest.mark.parametrize("schedule, end", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_schedule_warms_up_linearly_then_decays_to_min_ratio(schedule, end):
    cfg = OptimizerConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1)
    lr = make_schedule(cfg, 2.0, total_steps=110)
    np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 1.0, 2.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lr(110), 2.0 * end, rtol=1e-5)
    if schedule != "constant":
        assert lr(60) < lr(10)
    # A quarter into the decay the shapes part (at its middle both are at 1.1).
    quarter = {"cosine": 0.2 + 1.8 * (1 + np.cos(np.pi / 4)) / 2, "linear": 2.0 - 1.8 / 4,
               "constant": 2.0}[schedule]
    np.testing.assert_allclose(lr(35), quarter, rtol=1e-5)


def test_decay_mask_excludes_norm_scales_and_keeps_matrices():
    config = tiny_config()
    params = make_trainee(config, mesh_for(config)).params
    flat = jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]
    by_name = {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): bool(v)
               for path, v in flat}
    norms = [n for n in by_name if "norm" in n]
    kernels = [n for n in by_name if "kernel" in n or n.startswith("embed") or "lm_head" in n]
    assert norms and kernels
    assert not any(by_name[n] for n in norms)
    assert all(by_name[n] for n in kernels)


def test_decay_mask_by_name_catches_stacked_norms_and_biases():
    params = {"layers": {"attn_norm": {"scale": jnp.ones((4, 8))}, "q": {"bias": jnp.ones((4, 8)),
                                                                         "kernel": jnp.ones((8, 8))}}}
    mask = decay_mask(params)
    assert not mask["layers"]["attn_norm"]["scale"] and not mask["layers"]["q"]["bias"]
    assert mask["layers"]["q"]["kernel"]


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_each_optimizer_reduces_a_quadratic(name):
    cfg = OptimizerConfig(name=name, warmup_steps=0, schedule="constant", weight_decay=0.01,
                          momentum=0.5)
    tx, _ = make_optimizer(cfg, 0.1, 100)
    params = {"w": jnp.full((4, 4), 3.0), "norm": jnp.full((4,), 3.0)}
    loss = lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p))  # noqa: E731
    opt = tx.init(params)
    start = loss(params)
    for _ in range(20):
        updates, opt = tx.update(jax.grad(loss)(params), opt, params)
        params = optax.apply_updates(params, updates)
    assert loss(params) < 0.5 * start


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizer_moments_follow_param_shardings_under_fsdp(name):
    config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4, "mesh.fsdp": True,
                            "optimizer.name": name})
    mesh = mesh_for(config)
    trainee = make_trainee(config, mesh)
    tx, _ = make_optimizer(config.optimizer, 1e-3, 10)
    params_sh = expand_prefix(trainee.params_shardings, trainee.params)
    sh = state_shardings(params_sh, tx, mesh, trainee.params)
    if name == "adamw":
        adam = sh.opt_state[1]  # chain: clip, scale_by_adam, decay, lr
        assert jax.tree.leaves(adam.mu) == jax.tree.leaves(params_sh)
        assert jax.tree.leaves(adam.nu) == jax.tree.leaves(params_sh)
    # Every leaf's sharding fits its shape (factored Adafactor statistics included).
    abstract = jax.eval_shape(tx.init, trainee.params)
    placed = jax.jit(tx.init, out_shardings=sh.opt_state)(trainee.params)
    assert jax.tree.structure(placed) == jax.tree.structure(abstract)
    assert any("data" in str(s.spec) for s in jax.tree.leaves(sh.opt_state))
