"""Policy losses, KL estimators, entropy and aggregation on tiny hand-checkable arrays."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms import kl
from meshrl.algorithms import policy_loss as pl
from meshrl.algorithms import rollout_correction as rc
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.configs.schema import RLConfig

RTOL, ATOL = 1e-5, 1e-6


def loss_params(**overrides: object) -> pl.LossParams:
    """Symmetric clipping at 0.2, no dual clip, no behaviour-weight cap (AReaL's zero mode when
    one is set) and no rollout correction, unless overridden."""
    return pl.LossParams(**{"eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 0.0,
                            "behav_weight_cap": 0.0, "behav_cap_mode": "zero",
                            "correction": rc.OFF, **overrides})


def one_token(logp: float, old: float, adv: float) -> pl.PolicyInputs:
    a = lambda x: jnp.array([[x]], jnp.float32)  # noqa: E731
    return pl.PolicyInputs(a(logp), a(old), a(old), a(adv), a(1.0))


def loss_and_grad(name: str, inputs: pl.PolicyInputs, params: pl.LossParams,
                  aggregation: str = "token_mean") -> tuple[jax.Array, jax.Array]:
    def f(logp_BxL: jax.Array) -> jax.Array:
        return pl.policy_loss(name, inputs._replace(logprobs_BxL=logp_BxL), params,
                              aggregation=aggregation)[0]
    return jax.value_and_grad(f)(inputs.logprobs_BxL)


def random_inputs(seed: int = 0, B: int = 3, L: int = 5) -> pl.PolicyInputs:
    k = jax.random.split(jax.random.key(seed), 4)
    logp = -jax.random.uniform(k[0], (B, L), minval=0.1, maxval=3.0)
    prox = logp + 0.3 * jax.random.normal(k[1], (B, L))
    behav = prox + 0.3 * jax.random.normal(k[2], (B, L))
    adv = jax.random.normal(k[3], (B, L))
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], jnp.float32)[:B, :L]
    return pl.PolicyInputs(logp, prox, behav, adv, mask)


def test_decoupled_loss_equals_ppo_when_behaviour_is_proximal():
    inputs = random_inputs()
    inputs = inputs._replace(behaviour_logprobs_BxL=inputs.proximal_logprobs_BxL)
    params = loss_params(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, behav_weight_cap=2.0)

    ppo_loss, ppo_grad = loss_and_grad("ppo", inputs, params)
    dec_loss, dec_grad = loss_and_grad("decoupled_ppo", inputs, params)

    np.testing.assert_allclose(dec_loss, ppo_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dec_grad, ppo_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("log_ratio, adv, grad_is_zero", [
    (math.log(1.5), 1.0, True),    # above 1 + eps_high with A > 0: clipped
    (math.log(1.25), 1.0, False),  # inside clip-higher range (eps_high 0.28)
    (math.log(0.5), 1.0, False),   # below 1 - eps_low with A > 0: still pushed up
    (math.log(0.5), -1.0, True),   # below 1 - eps_low with A < 0: clipped
    (math.log(1.5), -1.0, False),  # above 1 + eps_high with A < 0: still pushed down
])
def test_ppo_gradient_is_zero_only_outside_the_clip_range_in_the_advantage_direction(
        log_ratio, adv, grad_is_zero):
    params = loss_params(eps_low=0.2, eps_high=0.28)

    loss, grad = loss_and_grad("ppo", one_token(-1.0 + log_ratio, -1.0, adv), params)
    _, metrics = pl.policy_loss("ppo", one_token(-1.0 + log_ratio, -1.0, adv), params)

    assert (float(grad[0, 0]) == 0.0) == grad_is_zero, grad
    assert float(metrics["clip_frac"]) == float(grad_is_zero)


def test_eps_high_is_separate_from_eps_low():
    inputs = one_token(math.log(1.25), 0.0, 1.0)

    symmetric = loss_and_grad("ppo", inputs, loss_params(eps_low=0.2, eps_high=0.2))
    clip_higher = loss_and_grad("ppo", inputs, loss_params(eps_low=0.2, eps_high=0.28))

    np.testing.assert_allclose(symmetric[0], -1.2, rtol=RTOL, atol=ATOL)
    assert float(symmetric[1][0, 0]) == 0.0
    np.testing.assert_allclose(clip_higher[0], -1.25, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(clip_higher[1][0, 0], -1.25, rtol=RTOL, atol=ATOL)


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_abs_advantage():
    inputs = one_token(math.log(10.0), 0.0, -2.0)

    plain_loss, _ = loss_and_grad("ppo", inputs, loss_params())
    dual_loss, dual_grad = loss_and_grad("ppo", inputs, loss_params(dual_clip_c=3.0))
    _, metrics = pl.policy_loss("ppo", inputs, loss_params(dual_clip_c=3.0))

    np.testing.assert_allclose(plain_loss, 20.0, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dual_loss, 6.0, rtol=RTOL, atol=ATOL)
    assert float(dual_grad[0, 0]) == 0.0
    assert float(metrics["dual_clip_frac"]) == 1.0


def test_dual_clip_leaves_positive_advantages_alone():
    inputs = one_token(math.log(10.0), 0.0, 2.0)

    plain, _ = loss_and_grad("ppo", inputs, loss_params())
    dual, _ = loss_and_grad("ppo", inputs, loss_params(dual_clip_c=3.0))

    np.testing.assert_allclose(dual, plain, rtol=RTOL, atol=ATOL)


def test_gspo_uses_the_exp_mean_token_log_ratio_per_sequence():
    log_ratio = jnp.array([[0.1, 0.3, 9.0]])  # the third token is masked
    mask = jnp.array([[1.0, 1.0, 0.0]])
    zeros = jnp.zeros((1, 3))
    inputs = pl.PolicyInputs(log_ratio, zeros, zeros, jnp.full((1, 3), -1.0), mask)
    s = math.exp(0.2)

    loss, metrics = pl.policy_loss("gspo", inputs, loss_params(eps_low=0.1, eps_high=0.1))

    np.testing.assert_allclose(metrics["ratio_mean"], s, rtol=RTOL, atol=ATOL)
    # A < 0: objective min(s*A, clip(s)*A) = -s (unclipped branch, since s > 1.1 is false).
    np.testing.assert_allclose(loss, -min(s * -1, min(s, 1.1) * -1), rtol=RTOL, atol=ATOL)


def test_gspo_clips_at_sequence_level():
    inputs = pl.PolicyInputs(jnp.full((1, 2), 0.5), jnp.zeros((1, 2)), jnp.zeros((1, 2)),
                             jnp.ones((1, 2)), jnp.ones((1, 2)))

    loss, grad = loss_and_grad("gspo", inputs, loss_params(eps_low=0.2, eps_high=0.2))

    np.testing.assert_allclose(loss, -1.2, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize(("mode", "count"), [("zero", 2.0), ("drop", 1.0)])
def test_decoupled_weight_is_stop_gradient_and_tokens_above_the_cap_are_not_trained(mode, count):
    # token 0: weight pi_prox/pi_behav = 2 (kept); token 1: weight e^3 ~ 20 > cap. AReaL's
    # "zero" keeps token 1 in the normaliser (loss -2 / 2 tokens), "drop" removes it (-2 / 1).
    logp = jnp.array([[-1.0, -1.0]])
    prox = jnp.array([[-1.0, -1.0]])
    behav = jnp.array([[-1.0 - math.log(2.0), -4.0]])
    adv, mask = jnp.array([[1.0, 1.0]]), jnp.ones((1, 2))
    inputs = pl.PolicyInputs(logp, prox, behav, adv, mask)
    params = loss_params(behav_weight_cap=5.0, behav_cap_mode=mode)

    (loss, grad) = loss_and_grad("decoupled_ppo", inputs, params)
    _, metrics = pl.policy_loss("decoupled_ppo", inputs, params)

    np.testing.assert_allclose(loss, -2.0 / count, rtol=RTOL, atol=ATOL)  # token 0: -w r A
    np.testing.assert_allclose(grad, [[-2.0 / count, 0.0]], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["behav_capped_frac"], 0.5, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "gspo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_masked_tokens_change_neither_loss_nor_grads(name, aggregation):
    inputs = random_inputs()
    off = inputs.loss_mask_BxL == 0
    junk = lambda x, v: jnp.where(off, v, x)  # noqa: E731
    garbled = pl.PolicyInputs(junk(inputs.logprobs_BxL, -1e9),
                              junk(inputs.proximal_logprobs_BxL, 7.0),
                              junk(inputs.behaviour_logprobs_BxL, -jnp.inf),
                              junk(inputs.advantages_BxL, 1e6), inputs.loss_mask_BxL)
    params = loss_params(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, behav_weight_cap=5.0)

    loss, grad = loss_and_grad(name, inputs, params, aggregation)
    loss2, grad2 = loss_and_grad(name, garbled, params, aggregation)

    np.testing.assert_allclose(loss2, loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad2, grad, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(grad)[np.asarray(off)], 0.0)


def test_token_mean_weighs_tokens_and_sequence_mean_weighs_sequences():
    x_BxL = jnp.array([[1.0, 0.0, 0.0], [3.0, 3.0, 6.0], [5.0, 5.0, 5.0]])
    mask_BxL = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]], jnp.float32)

    tok_sum, tok_w = pl.aggregate(x_BxL, mask_BxL, "token_mean")
    seq_sum, seq_w = pl.aggregate(x_BxL, mask_BxL, "sequence_mean")

    np.testing.assert_allclose(tok_sum / tok_w, (1 + 3 + 3 + 6) / 4, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(seq_sum / seq_w, (1 + 4) / 2, rtol=RTOL, atol=ATOL)
    assert float(seq_w) == 2.0  # the all-masked row is not a sequence


def test_kl_estimators_match_hand_computed_values():
    logp, ref = jnp.array([[-1.0]]), jnp.array([[-2.0]])

    np.testing.assert_allclose(kl.get("k1")(logp, ref), 1.0, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(kl.get("k2")(logp, ref), 0.5, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(kl.get("k3")(logp, ref), math.exp(-1.0), rtol=RTOL, atol=ATOL)


@settings(max_examples=50, deadline=None)
@given(st.floats(-15, 0), st.floats(-15, 0))
def test_k2_and_k3_are_non_negative_and_zero_only_at_equal_policies(logp, ref):
    a, b = jnp.array([[logp]], jnp.float32), jnp.array([[ref]], jnp.float32)

    for name in ("k2", "k3"):
        v = float(kl.get(name)(a, b)[0, 0])
        assert v >= -1e-6
    np.testing.assert_allclose(kl.get("k3")(a, a), 0.0, rtol=0, atol=ATOL)


def test_kl_in_reward_subtracts_the_summed_masked_kl_per_sequence():
    logp = jnp.array([[-1.0, -1.0, -1.0]])
    ref = jnp.array([[-2.0, -1.5, -9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])

    out = kl.kl_in_reward(jnp.array([1.0]), logp, ref, mask, coef=0.1, estimator="k1")

    np.testing.assert_allclose(out, [1.0 - 0.1 * 1.5], rtol=RTOL, atol=ATOL)


def rl_batch(B: int = 2, L: int = 4, V: int = 5) -> tuple[jax.Array, RLTrainBatch]:
    k = jax.random.split(jax.random.key(1), 3)
    logits = jax.random.normal(k[0], (B, L, V))
    targets = jax.random.randint(k[1], (B, L), 0, V)
    mask = jnp.array([[0, 1, 1, 0], [0, 0, 1, 1]], jnp.float32)
    behav = jnp.where(mask > 0, jax.nn.log_softmax(logits)[
        jnp.arange(B)[:, None], jnp.arange(L)[None], targets] - 0.1, 0.0)
    # The loss reads no input ids, positions, versions or sample ids; one sequence per row.
    return logits, RLTrainBatch(input_ids=None, targets=targets, loss_mask=mask, positions=None,
                                segment_ids=None, behaviour_logprobs=behav,
                                advantages=mask * jnp.array([[1.0], [-1.0]]), versions=None,
                                sample_ids=None, ref_logprobs=behav - 0.2)


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled_ppo",
                                         pytest.param("gspo", marks=pytest.mark.slow)])
def test_rl_loss_fn_is_jittable_and_returns_sums_the_trainer_divides(policy_loss):
    rl = RLConfig(policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.01)
    loss_fn = pl.make_rl_loss_fn(rl)
    logits, batch = rl_batch()

    loss_sum, weight, aux = jax.jit(loss_fn)(logits, batch)
    grads = jax.grad(lambda lg: loss_fn(lg, batch)[0])(logits)

    assert float(weight) == 4.0
    assert np.isfinite(float(loss_sum)) and np.isfinite(np.asarray(grads)).all()
    assert {"clip_frac", "ratio_mean", "approx_kl", "kl_ref", "entropy"} <= set(aux)
    np.testing.assert_allclose(np.asarray(grads)[0, 0], 0.0, rtol=0, atol=0)  # masked position
    np.testing.assert_allclose(float(aux["ratio_mean"].value()),
                               float(pl.policy_loss(policy_loss, pl.PolicyInputs(
                                   pl.token_logprobs(logits, batch.targets),
                                   pl.token_logprobs(logits, batch.targets),
                                   batch.behaviour_logprobs, batch.advantages,
                                   batch.loss_mask), pl.LossParams.from_config(rl))[1][
                                   "ratio_mean"]), rtol=1e-5, atol=1e-6)


def test_unknown_policy_loss_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="decoupled_ppo"):
        pl.get("trpo")


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_rl_loss_sums_add_over_microbatches_like_one_batch(aggregation):
    rl = RLConfig(policy_loss="decoupled_ppo", aggregation=aggregation, kl_coef=0.05)
    loss_fn = pl.make_rl_loss_fn(rl)
    logits, batch = rl_batch()
    halves = [(logits[i:i + 1], jax.tree.map(lambda v, i=i: v[i:i + 1], batch)) for i in range(2)]

    whole_sum, whole_w, _ = loss_fn(logits, batch)
    parts = [loss_fn(lg, b) for lg, b in halves]

    np.testing.assert_allclose(sum(p[0] for p in parts), whole_sum, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(sum(p[1] for p in parts), whole_w, rtol=RTOL, atol=ATOL)


def test_rl_loss_fn_divided_by_weight_equals_the_policy_loss_mean():
    rl = RLConfig(policy_loss="ppo", aggregation="sequence_mean")
    logits, batch = rl_batch()
    logp = pl.token_logprobs(logits, batch.targets)
    inputs = pl.PolicyInputs(logp, logp, batch.behaviour_logprobs, batch.advantages,
                             batch.loss_mask)

    loss_sum, weight, _ = pl.make_rl_loss_fn(rl)(logits, batch)
    expected, _ = pl.policy_loss("ppo", inputs, pl.LossParams.from_config(rl),
                                 aggregation="sequence_mean")

    assert float(weight) == 2.0  # two sequences
    np.testing.assert_allclose(loss_sum / weight, expected, rtol=RTOL, atol=ATOL)


def test_kl_reward_advantages_subtract_the_sequence_kl_before_the_estimator():
    rewards = jnp.array([1.0, 0.0, 0.5, 0.5])
    behav = jnp.full((4, 3), -1.0)
    ref = jnp.array([[-2.0, -1.0, -5.0]] * 2 + [[-1.0, -1.0, -1.0]] * 2)
    mask = jnp.array([[1, 1, 0]] * 4, jnp.float32)
    rl_off = RLConfig(advantage="drgrpo", kl_coef=0.0)
    rl_on = RLConfig(advantage="drgrpo", kl_coef=0.5, kl_where="reward", kl_estimator="k1")

    off = kl.kl_reward_advantages(rl_off, rewards, behav, ref, mask, group_size=2)
    on = kl.kl_reward_advantages(rl_on, rewards, behav, ref, mask, group_size=2)

    np.testing.assert_allclose(off, [0.5, -0.5, 0.0, 0.0], rtol=RTOL, atol=ATOL)
    # rows 0-1 each lose 0.5 * 1.0 (KL 1 on the first token; the masked third token is ignored)
    np.testing.assert_allclose(on, [0.5, -0.5, 0.0, 0.0], rtol=RTOL, atol=ATOL)
    shifted = kl.kl_reward_advantages(rl_on, rewards, behav, ref.at[0, 0].set(-1.0), mask, 2)
    np.testing.assert_allclose(shifted, [0.75, -0.75, 0.0, 0.0], rtol=RTOL, atol=ATOL)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), eps_low=st.floats(0.0, 0.5), eps_high=st.floats(0.0, 0.5))
def test_decoupled_equals_ppo_for_any_inputs_when_behaviour_is_proximal(seed, eps_low, eps_high):
    inputs = random_inputs(seed)
    inputs = inputs._replace(behaviour_logprobs_BxL=inputs.proximal_logprobs_BxL)
    params = loss_params(eps_low=eps_low, eps_high=eps_high, behav_weight_cap=1.0)

    ppo = pl.policy_loss("ppo", inputs, params)[0]
    dec = pl.policy_loss("decoupled_ppo", inputs, params)[0]

    np.testing.assert_allclose(dec, ppo, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "gspo"])
def test_policy_loss_jits_with_static_params(name):
    f = jax.jit(pl.policy_loss, static_argnames=("name", "params", "aggregation"))
    inputs = random_inputs()

    loss, metrics = f(name, inputs, loss_params(dual_clip_c=3.0), aggregation="sequence_mean")
    eager, _ = pl.policy_loss(name, inputs, loss_params(dual_clip_c=3.0),
                              aggregation="sequence_mean")

    np.testing.assert_allclose(loss, eager, rtol=RTOL, atol=ATOL)
    assert set(metrics) >= {"clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl"}


def test_loss_params_have_no_defaults_of_their_own_and_take_the_config_values():
    rl = RLConfig()

    params = pl.LossParams.from_config(rl)

    assert params == pl.LossParams(eps_low=rl.eps_low, eps_high=rl.eps_high,
                                   dual_clip_c=rl.dual_clip_c,
                                   behav_weight_cap=rl.behav_weight_cap,
                                   behav_cap_mode=rl.behav_cap_mode,
                                   correction=rc.CorrectionParams.from_config(rl))
    with pytest.raises(TypeError, match="missing 6 required"):
        pl.LossParams()  # type: ignore[call-arg]
