"""Advantage estimators and reward shaping: group laws, hand-computed values, broadcast."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algorithms import advantages

# Rewards on a quarter grid, as verifiable rewards are: with arbitrary floats a group whose
# rewards differ only in the last ulp has std ~1e-7 and GRPO's division by (std + eps) turns the
# float32 rounding of the mean into O(1) noise, which is arithmetic, not the estimator's law.
REWARDS_GXN = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=2,
                                                     max_side=6),
                         elements=st.integers(-40, 40).map(lambda k: k / 4))


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
@given(r=REWARDS_GXN)
def test_group_advantages_sum_to_zero_per_group(name, r):
    adv_GxN = np.asarray(advantages.get(name)(jnp.asarray(r)))

    np.testing.assert_allclose(adv_GxN.sum(-1), 0.0, rtol=0, atol=1e-3 * r.shape[1])


@settings(max_examples=40, deadline=None)
@given(r=REWARDS_GXN)
def test_reinforce_pp_is_normalised_over_the_whole_batch(r):
    adv_GxN = np.asarray(advantages.get("reinforce_pp")(jnp.asarray(r)))

    np.testing.assert_allclose(adv_GxN.sum(), 0.0, rtol=0, atol=1e-3 * r.size)
    if r.std() > 1e-2:
        np.testing.assert_allclose(adv_GxN.std(), 1.0, rtol=1e-3, atol=1e-3)


def test_grpo_standardises_each_group():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]])

    adv = np.asarray(advantages.get("grpo")(r, eps=0.0))

    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(adv.std(-1), [1.0, 1.0], rtol=1e-6, atol=1e-6)


def test_drgrpo_subtracts_the_mean_without_scaling():
    r = jnp.array([[4.0, 0.0, 0.0, 0.0]])

    np.testing.assert_allclose(advantages.get("drgrpo")(r), [[3, -1, -1, -1]], rtol=0, atol=1e-6)


def test_rloo_baseline_leaves_the_sample_itself_out():
    r = np.array([[1.0, 2.0, 6.0]], np.float32)
    expected = [[1 - 4.0, 2 - 3.5, 6 - 1.5]]

    np.testing.assert_allclose(advantages.get("rloo")(jnp.asarray(r)), expected, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp"])
def test_constant_rewards_give_zero_finite_advantages(name):
    adv = np.asarray(advantages.get(name)(jnp.ones((2, 4))))

    assert np.isfinite(adv).all()
    np.testing.assert_allclose(adv, 0.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("value, group_size", [(0.7, 7), (0.1, 7), (100.3, 3), (100.3, 6)])
@pytest.mark.parametrize("on", ["numpy", "jax"])
def test_equal_non_dyadic_rewards_give_exactly_zero(name, value, group_size, on):
    # A float32 mean of 7 x 0.7 is one ulp off: divided by a std of one ulp, GRPO gave the
    # whole group +0.056 (100.3 x 3: 0.88).
    rewards = np.full((2, group_size), value, np.float32)
    adv = advantages.get(name)(rewards if on == "numpy" else jnp.asarray(rewards))

    np.testing.assert_array_equal(np.asarray(adv), 0.0)


def test_compute_on_flat_rewards_matches_group_layout():
    r_B = jnp.arange(6, dtype=jnp.float32) ** 2

    flat = advantages.compute("grpo", r_B, group_size=3)

    np.testing.assert_allclose(flat.reshape(2, 3), advantages.grpo(r_B.reshape(2, 3)), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(AssertionError, match="whole number of groups"):
        advantages.compute("grpo", r_B, group_size=4)


def test_unknown_advantage_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="registered: .*grpo"):
        advantages.get("gae")


def test_overlong_penalty_is_zero_then_linear_then_capped():
    lengths_B = jnp.array([0, 6, 8, 10, 12])

    pen_B = advantages.overlong_penalty(lengths_B, max_len=10, buffer=4, penalty=1.0)

    assert pen_B.shape == (5,)
    np.testing.assert_allclose(pen_B, [0, 0, -0.5, -1, -1], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(advantages.overlong_penalty(lengths_B, max_len=10, buffer=0), 0)


@pytest.mark.parametrize("name", advantages.names())
@pytest.mark.parametrize("group_size", [1, 4])
def test_estimators_on_numpy_stay_on_the_host_and_match_the_jax_result(name, group_size):
    # The rollout side calls them on numpy arrays so that no device work is queued.
    rewards_B = np.array([0.0, 1.0, 1.0, 0.5, 0.25, 0.0, 1.0, 0.75], np.float32)

    tokens_B = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.float32)
    for tokens in (None, tokens_B):
        host_B = advantages.compute(name, rewards_B, group_size, tokens_B=tokens)
        device_B = advantages.compute(name, jnp.asarray(rewards_B), group_size,
                                      tokens_B=None if tokens is None else jnp.asarray(tokens))

        assert isinstance(host_B, np.ndarray) and host_B.dtype == np.float32
        np.testing.assert_allclose(host_B, np.asarray(device_B), rtol=1e-6, atol=1e-6)


def test_reinforce_pp_whitens_over_the_loss_tokens():
    # REINFORCE++ (verl's masked_whiten of the token-level returns): over the batch's loss
    # tokens the advantages have mean 0 and population std 1.
    rewards_B = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    tokens_B = np.array([2.0, 8.0, 3.0, 1.0], np.float32)

    adv_B = np.asarray(advantages.compute("reinforce_pp", rewards_B, 2, tokens_B=tokens_B))

    token_adv = np.repeat(adv_B, tokens_B.astype(int))
    np.testing.assert_allclose(token_adv.mean(), 0.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(token_adv.std(), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(
        advantages.compute("reinforce_pp", np.full(4, 0.7, np.float32), 2, tokens_B=tokens_B), 0)


def test_overlong_penalty_on_numpy_matches_the_jax_result():
    lengths_B = np.array([0, 10, 14, 16, 30], np.int32)

    host_B = advantages.overlong_penalty(lengths_B, max_len=16, buffer=4, penalty=0.5)
    device_B = advantages.overlong_penalty(jnp.asarray(lengths_B), max_len=16, buffer=4,
                                           penalty=0.5)

    assert isinstance(host_B, np.ndarray)
    np.testing.assert_allclose(host_B, np.asarray(device_B), rtol=0, atol=1e-7)
    assert isinstance(advantages.overlong_penalty(lengths_B, max_len=16, buffer=0), np.ndarray)
