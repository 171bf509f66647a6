"""The trainer's truncated logprobs (algorithms/truncation.py): each target scored under the
logits truncated to its kept count and renormalised, equal to a numpy reference; a target
outside the set stays finite, is masked out of the RL loss and is counted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms import truncation as trunc
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.logits import Hidden, logits_f32, token_stats
from meshrl.algorithms.losses import report_aux
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import RLConfig, SamplerConfig

# Two rows of three positions over a vocabulary of 6 (hand-made, ties in row 1).
LOGITS_2x3x6 = np.asarray([
    [[2.0, 1.0, 0.5, -1.0, 0.0, 3.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
     [1.0, 1.0, 1.0, -2.0, 0.0, 0.0]],
    [[-1.0, 4.0, 2.0, 2.0, 0.0, 1.0], [5.0, -5.0, 0.0, 1.0, 2.0, 3.0],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]], np.float32)
TARGETS_2x3 = np.asarray([[0, 5, 2], [3, 1, 4]], np.int32)
KEPT_2x3 = np.asarray([[3, 6, 3], [3, 2, 0]], np.int32)  # row 1 pos 1: token 1 is outside


def _reference(logits, targets, kept, T=1.0):
    """numpy: logp = z_y - log sum over the kept-th largest and above; outside: z_y < t."""
    z = logits / T
    V = z.shape[-1]
    logp, outside = np.zeros(targets.shape), np.zeros(targets.shape)
    for idx in np.ndindex(targets.shape):
        n = V if kept[idx] <= 0 else kept[idx]
        t = np.sort(z[idx])[::-1][n - 1]
        in_set = z[idx] >= t
        logp[idx] = z[idx][targets[idx]] - np.log(np.exp(z[idx][in_set]).sum())
        outside[idx] = float(z[idx][targets[idx]] < t)
    return logp, outside


@pytest.mark.parametrize("cap", [0, 3])  # 0: a full sort; 3: lax.top_k of 3 (ties beyond it)
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_truncated_logprobs_equal_the_numpy_reference_with_a_token_outside(cap, T):
    stats = token_stats(jnp.asarray(LOGITS_2x3x6), jnp.asarray(TARGETS_2x3), T,
                        kept_BxL=jnp.asarray(KEPT_2x3), kept_cap=cap)

    # A cap promises kept <= cap (top-k): a larger count is read as the cap.
    kept = np.minimum(np.where(KEPT_2x3 <= 0, 6, KEPT_2x3), cap) if cap else KEPT_2x3
    want_logp, want_outside = _reference(LOGITS_2x3x6, TARGETS_2x3, kept, T)
    np.testing.assert_allclose(stats.logprobs_BxL, want_logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(stats.outside_BxL, want_outside)
    assert want_outside[1, 1] == 1.0 and np.isfinite(np.asarray(stats.logprobs_BxL)).all()


def test_kept_zero_or_the_vocabulary_size_is_the_full_log_softmax():
    kept = jnp.asarray([[0, 6, 0], [6, 0, 6]], jnp.int32)

    stats = token_stats(jnp.asarray(LOGITS_2x3x6), jnp.asarray(TARGETS_2x3), kept_BxL=kept,
                        entropy=True)
    full = token_stats(jnp.asarray(LOGITS_2x3x6), jnp.asarray(TARGETS_2x3), entropy=True)

    np.testing.assert_allclose(stats.logprobs_BxL, full.logprobs_BxL, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats.entropy_BxL, full.entropy_BxL, rtol=1e-6, atol=1e-6)


def test_truncated_entropy_is_the_entropy_of_the_renormalised_set():
    stats = token_stats(jnp.asarray(LOGITS_2x3x6), jnp.asarray(TARGETS_2x3),
                        kept_BxL=jnp.asarray(KEPT_2x3), entropy=True)

    z = LOGITS_2x3x6[1, 0]  # kept 3 of [-1, 4, 2, 2, 0, 1]: {4, 2, 2}
    p = np.exp([4.0, 2.0, 2.0]) / np.exp([4.0, 2.0, 2.0]).sum()
    assert z.max() == 4.0
    np.testing.assert_allclose(stats.entropy_BxL[1, 0], -(p * np.log(p)).sum(), rtol=1e-6)


@pytest.mark.parametrize("chunk", [2, 4])
def test_chunked_truncated_stats_equal_the_full_logits_ones(chunk):
    k = jax.random.split(jax.random.key(0), 3)
    hidden, head = jax.random.normal(k[0], (2, 5, 8)), jax.random.normal(k[1], (8, 40))
    targets = jax.random.randint(k[2], (2, 5), 0, 40)
    kept = jnp.asarray([[1, 5, 40, 0, 7], [3, 3, 12, 2, 39]], jnp.int32)

    full = token_stats(logits_f32(head, hidden, False), targets, 0.9, kept_BxL=kept,
                       entropy=True)
    chunked = token_stats(Hidden(hidden, head, chunk=chunk), targets, 0.9, kept_BxL=kept,
                          entropy=True)

    for a, b in zip(full, chunked):
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def _batch(loss_mask, kept):
    B, L = TARGETS_2x3.shape
    behaviour = _reference(LOGITS_2x3x6, TARGETS_2x3, np.asarray(kept))[0] - 0.05
    return RLTrainBatch(input_ids=None, targets=jnp.asarray(TARGETS_2x3),
                        loss_mask=jnp.asarray(loss_mask, jnp.float32), positions=None,
                        segment_ids=None,
                        behaviour_logprobs=jnp.asarray(behaviour * loss_mask, jnp.float32),
                        advantages=jnp.asarray(loss_mask * np.asarray([[1.0], [-0.5]]),
                                               jnp.float32),
                        versions=jnp.zeros((B, L), jnp.int32), sample_ids=None,
                        kept=jnp.asarray(kept))


def test_rl_loss_masks_out_tokens_outside_the_kept_set_and_counts_them():
    rl = RLConfig(entropy_coef=0.01)
    loss_fn = make_rl_loss_fn(rl, temperature=1.0)
    mask = np.ones((2, 3), np.float32)
    masked = mask.copy()
    masked[1, 1] = 0.0  # the token outside the trainer's kept set

    def loss(logits, m):
        s, w, aux = loss_fn(logits, _batch(m, KEPT_2x3), version=jnp.int32(0))
        return s / w, aux

    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(LOGITS_2x3x6), mask)
    want, _ = loss(jnp.asarray(LOGITS_2x3x6), masked)

    np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7)
    assert np.isfinite(np.asarray(grads)).all()
    np.testing.assert_array_equal(grads[1, 1], 0.0)
    reported = report_aux({trunc.METRIC: aux[trunc.METRIC]}, jnp.float32(1.0))
    np.testing.assert_allclose(reported[trunc.METRIC], 1.0 / 6.0, rtol=1e-6)
    assert float(reported[trunc.METRIC + "_tokens"]) == 6.0


def test_rl_loss_without_kept_reports_no_truncation_metric():
    batch = _batch(np.ones((2, 3), np.float32), KEPT_2x3).replace(kept=None)

    _, _, aux = make_rl_loss_fn(RLConfig())(jnp.asarray(LOGITS_2x3x6), batch,
                                            version=jnp.int32(0))

    assert trunc.METRIC not in aux


@pytest.mark.parametrize("settings, fields", [
    ({}, ()), ({"top_k": 5}, ("kept",)), ({"top_p": 0.9}, ("kept",)),
    ({"min_p": 0.05}, ("kept",))])
def test_truncated_sampler_settings_add_the_kept_field(settings, fields):
    assert trunc.batch_fields(SamplerConfig(**settings)) == fields
