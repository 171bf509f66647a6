"""The jitted train step: accumulation equals one big batch, sharding does not change the math,
non-finite steps are skipped on the device, the step over the state's leaves is the same step."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

from meshrl.algorithms.batch import TrainBatch
from meshrl.algorithms.losses import get_loss
from meshrl.configs.schema import Config, OptimizerConfig
from meshrl.mesh import rules_for
from meshrl.tests.trainer.tiny import RandomIterator, make_trainee, mesh_for, tiny_config
from meshrl.tests.trees import assert_trees_close, assert_trees_equal
from meshrl.trainer.engine import expand_prefix, put_batch
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.state import TrainState, init_state, state_shardings
from meshrl.trainer.step import (
    batch_shardings,
    jit_leaf_step,
    jit_train_step,
    make_train_step,
)


def _train(config: Config, batches: list[dict[str, np.ndarray]],
           devices: list[jax.Device] | None = None, leaves: bool = False
           ) -> tuple[TrainState, list[dict]]:
    """Train on ``batches`` with ``jit_train_step`` (``leaves``: ``jit_leaf_step``)."""
    mesh = mesh_for(config, devices)
    trainee = make_trainee(config, mesh)
    tx, schedule = make_optimizer(config.optimizer, config.trainer.learning_rate,
                                  config.trainer.steps)
    params_sh = expand_prefix(trainee.params_shardings, trainee.params)
    state_sh = state_shardings(params_sh, tx, mesh, trainee.params)
    state = jax.jit(lambda p: init_state(p, tx, 0), out_shardings=state_sh)(trainee.params)
    B, L = batches[0]["input_ids"].shape
    batch_sh = batch_shardings(mesh, rules_for("train", config.mesh.fsdp), B, L)
    pure = make_train_step(trainee.forward, get_loss("sft"), tx, schedule,
                           microbatches=config.trainer.microbatches)
    if leaves:
        leaf_step = jit_leaf_step(pure, state_sh, batch_sh, mesh)
        treedef = jax.tree.structure(state_sh)

        def step(state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
            out, metrics = leaf_step(jax.tree.leaves(state), batch)
            return jax.tree.unflatten(treedef, out), metrics
    else:
        step = jit_train_step(pure, state_sh, batch_sh, mesh)
    history = []
    for b in batches:
        state, metrics = step(state, put_batch(TrainBatch.from_mapping(b), batch_sh))
        # Host copies of every intermediate state (the next step donates the device buffers).
        history.append({**jax.device_get(metrics), "state": jax.device_get(state)})
    return history[-1]["state"], history


def _sgd(**overrides: object) -> Config:
    # SGD keeps updated params linear in the gradients. Adam's first steps are ~lr * sign(g),
    # which turns last-bit rounding differences of near-zero gradients into +-lr jumps and would
    # hide (or fake) real mismatches.
    return tiny_config(**{"optimizer.name": "sgd", "optimizer.momentum": 0.9,
                          "optimizer.weight_decay": 0.0, "trainer.learning_rate": 0.5,
                          **overrides})


def test_accumulating_four_microbatches_equals_one_big_batch():
    ref_state, ref_hist = _single_device_reference()
    acc_state, acc_hist = _train(_sgd(**{"trainer.microbatches": 4}), _two_batches(),
                                 [jax.devices()[0]])
    # Same math, only the summation order differs (4 partial sums + 1): f32 rounding level.
    for r, a in zip(ref_hist, acc_hist, strict=True):
        np.testing.assert_allclose(a["loss"], r["loss"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a["grad_norm"], r["grad_norm"], rtol=1e-5, atol=1e-7)
        assert a["tokens"] == r["tokens"]
    assert_trees_close(acc_state.params, ref_state.params, rtol=1e-5, atol=1e-6)


def _two_batches() -> list[dict[str, np.ndarray]]:
    data = RandomIterator(8, 16)
    return [data.batch(0), data.batch(1)]


@functools.cache
def _single_device_reference() -> tuple[TrainState, list[dict]]:
    return _train(_sgd(), _two_batches(), [jax.devices()[0]])


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_overrides", [
    # Plain data and data x tensor are the fsdp cases without fsdp: slow only.
    pytest.param({"mesh.data": 8}, marks=pytest.mark.slow),
    pytest.param({"mesh.data": 2, "mesh.tensor": 4}, marks=pytest.mark.slow),
    {"mesh.data": 8, "mesh.fsdp": True},
    {"mesh.data": 2, "mesh.tensor": 4, "mesh.fsdp": True, "trainer.microbatches": 2},
    {"mesh.data": 2, "mesh.dcn_data": 2, "mesh.tensor": 2, "mesh.fsdp": True},
], ids=["data8", "data2_tensor4", "fsdp8", "fsdp2_tensor4_accum2", "hsdp2x2_tensor2"])
def test_sharded_step_matches_single_device(mesh_overrides):
    batches = _two_batches()
    ref_state, ref_hist = _single_device_reference()
    state, hist = _train(_sgd(**mesh_overrides), batches)
    # Sharded matmuls and cross-device reductions add partial sums in another order; the results
    # agree to f32 rounding (~1e-7 relative per op), amplified a little by two SGD steps.
    for r, s in zip(ref_hist, hist, strict=True):
        np.testing.assert_allclose(s["loss"], r["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s["grad_norm"], r["grad_norm"], rtol=1e-4, atol=1e-6)
    assert_trees_close(state.params, ref_state.params, rtol=1e-4, atol=1e-5)


def test_nonfinite_loss_skips_update_and_counts_it():
    data = RandomIterator(8, 16, nan_at=1)
    config = tiny_config(**{"trainer.on_nonfinite": "skip"})
    final, hist = _train(config, [data.batch(i) for i in range(3)], [jax.devices()[0]])
    after_first, after_nan = hist[0]["state"], hist[1]["state"]
    assert hist[0]["finite"] and not hist[1]["finite"] and not np.isfinite(hist[1]["loss"])
    assert int(after_nan.skipped) == 1 and int(after_nan.weight_version) == 1
    assert int(after_nan.step) == 2
    # The skipped update leaves params and optimizer moments bitwise untouched; only the
    # schedule's count moves on (the next step applies its own rate).
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    moments = lambda opt: jax.tree.map(lambda x: None if is_schedule(x) else x, opt,  # noqa: E731
                                       is_leaf=is_schedule)
    assert_trees_equal((after_nan.params, moments(after_nan.opt_state)),
                       (after_first.params, moments(after_first.opt_state)))
    assert hist[2]["finite"] and np.isfinite(hist[2]["loss"])
    assert int(final.weight_version) == 2 and int(final.skipped) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final.params))


def test_steps_after_a_skipped_one_apply_their_own_scheduled_rates():
    # SGD on a lookup table, schedule 1 - s/10: the update of a unit gradient is the rate.
    cfg = OptimizerConfig(name="sgd", schedule="linear", warmup_steps=0, grad_clip_norm=0.0,
                          min_lr_ratio=0.0)
    tx, schedule = make_optimizer(cfg, 1.0, 10)
    step = jax.jit(make_train_step(lambda p, ids, pos, seg: p["table"][ids], get_loss("sft"),
                                   tx, schedule))
    table = {"table": jax.numpy.zeros((4, 4))}

    def rate(opt_state):
        updates, _ = tx.update({"table": jax.numpy.ones((4, 4))}, opt_state, table)
        return -float(updates["table"][0, 0])

    def batch(mask):
        return TrainBatch(input_ids=np.ones((2, 1), np.int32),
                          targets=np.full((2, 1), 2, np.int32),
                          loss_mask=np.full((2, 1), mask, np.float32),
                          positions=np.zeros((2, 1), np.int32),
                          segment_ids=np.ones((2, 1), np.int32))

    state, applied, reported = init_state(table, tx, 0), [], []
    for s in range(5):
        applied.append(rate(state.opt_state))
        state, metrics = step(state, batch(np.nan if s == 1 else 1.0))
        reported.append(float(metrics["learning_rate"]))

    np.testing.assert_allclose(applied, [1.0, 0.9, 0.8, 0.7, 0.6], rtol=0, atol=1e-6)
    np.testing.assert_allclose(reported, applied, rtol=0, atol=1e-6)


def test_step_over_state_leaves_equals_the_pytree_step_bitwise():
    # Same program, only the arguments are passed as a list: the numbers must not move at all.
    config = tiny_config()  # AdamW, as the jobs train
    ref_state, ref_hist = _train(config, _two_batches(), [jax.devices()[0]])
    leaf_state, leaf_hist = _train(config, _two_batches(), [jax.devices()[0]], leaves=True)
    for r, a in zip(ref_hist, leaf_hist, strict=True):
        assert a["loss"] == r["loss"] and a["grad_norm"] == r["grad_norm"]
    assert_trees_equal(leaf_state, ref_state)


def test_microbatch_gradients_of_bfloat16_params_are_summed_in_float32():
    # bfloat16 sums would round at every microbatch: the error would grow with their number.
    import jax.numpy as jnp

    from meshrl.trainer.step import make_grads_fn

    B = 32
    batch = jax.tree.map(jnp.asarray, TrainBatch.from_mapping(RandomIterator(B, 16).batch(0)))
    cfg = tiny_config(**{"model.param_dtype": "bfloat16", "model.compute_dtype": "float32",
                         "trainer.batch_size": B})
    trainee = make_trainee(cfg, mesh_for(cfg))
    p16 = trainee.params
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32), p16)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32))  # noqa: E731
                                     for x in jax.tree.leaves(t)])

    def grads(params, m):
        _, weight, _, g = jax.jit(make_grads_fn(trainee.forward, get_loss("sft"), m))(
            params, batch)
        return g, flat(g) / float(weight)

    want = grads(p32, 1)[1]
    error = {m: np.linalg.norm(grads(p16, m)[1] - want) / np.linalg.norm(want) for m in (1, 16)}

    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads(p16, 16)[0]))
    assert error[16] <= error[1] * 1.05, error
