"""The DPO-family losses against a numpy reference on hand-made logprobs, and the step's loss
over a ``PreferenceBatch`` of adjacent (chosen, rejected) rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms import preference
from meshrl.algorithms.batch import PreferenceBatch

# Hand-made per-pair sums: policy chosen / rejected, reference chosen / rejected, lengths.
PC = np.array([-3.0, -10.0, -2.5, -7.0], np.float32)
PR = np.array([-5.0, -4.0, -2.5, -1.0], np.float32)
RC = np.array([-4.0, -9.0, -3.0, -6.5], np.float32)
RR = np.array([-4.5, -5.0, -2.0, -2.0], np.float32)
NC = np.array([2.0, 5.0, 1.0, 4.0], np.float32)
NR = np.array([3.0, 2.0, 1.0, 1.0], np.float32)


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.log1p(np.exp(-x))


def _run(name: str, **kw: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = preference.get(name)(*(jnp.asarray(a) for a in (PC, PR, RC, RR, NC, NR)), **kw)
    return tuple(np.asarray(x) for x in out)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_loss_equals_numpy_sigmoid_loss_with_label_smoothing(eps):
    loss, rc, rr = _run("dpo", beta=0.5, label_smoothing=eps)
    h = 0.5 * ((PC - RC) - (PR - RR))
    expected = -(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)
    np.testing.assert_allclose(loss, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rc - rr, h, rtol=1e-6, atol=1e-6)


def test_ipo_loss_equals_numpy_squared_margin_loss_of_per_token_log_ratios():
    # TRL's ``ipo``: log-ratios averaged over each completion's tokens (unequal lengths here).
    loss, rc, rr = _run("ipo", beta=0.25)
    h = (PC - RC) / NC - (PR - RR) / NR
    np.testing.assert_allclose(loss, (h - 1 / (2 * 0.25)) ** 2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rc, 0.25 * (PC - RC) / NC, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rr, 0.25 * (PR - RR) / NR, rtol=1e-6, atol=1e-6)


def test_simpo_loss_equals_numpy_length_normalised_loss_and_ignores_reference():
    loss, rc, rr = _run("simpo", beta=2.0, gamma=0.5)
    expected = -_log_sigmoid(2.0 * PC / NC - 2.0 * PR / NR - 0.5)
    np.testing.assert_allclose(loss, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rc, 2.0 * PC / NC, rtol=1e-6)
    moved = preference.get("simpo")(*(jnp.asarray(a) for a in (PC, PR, RC + 7, RR - 3, NC, NR)),
                                    beta=2.0, gamma=0.5)[0]
    np.testing.assert_array_equal(np.asarray(moved), loss)


def test_unknown_preference_loss_names_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown preference loss 'kto'.*'dpo', 'ipo', 'simpo'"):
        preference.get("kto")


def _logits_for(logp_rows: np.ndarray, V: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Logits whose log-softmax at target 0 is ``logp_rows`` (per token), and the targets."""
    B, L = logp_rows.shape
    p = np.exp(logp_rows)
    rest = np.log((1 - p) / (V - 1))
    logits = np.concatenate([logp_rows[..., None], np.repeat(rest[..., None], V - 1, -1)], -1)
    return logits.astype(np.float32), np.zeros((B, L), np.int32)


def test_loss_fn_pairs_adjacent_rows_and_skips_all_masked_pairs():
    rng = np.random.default_rng(0)
    logp = np.log(rng.uniform(0.1, 0.9, (6, 5))).astype(np.float32)
    ref = np.log(rng.uniform(0.1, 0.9, (6, 5))).astype(np.float32)
    mask = np.array([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 0, 0],
                     [0] * 5, [0] * 5], np.float32)  # pair 2 is padding
    logits, targets = _logits_for(logp)
    batch = PreferenceBatch(input_ids=None, targets=jnp.asarray(targets),
                            loss_mask=jnp.asarray(mask), positions=None, segment_ids=None,
                            ref_logprobs=jnp.asarray(ref * mask))
    fn = preference.make_preference_loss_fn("dpo", beta=0.1)
    total, pairs, aux = fn(jnp.asarray(logits), batch)
    s, r = (logp * mask).sum(-1), (ref * mask).sum(-1)
    h = 0.1 * ((s[0::2] - r[0::2]) - (s[1::2] - r[1::2]))[:2]
    np.testing.assert_allclose(total, -_log_sigmoid(h).sum(), rtol=1e-5)
    assert float(pairs) == 2.0
    np.testing.assert_allclose(aux["reward_margin"], h.sum(), rtol=1e-5)
    assert float(aux["reward_accuracy"]) == float((h > 0).sum())


def test_a_margin_of_float_rounding_is_not_counted_as_a_right_ranking():
    # The policy equals the reference but for the last bits of a separately compiled forward.
    logp = np.log(np.full((2, 5), 0.3)).astype(np.float32)
    mask = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1]], np.float32)
    ref = logp * mask
    ref[1, 1] += 2e-6  # the rejected row a few ulps likelier under the reference
    logits, targets = _logits_for(logp)
    batch = PreferenceBatch(input_ids=None, targets=jnp.asarray(targets),
                            loss_mask=jnp.asarray(mask), positions=None, segment_ids=None,
                            ref_logprobs=jnp.asarray(ref))
    fn = preference.make_preference_loss_fn("dpo", beta=0.1)

    _, _, aux = fn(jnp.asarray(logits), batch)

    assert float(aux["reward_margin"]) != 0.0  # rounding shows in the margin ...
    assert float(aux["reward_accuracy"]) == 0.0  # ... and is no preference


def test_a_reference_free_loss_counts_every_positive_margin_as_a_right_ranking():
    # SimPO over 1,000-token completions: chosen 0.0015 nats a token likelier, a margin far
    # above float rounding of per-token averages, yet below the sums' rounding bound.
    L = 1001
    logp = np.stack([np.full(L, np.log(0.0640)), np.full(L, np.log(0.0639))]).astype(np.float32)
    mask = np.ones((2, L), np.float32)
    mask[:, 0] = 0
    logits, targets = _logits_for(logp, V=64)
    batch = PreferenceBatch(input_ids=None, targets=jnp.asarray(targets),
                            loss_mask=jnp.asarray(mask), positions=None, segment_ids=None,
                            ref_logprobs=None)
    fn = preference.make_preference_loss_fn("simpo", beta=2.0)

    _, _, aux = fn(jnp.asarray(logits), batch)

    assert float(aux["reward_margin"]) > 0.0 and float(aux["reward_accuracy"]) == 1.0
