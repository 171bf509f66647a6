"""Sampling temperature in the RL loss: the trainer scores softmax(logits / T), the policy the
sampler drew the behaviour tokens from, and T = 1 is exactly the untempered computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.losses import token_logprobs
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import RLConfig
from meshrl.inference.sampling import sample
from meshrl.tests.trees import assert_trees_close, assert_trees_equal

B, L, V = 3, 5, 11


def _batch(logits_BxLxV: jax.Array, behaviour_BxL: jax.Array, targets_BxL: jax.Array
           ) -> RLTrainBatch:
    mask_BxL = jnp.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], jnp.float32)
    # The loss reads no input ids, positions, versions or sample ids; one sequence per row.
    return RLTrainBatch(input_ids=None, targets=targets_BxL, loss_mask=mask_BxL, positions=None,
                        segment_ids=None,
                        behaviour_logprobs=jnp.where(mask_BxL > 0, behaviour_BxL, 0.0),
                        advantages=mask_BxL * jnp.array([[1.0], [-0.5], [2.0]]),
                        versions=None, sample_ids=None,
                        ref_logprobs=jnp.where(mask_BxL > 0, behaviour_BxL - 0.3, 0.0))


def _random(seed: int = 0) -> tuple[jax.Array, RLTrainBatch]:
    k = jax.random.split(jax.random.key(seed), 3)
    logits_BxLxV = 2.0 * jax.random.normal(k[0], (B, L, V))
    targets_BxL = jax.random.randint(k[1], (B, L), 0, V)
    behaviour_BxL = token_logprobs(logits_BxLxV, targets_BxL) + 0.2 * jax.random.normal(
        k[2], (B, L))
    return logits_BxLxV, _batch(logits_BxLxV, behaviour_BxL, targets_BxL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_at_temperature_one_are_bitwise_the_untempered_log_softmax(dtype):
    logits_BxLxV, batch = _random()
    logits_BxLxV = logits_BxLxV.astype(dtype)
    l32 = logits_BxLxV.astype(jnp.float32)
    # The formula token_logprobs had before temperature existed.
    before_BxL = (jnp.take_along_axis(l32, batch.targets[..., None], axis=-1)[..., 0]
                  - jax.nn.logsumexp(l32, axis=-1))

    got_BxL = token_logprobs(logits_BxLxV, batch.targets, temperature=1.0)

    np.testing.assert_array_equal(np.asarray(got_BxL), np.asarray(before_BxL))


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled_ppo", "gspo"])
def test_rl_loss_at_temperature_one_is_the_default_program_bitwise(policy_loss):
    rl = RLConfig(policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.01)
    logits_BxLxV, batch = _random()
    default, t1 = make_rl_loss_fn(rl), make_rl_loss_fn(rl, temperature=1.0)

    def value_and_grad(fn):
        return jax.value_and_grad(lambda lg: fn(lg, batch)[0])(logits_BxLxV)

    # Same traced program (no division by 1 sneaks in), hence the same bits.
    assert str(jax.make_jaxpr(t1)(logits_BxLxV, batch)) == str(
        jax.make_jaxpr(default)(logits_BxLxV, batch))
    assert_trees_equal((t1(logits_BxLxV, batch), value_and_grad(t1)),
                       (default(logits_BxLxV, batch), value_and_grad(default)))


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled_ppo", "gspo"])
def test_rl_loss_at_temperature_t_equals_the_untempered_loss_of_logits_over_t(policy_loss):
    T = 0.7
    rl = RLConfig(policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.01)
    logits_BxLxV, batch = _random(1)
    tempered_fn, plain_fn = make_rl_loss_fn(rl, temperature=T), make_rl_loss_fn(rl)

    got = jax.value_and_grad(lambda lg: tempered_fn(lg, batch)[0])(logits_BxLxV)
    want = jax.value_and_grad(lambda lg: plain_fn(lg / T, batch)[0])(logits_BxLxV)
    got_aux, want_aux = tempered_fn(logits_BxLxV, batch)[2], plain_fn(logits_BxLxV / T, batch)[2]

    # float32 rounding of (x / T) in two different graph positions: a few ulps.
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got_aux.keys() == want_aux.keys()
    assert_trees_close(got_aux, want_aux, rtol=1e-5, atol=1e-6)  # ``Mean`` statistics too


def test_sampler_logprobs_at_temperature_t_are_the_trainers_tempered_logprobs():
    T = 0.7
    logits_BxLxV, _ = _random(2)
    flat_NxV = logits_BxLxV.reshape(B * L, V)
    n = B * L
    tokens_N, sampled_N, raw_N = jax.jit(sample)(
        flat_NxV, jnp.full((n,), T), jnp.zeros((n,), jnp.int32), jnp.ones((n,)),
        jnp.arange(n), jnp.zeros((n,), jnp.int32))
    targets_BxL = tokens_N.reshape(B, L)
    batch = _batch(logits_BxLxV, sampled_N.reshape(B, L), targets_BxL)
    mask = np.asarray(batch.loss_mask) > 0

    tempered_BxL = token_logprobs(logits_BxLxV, targets_BxL, temperature=T)
    _, weight, aux = make_rl_loss_fn(RLConfig(), temperature=T)(logits_BxLxV, batch)
    _, _, aux_untempered = make_rl_loss_fn(RLConfig())(logits_BxLxV, batch)

    np.testing.assert_allclose(np.asarray(tempered_BxL).ravel(), np.asarray(sampled_N),
                               rtol=1e-5, atol=1e-6)
    # pi_prox / pi_behav is 1 on every token at the same weights and temperature ...
    np.testing.assert_allclose(float(aux["behav_weight_mean"].value()), 1.0, rtol=1e-5,
                               atol=1e-6)
    # ... and not when the trainer ignores the temperature (the bug this guards against).
    assert abs(float(aux_untempered["behav_weight_mean"].value()) - 1.0) > 1e-2
    assert not np.allclose(np.asarray(raw_N).reshape(B, L)[mask],
                           np.asarray(sampled_N).reshape(B, L)[mask], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_rl_loss_with_a_non_positive_temperature_is_rejected_when_built(temperature):
    with pytest.raises(ValueError, match=f"temperature = {temperature}: must be > 0"):
        make_rl_loss_fn(RLConfig(), temperature=temperature)
