"""Rollout correction (TIS, MIS, IcePop; token and sequence level) and decoupled PPO's
normaliser, each against a small numpy reference on hand-made logprobs and masks, packed rows
included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms import policy_loss as pl
from meshrl.algorithms import rollout_correction as rc
from meshrl.configs.schema import RLConfig

RTOL, ATOL = 1e-5, 1e-6
CAP, LOW, HIGH, EPS = 2.0, 0.5, 5.0, 0.2
MODES = ("tis_token", "tis_seq", "mis_token", "mis_seq", "icepop")

# Two packed rows: row 0 holds sequences 1 and 2, row 1 holds sequence 1; segment 0 is padding.
SEG = np.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0]], np.int32)
MASK = np.array([[0, 1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]], np.float32)
# log(pi_old / pi_behav) on the loss tokens: rho = 1.5, 3 | 0.25, 1.2 | 1, 8, 0.9, 1.1.
RHO = np.array([[1, 1.5, 3.0, 1, 0.25, 1.2, 1], [1, 1.0, 8.0, 0.9, 1.1, 1, 1]])


def make_inputs(packed: bool = True) -> pl.PolicyInputs:
    prox = -1.0 - 0.1 * np.arange(14, dtype=np.float32).reshape(2, 7)
    behav = np.where(MASK > 0, prox - np.log(RHO), -np.inf)  # padding holds garbage
    logp = prox + 0.05 * np.cos(np.arange(14)).reshape(2, 7)  # inside the clip range
    adv = np.where(MASK > 0, np.sin(1.0 + np.arange(14)).reshape(2, 7), 0.0)
    seg = jnp.asarray(SEG) if packed else None
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return pl.PolicyInputs(f(logp), f(prox), f(behav), f(adv), f(MASK), seg)


def params(mode: str, **kw: object) -> pl.LossParams:
    return pl.LossParams(eps_low=EPS, eps_high=EPS, dual_clip_c=0.0,
                         behav_weight_cap=kw.pop("cap", 0.0), behav_cap_mode=kw.pop("m", "zero"),
                         correction=rc.CorrectionParams(mode, CAP, LOW, HIGH))


def np_correction(mode: str, inputs: pl.PolicyInputs) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
    """(weight, keep mask, raw rho) by the definitions, one sequence at a time."""
    mask = np.asarray(inputs.loss_mask_BxL)
    log_r = np.where(mask > 0, np.asarray(inputs.proximal_logprobs_BxL)
                     - np.asarray(inputs.behaviour_logprobs_BxL), 0.0)
    seg = SEG if inputs.segment_ids_BxL is not None else np.ones_like(SEG)
    seq_log = np.zeros_like(log_r)
    for b in range(2):
        for s in set(seg[b]) - {0}:
            seq_log[b, seg[b] == s] = log_r[b, seg[b] == s].sum()
    rho = np.exp(seq_log if mode.endswith("_seq") else log_r)
    inside = (rho >= LOW) & (rho <= HIGH)
    if mode.startswith("tis"):
        return np.minimum(rho, CAP) * mask, mask, rho
    keep = mask if mode == "icepop" else mask * inside
    return rho * inside * mask, keep, rho


def np_token_loss(name: str, inputs: pl.PolicyInputs, grad: bool = False) -> np.ndarray:
    """Clipped surrogate per token (or its derivative in the token's logprob); decoupled PPO
    (its weight replaced by the correction's) is PPO against pi_old."""
    old = inputs.proximal_logprobs_BxL if name == "decoupled_ppo" else \
        inputs.behaviour_logprobs_BxL
    mask = np.asarray(inputs.loss_mask_BxL) > 0
    r = np.exp(np.where(mask, np.asarray(inputs.logprobs_BxL) - np.asarray(old), 0.0))
    adv = np.asarray(inputs.advantages_BxL)
    clipped = np.clip(r, 1 - EPS, 1 + EPS) * adv
    if grad:  # d(-r A)/d(logp) = -r A where the unclipped branch is the minimum, else 0
        return np.where(r * adv <= clipped, -r * adv, 0.0)
    return -np.minimum(r * adv, clipped)


def loss_and_grad(name: str, inputs: pl.PolicyInputs, p: pl.LossParams, aggregation: str):
    def f(logp_BxL):
        return pl.policy_loss(name, inputs._replace(logprobs_BxL=logp_BxL), p,
                              aggregation=aggregation)[0]
    return jax.value_and_grad(f)(inputs.logprobs_BxL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo"])
def test_correction_matches_the_numpy_reference_on_packed_rows(mode, name):
    inputs = make_inputs()
    weight, keep, _ = np_correction(mode, inputs)
    if name == "ppo":  # its ratio carries rho already: the correction only filters
        weight = (weight > 0).astype(np.float32)
    token_loss = np_token_loss(name, inputs)

    loss, grad = loss_and_grad(name, inputs, params(mode), "token_mean")

    np.testing.assert_allclose(loss, (weight * token_loss * keep).sum() / keep.sum(),
                               rtol=RTOL, atol=ATOL)
    # The weight is stop-gradient: it scales the surrogate's own gradient.
    token_grad = np_token_loss(name, inputs, grad=True)
    np.testing.assert_allclose(grad, weight * token_grad * keep / keep.sum(), rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_mean_divides_each_sequence_by_its_kept_tokens(mode):
    inputs = make_inputs()
    weight, keep, _ = np_correction(mode, inputs)
    token_loss = np_token_loss("decoupled_ppo", inputs) * weight * keep
    means = [token_loss[b, SEG[b] == s].sum() / keep[b, SEG[b] == s].sum()
             for b, s in ((0, 1), (0, 2), (1, 1)) if keep[b, SEG[b] == s].sum() > 0]

    loss, _ = loss_and_grad("decoupled_ppo", inputs, params(mode), "sequence_mean")

    np.testing.assert_allclose(loss, np.mean(means), rtol=RTOL, atol=ATOL)


def test_hand_computed_sequence_weights_of_the_packed_rows():
    # Sequence rho: 1.5 * 3 = 4.5 | 0.25 * 1.2 = 0.3 | 1 * 8 * 0.9 * 1.1 = 7.92.
    corr = rc.compute(params("mis_seq").correction, *make_inputs()[1:3], jnp.asarray(MASK),
                      *pl.sequence_ids(jnp.asarray(SEG), MASK.shape))
    tis = rc.compute(params("tis_seq").correction, *make_inputs()[1:3], jnp.asarray(MASK),
                     *pl.sequence_ids(jnp.asarray(SEG), MASK.shape))

    np.testing.assert_allclose(corr.weight_BxL[0, 1:3], [4.5, 4.5], rtol=RTOL)
    np.testing.assert_allclose(corr.keep_BxL, [[0, 1, 1, 0, 0, 0, 0], [0] * 7], atol=0)
    np.testing.assert_allclose(tis.weight_BxL[MASK > 0], [2, 2, 0.3, 0.3, 2, 2, 2, 2],
                               rtol=RTOL)


def test_rows_as_sequences_when_there_are_no_segment_ids():
    inputs = make_inputs(packed=False)
    weight, keep, _ = np_correction("tis_seq", inputs)
    want = (weight * np_token_loss("decoupled_ppo", inputs) * keep).sum() / keep.sum()

    loss, _ = loss_and_grad("decoupled_ppo", inputs, params("tis_seq"), "token_mean")

    np.testing.assert_allclose(loss, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_correction_metrics_match_the_reference(mode):
    inputs = make_inputs()
    _, _, rho = np_correction(mode, inputs)
    mask = MASK > 0
    hit = rho > CAP if mode.startswith("tis") else (rho < LOW) | (rho > HIGH)
    log_r = np.log(RHO)
    seq_log = np.array([[log_r[b, (SEG[b] == SEG[b, t]) & mask[b]].sum() for t in range(7)]
                        for b in range(2)])

    _, metrics = pl.policy_loss("ppo", inputs, params(mode))
    stats = rc.weight_stats(rc.compute(params(mode).correction, *inputs[1:3], inputs[4],
                                       *pl.sequence_ids(inputs[5], MASK.shape)), inputs[4])

    np.testing.assert_allclose(metrics["rollout_corr_frac"], hit[mask].mean(), rtol=RTOL)
    np.testing.assert_allclose(metrics["rollout_seq_log_ratio"], seq_log[mask].mean(),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats.total / stats.count, rho[mask].mean(), rtol=RTOL)
    np.testing.assert_allclose(stats.max, rho[mask].max(), rtol=RTOL)


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "gspo"])
def test_none_leaves_every_loss_unchanged_and_on_policy_tis_is_the_identity(name):
    inputs = make_inputs()
    on_policy = inputs._replace(behaviour_logprobs_BxL=inputs.proximal_logprobs_BxL)

    base, _ = pl.policy_loss(name, on_policy, params("none"))
    tis, metrics = pl.policy_loss(name, on_policy, params("tis_token"))

    np.testing.assert_allclose(tis, base, rtol=RTOL, atol=ATOL)
    assert float(metrics["rollout_corr_frac"]) == 0.0
    assert "rollout_corr_frac" not in pl.policy_loss(name, on_policy, params("none"))[1]


def test_garbage_off_the_mask_changes_nothing_for_sequence_corrections():
    inputs = make_inputs()
    off = jnp.asarray(MASK) == 0
    garbled = inputs._replace(proximal_logprobs_BxL=jnp.where(off, 50.0,
                                                              inputs.proximal_logprobs_BxL))
    for mode in ("tis_seq", "mis_seq"):
        a = loss_and_grad("ppo", inputs, params(mode), "token_mean")
        b = loss_and_grad("ppo", garbled, params(mode), "token_mean")
        np.testing.assert_allclose(b[0], a[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(b[1], a[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["zero", "drop"])
def test_decoupled_normaliser_matches_areal_in_zero_mode_and_the_old_one_in_drop(mode):
    # AReaL's ppo_actor_loss_fn: pg_loss * where(w <= cap, w, 0), summed over the loss mask and
    # divided by the loss-mask count; "drop" divides by the uncapped tokens only.
    inputs = make_inputs()
    w = RHO * MASK
    capped = (w > 2.5) & (MASK > 0)
    kept_w = np.where(capped, 0.0, w)
    token_loss = np_token_loss("decoupled_ppo", inputs) * kept_w * MASK
    count = MASK.sum() if mode == "zero" else (MASK * ~capped).sum()
    p = pl.LossParams(eps_low=EPS, eps_high=EPS, dual_clip_c=0.0, behav_weight_cap=2.5,
                      behav_cap_mode=mode, correction=rc.OFF)

    loss, grad = loss_and_grad("decoupled_ppo", inputs, p, "token_mean")

    assert capped.sum() == 2
    np.testing.assert_allclose(loss, token_loss.sum() / count, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, token_loss / count, rtol=RTOL, atol=ATOL)


def test_zero_mode_keeps_the_kl_and_entropy_terms_of_capped_tokens():
    inputs = make_inputs()
    rows = {}
    for mode in ("zero", "drop"):
        rl = RLConfig(behav_weight_cap=2.5, behav_cap_mode=mode)
        terms, _ = pl.corrected_terms("decoupled_ppo", inputs, pl.LossParams.from_config(rl))
        rows[mode] = np.asarray(terms.mask_BxL)

    np.testing.assert_array_equal(rows["zero"], MASK)
    assert rows["drop"].sum() == MASK.sum() - 2


def test_correction_params_take_the_config_values():
    rl = RLConfig(rollout_correction="icepop", correction_low=0.25, correction_high=4.0,
                  correction_cap=3.0)

    p = pl.LossParams.from_config(rl).correction

    assert p == rc.CorrectionParams("icepop", 3.0, 0.25, 4.0) and p.on
    assert not rc.CorrectionParams.from_config(RLConfig()).on


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", ["tis_token", "tis_seq"])
def test_truncated_is_with_a_ratio_against_the_behaviour_policy_is_refused(loss, mode):
    from meshrl.configs.fields import ConfigError

    with pytest.raises(ConfigError, match=rf"rl.rollout_correction = '{mode}' with "
                                          rf"rl.policy_loss = '{loss}'.*apply rho twice"):
        RLConfig(rollout_correction=mode, policy_loss=loss)


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_a_band_correction_keeps_an_in_band_tokens_gradient_of_a_behaviour_ratio_loss(loss):
    # rho = e^0.4 = 1.49, inside [0.5, 5]: kept, and not weighted again by rho.
    logp, behav = jnp.array([[-1.0]]), jnp.array([[-1.4]])
    adv, mask = jnp.array([[1.0]]), jnp.array([[1.0]])

    def grad(mode: str) -> float:
        p = params(mode)
        f = lambda lp: pl.policy_loss(loss, pl.PolicyInputs(  # noqa: E731
            lp, jax.lax.stop_gradient(lp), behav, adv, mask), p)[0]
        return float(jax.grad(f)(logp)[0, 0])

    np.testing.assert_allclose(grad("mis_token"), grad("none"), rtol=1e-6)
    np.testing.assert_allclose(grad("icepop"), grad("none"), rtol=1e-6)
