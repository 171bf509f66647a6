"""The RL train step (``trainer/rl_step.py``): one minibatch is bitwise the plain step, several
minibatches share the whole batch's denominator and the pre-batch proximal policy (so later
minibatches get clipped), and the sampler-trainer logprob mismatch counts only the tokens of
the step's weight version."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshrl.algorithms import policy_loss as pl
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.configs.schema import OptimizerConfig, RLConfig
from meshrl.tests.trees import assert_trees_equal
from meshrl.tests.workflows.test_trainer_contract import V, forward, groups
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.rl_step import make_rl_train_step
from meshrl.trainer.state import init_state
from meshrl.trainer.step import make_train_step
from meshrl.workflows import build_rl_batch

# Variants of a case the default run already checks on another setting; -m slow runs them.
SLOW = pytest.mark.slow


def _contract_batch(params: dict) -> RLTrainBatch:
    """4 sequences of 1-3 loss tokens (uneven: a per-minibatch mean is not a share)."""
    batch = build_rl_batch(groups(params["table"]), length_buckets=(6,))
    return jax.tree.map(jnp.asarray, batch)


def _run(step, params: dict, tx: optax.GradientTransformation, batch: RLTrainBatch,
         step0: int = 0):
    state = init_state(params, tx, seed=0).replace(step=jnp.asarray(step0, jnp.int32))
    return jax.jit(step)(state, batch)


@pytest.mark.parametrize("policy_loss", ["decoupled_ppo", pytest.param("gspo", marks=SLOW)])
def test_one_minibatch_and_one_epoch_is_bitwise_the_plain_train_step(policy_loss):
    params = {"table": 0.3 * jax.random.normal(jax.random.key(0), (V, V))}
    batch = _contract_batch(params)
    rl = RLConfig(policy_loss=policy_loss, entropy_coef=0.01, ppo_minibatches=1, ppo_epochs=1)
    loss_fn = pl.make_rl_loss_fn(rl)
    tx, schedule = make_optimizer(OptimizerConfig(), 0.1, 10)  # AdamW, clipping, cosine

    s_new, m_new = _run(make_rl_train_step(forward, loss_fn, tx, schedule, rl=rl, microbatches=2),
                        params, tx, batch)
    s_old, m_old = _run(make_train_step(forward, loss_fn, tx, schedule, microbatches=2),
                        params, tx, batch)

    assert_trees_equal(s_new, s_old)
    assert set(m_new) - set(m_old) == {"logprob_mismatch", "logprob_mismatch_max",
                                       "logprob_mismatch_tokens"}
    for k in m_old:
        np.testing.assert_array_equal(np.asarray(m_new[k]), np.asarray(m_old[k]), err_msg=k)


def _one_token_rows(rows: int) -> RLTrainBatch:
    """``rows`` copies of one loss token 1 -> 2, advantage +1, sampled (version 0) from the
    uniform bigram table: behaviour logprob -log V."""
    full = lambda v, dtype=jnp.float32: jnp.full((rows, 1), v, dtype)  # noqa: E731
    return RLTrainBatch(input_ids=full(1, jnp.int32), targets=full(2, jnp.int32),
                        loss_mask=full(1.0), positions=full(0, jnp.int32),
                        segment_ids=full(1, jnp.int32),
                        behaviour_logprobs=full(-math.log(V)), advantages=full(1.0),
                        versions=full(0, jnp.int32),
                        sample_ids=jnp.arange(rows, dtype=jnp.int32)[:, None])


@pytest.mark.parametrize("policy_loss", [pytest.param("ppo", marks=SLOW), "decoupled_ppo"])
def test_after_the_first_minibatch_update_the_later_minibatches_are_clipped(policy_loss):
    # Hand-computed: minibatch 0 (1 of 4 tokens, divided by the batch's 4) moves the target
    # logit by lr * (1 - 1/8) / 4 = 2.1875 and the others by -0.3125, so pi(2 | 1) goes from
    # 1/8 to e^2.5 / (e^2.5 + 7) = 0.635: ratio 5.1 > 1 + eps_high for minibatches 1-3, whose
    # clipped surrogate then has zero gradient. Clipped fraction: 3 of 4 tokens.
    params = {"table": jnp.zeros((V, V))}
    batch = _one_token_rows(4)
    tx = optax.sgd(10.0)
    outs = {}
    for k in (1, 4):
        rl = RLConfig(policy_loss=policy_loss, ppo_minibatches=k)
        step = make_rl_train_step(forward, pl.make_rl_loss_fn(rl), tx, lambda s: 10.0, rl=rl)
        outs[k] = _run(step, params, tx, batch)

    (s1, m1), (s4, m4) = outs[1], outs[4]
    assert float(m1["clip_frac"]) == 0.0
    np.testing.assert_allclose(float(m4["clip_frac"]), 0.75, rtol=0, atol=1e-6)
    assert int(m4["updates"]) == 4 and float(m4["tokens"]) == 4.0
    # Only minibatch 0 moved the table: the same move as the whole batch's one update.
    np.testing.assert_allclose(s4.params["table"][1, 2], 2.1875, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s1.params["table"][1, 2], 4 * 2.1875, rtol=1e-5, atol=1e-6)
    assert int(s4.step) == 1 and int(s4.weight_version) == 1 and int(s4.skipped) == 0


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("epochs", [1, pytest.param(2, marks=SLOW)])
def test_minibatch_losses_share_the_whole_batch_denominator(aggregation, epochs):
    # At learning rate 0 every update sees the pre-batch params: the minibatch shares of the
    # loss and its statistics must add up to the one-update values, not average per minibatch.
    params = {"table": 0.3 * jax.random.normal(jax.random.key(1), (V, V))}
    batch = _contract_batch(params)
    tx = optax.sgd(0.0)
    metrics = {}
    for k, e in ((1, 1), (2, epochs)):
        rl = RLConfig(aggregation=aggregation, ppo_minibatches=k, ppo_epochs=e)
        step = make_rl_train_step(forward, pl.make_rl_loss_fn(rl), tx, lambda s: 0.0, rl=rl)
        metrics[k] = _run(step, params, tx, batch)[1]

    for key in ("loss", "tokens", "clip_frac", "ratio_mean", "behav_weight_mean",
                "logprob_mismatch", "logprob_mismatch_max", "logprob_mismatch_tokens"):
        np.testing.assert_allclose(metrics[2][key], metrics[1][key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_logprob_mismatch_counts_only_loss_tokens_of_the_steps_weight_version():
    params = {"table": 0.3 * jax.random.normal(jax.random.key(2), (V, V))}
    batch = _contract_batch(params)
    mask = np.asarray(batch.loss_mask) > 0
    # Shift the behaviour logprobs by a known gap; tokens of version 3 are the step's own.
    gap_BxL = np.where(mask, 0.01 * (1 + np.arange(mask.size).reshape(mask.shape)), 0.0)
    versions = np.where(mask, np.where(np.arange(mask.shape[1]) % 2 == 0, 3, 2), -1)
    batch = batch.replace(behaviour_logprobs=batch.behaviour_logprobs + gap_BxL,
                          versions=jnp.asarray(versions, jnp.int32))
    own = mask & (versions == 3)
    want = np.abs(gap_BxL[own])
    tx = optax.sgd(0.0)

    for k in (1, 2):
        rl = RLConfig(ppo_minibatches=k)
        step = make_rl_train_step(forward, pl.make_rl_loss_fn(rl), tx, lambda s: 0.0, rl=rl,
                                  microbatches=2 // k)
        _, m = _run(step, params, tx, batch, step0=3)
        _, none = _run(step, params, tx, batch, step0=7)

        np.testing.assert_allclose(m["logprob_mismatch"], want.mean(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(m["logprob_mismatch_max"], want.max(), rtol=1e-4, atol=1e-6)
        assert float(m["logprob_mismatch_tokens"]) == own.sum() > 0
        assert [float(none[f"logprob_mismatch{s}"]) for s in ("", "_max", "_tokens")] == [0] * 3


def test_loss_weight_is_the_loss_functions_weight_without_a_model_output():
    params = {"table": 0.3 * jax.random.normal(jax.random.key(3), (V, V))}
    batch = _contract_batch(params)
    logits = forward(params, batch.input_ids)
    batch = batch.replace(proximal_logprobs=pl.token_logprobs(logits, batch.targets))
    for rl in (RLConfig(), RLConfig(aggregation="sequence_mean"), RLConfig(policy_loss="gspo"),
               RLConfig(behav_weight_cap=1.0, behav_cap_mode="drop"),
               RLConfig(rollout_correction="mis_seq", correction_high=1.01)):
        np.testing.assert_array_equal(pl.loss_weight(rl, batch),
                                      pl.make_rl_loss_fn(rl)(logits, batch)[1])


def _shifted_behaviour(params: dict, rho_of_token) -> tuple[RLTrainBatch, np.ndarray]:
    """The contract batch with behaviour logprobs lowered by log rho per loss token (so
    pi_old / pi_behav = rho under ``params``) and the rho of each token (1 off the mask)."""
    batch = _contract_batch(params)
    mask = np.asarray(batch.loss_mask) > 0
    rho = np.where(mask, rho_of_token(np.arange(mask.size).reshape(mask.shape)), 1.0)
    return batch.replace(behaviour_logprobs=batch.behaviour_logprobs - np.log(rho)), rho


@pytest.mark.parametrize("k", [pytest.param(1, marks=SLOW), 2])
def test_rollout_correction_config_takes_effect_in_the_rl_step(k):
    # rho cycles 0.3, 1, 8 over the tokens: mis_token keeps only the rho = 1 tokens (band
    # [0.5, 5]), so the step's loss weight counts them alone; the metrics report the raw rho.
    params = {"table": 0.3 * jax.random.normal(jax.random.key(4), (V, V))}
    batch, rho = _shifted_behaviour(params, lambda i: np.array([0.3, 1.0, 8.0])[i % 3])
    mask = np.asarray(batch.loss_mask) > 0
    tx = optax.sgd(0.0)
    metrics = {}
    for mode in ("none", "mis_token"):
        rl = RLConfig(rollout_correction=mode, ppo_minibatches=k)
        step = make_rl_train_step(forward, pl.make_rl_loss_fn(rl), tx, lambda s: 0.0, rl=rl)
        metrics[mode] = _run(step, params, tx, batch)[1]

    on, off = metrics["mis_token"], metrics["none"]
    kept = mask & (rho == 1.0)
    assert 0 < kept.sum() < mask.sum()
    assert float(on["tokens"]) == kept.sum() and float(off["tokens"]) == mask.sum()
    np.testing.assert_allclose(on["rollout_is_weight"], rho[mask].mean(), rtol=1e-4)
    np.testing.assert_allclose(on["rollout_is_weight_max"], 8.0, rtol=1e-4)
    assert float(on["rollout_is_weight_tokens"]) == mask.sum()
    # Per-token statistics are over the tokens each update was given, whatever the split: the
    # rejected tokens' share, not weighted by the tokens the correction kept.
    np.testing.assert_allclose(on["rollout_corr_frac"], 1.0 - kept.sum() / mask.sum(),
                               rtol=1e-5)
    assert "rollout_is_weight" not in off and "rollout_corr_frac" not in off
    assert not np.isclose(float(on["loss"]), float(off["loss"]))


@pytest.mark.parametrize("k", [pytest.param(1, marks=SLOW), 2])
def test_behav_cap_mode_sets_the_decoupled_normaliser_in_the_rl_step(k):
    # Two of every three tokens have pi_prox / pi_behav = 8 > behav_weight_cap = 5: AReaL's
    # "zero" keeps them in the denominator, "drop" leaves only the others.
    params = {"table": 0.3 * jax.random.normal(jax.random.key(5), (V, V))}
    batch, rho = _shifted_behaviour(params, lambda i: np.where(i % 3 == 0, 1.0, 8.0))
    mask = np.asarray(batch.loss_mask) > 0
    tx = optax.sgd(0.0)
    out = {}
    for mode in ("zero", "drop"):
        rl = RLConfig(behav_cap_mode=mode, ppo_minibatches=k)
        step = make_rl_train_step(forward, pl.make_rl_loss_fn(rl), tx, lambda s: 0.0, rl=rl,
                                  microbatches=2 // k)
        out[mode] = _run(step, params, tx, batch)[1]

    uncapped = (mask & (rho <= 5.0)).sum()
    assert float(out["zero"]["tokens"]) == mask.sum() > float(out["drop"]["tokens"]) == uncapped
    # The same kept tokens' loss, divided by the two counts.
    np.testing.assert_allclose(out["zero"]["loss"] * mask.sum(),
                               out["drop"]["loss"] * uncapped, rtol=1e-5, atol=1e-6)
