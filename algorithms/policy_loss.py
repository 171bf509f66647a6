"""Policy losses of the PPO family, chosen by name (``rl.policy_loss``): pure per-token functions.

A registered loss maps ``PolicyInputs`` (per-token ``[B, L]`` arrays) and ``LossParams`` to
``PolicyTerms``: the per-token loss to minimise, the mask of tokens that count (a loss may drop
tokens, e.g. decoupled PPO's cap with ``behav_cap_mode = "drop"``) and per-token statistics. ``aggregate`` turns them into
a token mean or a mean of per-sequence means; masked tokens contribute neither value nor gradient.
``rl.rollout_correction`` (``rollout_correction.py``) then weights or masks that per-token loss.

* ``ppo``: clipped surrogate with ratio pi / pi_behav; separate eps_low / eps_high (DAPO
  clip-higher) and optional dual clip (Ye et al. 2020) bounding the loss of negative advantages
  by ``c * |A|``.
* ``decoupled_ppo`` (AReaL, Fu et al. 2025): the ratio is taken against the proximal policy
  (recomputed by the trainer) and clipped around 1; the off-policy correction is the behaviour
  weight pi_prox / pi_behav, stop-gradient. Tokens whose weight exceeds ``behav_weight_cap``
  get weight 0 but still count in the normaliser, as AReaL's ``ppo_actor_loss_fn`` (their KL
  and entropy terms stay); ``behav_cap_mode = "drop"`` removes them from the loss mask instead.
  When behaviour == proximal the weight is 1 and the loss equals ``ppo``. With a rollout
  correction on, the correction's weight replaces this one (it is the same pi_prox / pi_behav).
* ``gspo`` (Zheng et al. 2025): one ratio per sequence, exp(mean token log-ratio), clipped at
  sequence level; every loss token of a sequence carries the sequence loss.

``make_rl_loss_fn`` adapts all of it to the trainer's ``LossFn`` contract (sums + weight).
With a sampling temperature T != 1 the behaviour policy is softmax(logits / T) (as in AReaL and
verl), so the trainer scores its own tokens with logits / T as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from meshrl.algorithms import kl as kl_lib
from meshrl.algorithms import rollout_correction as rc
from meshrl.algorithms import truncation as trunc
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.logits import ModelOutput, output_shape, token_stats
from meshrl.algorithms.losses import (
    LossFn,
    LossOutput,
    Mean,
    MeanMax,
    check_temperature,
    token_logprobs,  # noqa: F401 -- re-exported: callers score logits with pl.token_logprobs
)
from meshrl.configs.schema import RLConfig
from meshrl.utils.registry import Registry

Aggregation = Literal["token_mean", "sequence_mean"]
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: large enough to clip, small enough never to overflow


@dataclasses.dataclass(frozen=True)
class LossParams:
    """Static (Python) hyper-parameters; hashable so they never become traced values. All
    required: the defaults are the config's (``rl.*``, ``from_config``), stated once there."""

    eps_low: float
    eps_high: float
    dual_clip_c: float  # 0: off, else > 1
    behav_weight_cap: float  # 0: off, else >= 1
    behav_cap_mode: Literal["zero", "drop"]  # capped tokens: weight 0 / out of the mask
    correction: rc.CorrectionParams  # rc.OFF: no rollout correction

    @classmethod
    def from_config(cls, rl: RLConfig) -> LossParams:
        return cls(eps_low=rl.eps_low, eps_high=rl.eps_high, dual_clip_c=rl.dual_clip_c,
                   behav_weight_cap=rl.behav_weight_cap, behav_cap_mode=rl.behav_cap_mode,
                   correction=rc.CorrectionParams.from_config(rl))


class PolicyInputs(NamedTuple):
    logprobs_BxL: jax.Array  # noqa: N815 -- under the params being trained (carries the gradient)
    proximal_logprobs_BxL: jax.Array  # noqa: N815 -- recomputed before the update (decoupled PPO)
    behaviour_logprobs_BxL: jax.Array  # noqa: N815 -- recorded by the sampler
    advantages_BxL: jax.Array  # noqa: N815
    loss_mask_BxL: jax.Array  # noqa: N815
    # Packed rows: the sequence of each token within its row (0: padding). None: one per row.
    segment_ids_BxL: jax.Array | None = None  # noqa: N815


class PolicyTerms(NamedTuple):
    loss_BxL: jax.Array  # noqa: N815 -- per-token loss; only entries under mask_BxL are used
    mask_BxL: jax.Array  # noqa: N815 -- float32 mask of tokens that count in the loss
    stats: dict[str, jax.Array]  # per-token [B, L] statistics, averaged over the input mask


PolicyLossFn = Callable[[PolicyInputs, LossParams], PolicyTerms]
_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register = _LOSSES.register
get = _LOSSES.get
names = _LOSSES.names


def _check(inputs: PolicyInputs) -> None:
    shape = inputs.loss_mask_BxL.shape
    for name, x in zip(PolicyInputs._fields, inputs):
        assert x is None or x.shape == shape, f"{name} has shape {x.shape}, expected {shape}"


def sequence_ids(segment_ids_BxL: jax.Array | None, shape: tuple[int, int]
                 ) -> tuple[jax.Array, int]:
    """(id of each token's sequence, number of ids): one id per (row, segment id) pair, so
    sequences packed into one row stay apart; ``None`` segment ids mean one sequence per row."""
    B, L = shape
    if segment_ids_BxL is None:
        return jnp.broadcast_to(jnp.arange(B)[:, None], shape), B
    return jnp.arange(B)[:, None] * (L + 1) + segment_ids_BxL, B * (L + 1)


def sequence_sum(x_BxL: jax.Array, ids_BxL: jax.Array, num: int) -> jax.Array:
    """Per-sequence sums ``[num]`` of ``x`` (ids from ``sequence_ids``)."""
    return jax.ops.segment_sum(x_BxL.reshape(-1), ids_BxL.reshape(-1), num_segments=num)


def _masked_log_ratio(logp_BxL: jax.Array, old_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    # Padding may hold -inf/garbage logprobs; zeroing them *before* exp keeps both the value and
    # the gradient finite (a where after exp still back-propagates 0 * inf = nan).
    log_ratio_BxL = jnp.where(mask_BxL > 0, logp_BxL - old_BxL, 0.0)
    return jnp.clip(log_ratio_BxL, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def clipped_surrogate(ratio: jax.Array, adv: jax.Array, p: LossParams
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-element PPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, dual-clipped at
    ``-c A`` for A < 0 when ``c > 0``. Returns (loss, clipped, dual_clipped) indicators as float."""
    surr = ratio * adv
    surr_clipped = jnp.clip(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high) * adv
    objective = jnp.minimum(surr, surr_clipped)
    clipped = (surr_clipped < surr).astype(jnp.float32)
    dual = jnp.zeros_like(clipped)
    if p.dual_clip_c > 0.0:
        # With a negative advantage an unbounded ratio would give an unbounded loss; the dual
        # clip caps it at c * |A| (and zeroes the gradient there).
        bound = p.dual_clip_c * adv
        dual = ((adv < 0) & (bound > objective)).astype(jnp.float32)
        objective = jnp.where(adv < 0, jnp.maximum(objective, bound), objective)
    return -objective, clipped, dual


def _ppo_terms(log_ratio_BxL: jax.Array, inputs: PolicyInputs, p: LossParams,
               mask_BxL: jax.Array) -> PolicyTerms:
    ratio_BxL = jnp.exp(log_ratio_BxL)
    loss_BxL, clipped_BxL, dual_BxL = clipped_surrogate(ratio_BxL, inputs.advantages_BxL, p)
    # k3 of the old policy vs the current one: the usual "approx KL" of PPO implementations.
    approx_kl_BxL = jax.lax.stop_gradient(ratio_BxL - 1.0 - log_ratio_BxL)
    stats = {"clip_frac": clipped_BxL, "dual_clip_frac": dual_BxL,
             "ratio_mean": jax.lax.stop_gradient(ratio_BxL), "approx_kl": approx_kl_BxL}
    return PolicyTerms(loss_BxL, mask_BxL, stats)


@register("ppo")
def ppo(inputs: PolicyInputs, p: LossParams) -> PolicyTerms:
    """PPO clip against the behaviour policy (the proximal logprobs are ignored)."""
    _check(inputs)
    mask_BxL = inputs.loss_mask_BxL.astype(jnp.float32)
    log_ratio_BxL = _masked_log_ratio(inputs.logprobs_BxL, inputs.behaviour_logprobs_BxL, mask_BxL)
    return _ppo_terms(log_ratio_BxL, inputs, p, mask_BxL)


@register("decoupled_ppo")
def decoupled_ppo(inputs: PolicyInputs, p: LossParams) -> PolicyTerms:
    """AReaL's decoupled objective: w * clipped_surrogate(pi / pi_prox), w = pi_prox / pi_behav
    (w = 1 when a rollout correction supplies the weight instead)."""
    _check(inputs)
    in_mask_BxL = inputs.loss_mask_BxL.astype(jnp.float32)
    if p.correction.on:
        log_ratio_BxL = _masked_log_ratio(inputs.logprobs_BxL, inputs.proximal_logprobs_BxL,
                                          in_mask_BxL)
        return _ppo_terms(log_ratio_BxL, inputs, p, in_mask_BxL)
    log_w_BxL = _masked_log_ratio(inputs.proximal_logprobs_BxL, inputs.behaviour_logprobs_BxL,
                                  in_mask_BxL)
    raw_w_BxL = jax.lax.stop_gradient(jnp.exp(log_w_BxL))
    weight_BxL, capped_BxL = raw_w_BxL, jnp.zeros_like(in_mask_BxL)
    mask_BxL = in_mask_BxL
    if p.behav_weight_cap > 0.0:
        # Tokens whose behaviour policy is too far from the proximal one are not trained on
        # (a clipped weight would still train on a sample the cap declares unusable). AReaL
        # zeroes their weight and keeps them in the normaliser; "drop" unmasks them.
        capped_BxL = (weight_BxL > p.behav_weight_cap).astype(jnp.float32)
        if p.behav_cap_mode == "drop":
            mask_BxL = in_mask_BxL * (1.0 - capped_BxL)
        weight_BxL = weight_BxL * (1.0 - capped_BxL)
    log_ratio_BxL = _masked_log_ratio(inputs.logprobs_BxL, inputs.proximal_logprobs_BxL, mask_BxL)
    terms = _ppo_terms(log_ratio_BxL, inputs, p, mask_BxL)
    stats = {**terms.stats, "behav_weight_mean": raw_w_BxL, "behav_capped_frac": capped_BxL}
    return PolicyTerms(weight_BxL * terms.loss_BxL, mask_BxL, stats)


@register("gspo")
def gspo(inputs: PolicyInputs, p: LossParams) -> PolicyTerms:
    """GSPO: s = exp(mean_t log(pi / pi_behav)) per sequence, clipped at sequence level, with
    the sequence advantage (mean of its token advantages)."""
    _check(inputs)
    mask_BxL = inputs.loss_mask_BxL.astype(jnp.float32)
    ids_BxL, num = sequence_ids(inputs.segment_ids_BxL, mask_BxL.shape)
    n_S = jnp.maximum(sequence_sum(mask_BxL, ids_BxL, num), 1.0)
    log_ratio_BxL = _masked_log_ratio(inputs.logprobs_BxL, inputs.behaviour_logprobs_BxL, mask_BxL)
    seq_log_ratio_S = jnp.clip(sequence_sum(log_ratio_BxL, ids_BxL, num) / n_S,
                               -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_S = jnp.exp(seq_log_ratio_S)
    adv_S = sequence_sum(jnp.where(mask_BxL > 0, inputs.advantages_BxL, 0.0), ids_BxL, num) / n_S
    loss_S, clipped_S, dual_S = clipped_surrogate(ratio_S, adv_S, p)
    approx_kl_S = jax.lax.stop_gradient(ratio_S - 1.0 - seq_log_ratio_S)
    # Every token of a sequence carries its sequence's value (token_mean then weighs sequences
    # by length, as GSPO's token-level variant; sequence_mean weighs them equally).
    stats = {"clip_frac": clipped_S[ids_BxL], "dual_clip_frac": dual_S[ids_BxL],
             "ratio_mean": jax.lax.stop_gradient(ratio_S)[ids_BxL],
             "approx_kl": approx_kl_S[ids_BxL]}
    return PolicyTerms(loss_S[ids_BxL], mask_BxL, stats)


def aggregate(x_BxL: jax.Array, mask_BxL: jax.Array, mode: Aggregation,
              segment_ids_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum, weight) with sum / weight the requested mean; sums add over microbatches (a
    sequence never spans two rows, so never two microbatches).

    token_mean: every loss token weighs the same (long sequences weigh more).
    sequence_mean: mean over sequences with at least one loss token of their token means
    (GRPO's original 1/|o_i| normalisation); sequences are rows, or with ``segment_ids_BxL``
    (packed rows) the segments of each row.
    """
    mask_BxL = mask_BxL.astype(jnp.float32)
    masked_BxL = jnp.where(mask_BxL > 0, x_BxL, 0.0) * mask_BxL
    if mode == "token_mean":
        return masked_BxL.sum(), mask_BxL.sum()
    if mode == "sequence_mean":
        ids_BxL, num = sequence_ids(segment_ids_BxL, mask_BxL.shape)
        n_S = sequence_sum(mask_BxL, ids_BxL, num)
        has_S = (n_S > 0).astype(jnp.float32)
        return (sequence_sum(masked_BxL, ids_BxL, num) / jnp.maximum(n_S, 1.0) * has_S).sum(), \
            has_S.sum()
    raise ValueError(f"unknown aggregation {mode!r}; expected token_mean or sequence_mean")


def _mean(pair: tuple[jax.Array, jax.Array]) -> jax.Array:
    return pair[0] / jnp.maximum(pair[1], 1.0)


# Losses whose ratio is taken against the behaviour (sampler's) policy: the rollout correction's
# weight rho = pi_old / pi_behav is inside it already (``RLConfig`` refuses tis_* with them).
BEHAVIOUR_RATIO = ("ppo", "gspo")


def corrected_terms(name: str, inputs: PolicyInputs, params: LossParams
                    ) -> tuple[PolicyTerms, rc.Correction | None]:
    """The registered loss's terms with ``params.correction`` applied: its weight multiplies
    the per-token loss, its mask narrows the loss mask. ``None``: no correction."""
    terms = get(name)(inputs, params)
    if not params.correction.on:
        return terms, None
    ids_BxL, num = sequence_ids(inputs.segment_ids_BxL, inputs.loss_mask_BxL.shape)
    corr = rc.compute(params.correction, inputs.proximal_logprobs_BxL,
                      inputs.behaviour_logprobs_BxL, inputs.loss_mask_BxL, ids_BxL, num)
    weight_BxL = corr.weight_BxL
    if name in BEHAVIOUR_RATIO:
        # Their ratio already carries rho: the correction only filters (its band's zeros).
        weight_BxL = (weight_BxL > 0).astype(terms.loss_BxL.dtype)
    return PolicyTerms(weight_BxL * terms.loss_BxL, terms.mask_BxL * corr.keep_BxL,
                       {**terms.stats, **corr.stats}), corr


def policy_loss(name: str, inputs: PolicyInputs, params: LossParams, *,
                aggregation: Aggregation = "token_mean") -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss scalar, metrics): the registered loss, rollout-corrected and aggregated; metrics
    averaged the same way over the input loss mask."""
    terms, _ = corrected_terms(name, inputs, params)
    seg = inputs.segment_ids_BxL
    loss = _mean(aggregate(terms.loss_BxL, terms.mask_BxL, aggregation, seg))
    metrics = {k: _mean(aggregate(v, inputs.loss_mask_BxL, aggregation, seg))
               for k, v in terms.stats.items()}
    return loss, metrics


def make_rl_loss_fn(rl: RLConfig, temperature: float = 1.0, kept_cap: int = 0) -> LossFn:
    """The trainer's ``LossFn`` for RL: ``(out, batch) -> (loss_sum, weight, aux)``, ``out``
    the model's logits or a ``Hidden`` (logits computed in float32 chunks, ``logits``).

    ``temperature`` is the sampler's (``sampler.temperature``, > 0): the current and the default
    proximal logprobs and the entropy bonus are those of softmax(logits / temperature), the
    policy the behaviour logprobs were sampled from. ``proximal_logprobs`` and ``ref_logprobs``
    given in the batch must be computed at the same temperature. 1 leaves the computation
    exactly as without tempering. With ``batch.kept`` (truncated sampling, ``truncation.py``;
    ``kept_cap``: ``sampler.top_k``) all of them are under the truncated distribution.

    ``batch`` (an ``RLTrainBatch``, see ``RolloutBatch.to_train_batch``): ``targets``,
    ``loss_mask``, ``behaviour_logprobs``, ``advantages``, ``segment_ids`` (packed rows:
    per-sequence terms follow the segments of each row); optional ``proximal_logprobs``
    (default: the current logprobs, stop-gradient, which is exact when each rollout batch gets
    one optimizer step) and ``ref_logprobs`` (required when
    ``rl.kl_coef > 0`` and ``rl.kl_where == "loss"``). With ``rl.kl_where == "reward"`` the KL
    is already in ``advantages`` (``kl_reward_advantages``) and this loss adds none.

    ``loss_fn(out, batch, version=v)`` (``v`` the weight version of the params being trained,
    a traced int scalar) adds ``aux["logprob_mismatch"]``, a ``MeanMax`` of |behaviour -
    current logprob| over the loss tokens of version ``v`` (``logprob_mismatch``) and, with a
    rollout correction, ``aux["rollout_is_weight"]``, a ``MeanMax`` of its raw weight.
    """
    params = LossParams.from_config(rl)
    check_temperature(temperature)  # fail when the loss is built, not when it is traced
    get(rl.policy_loss)  # an unknown loss fails here, not when the loss is traced
    kl_fn = kl_lib.get(rl.kl_estimator)
    kl_in_loss = rl.kl_coef > 0.0 and rl.kl_where == "loss"

    def loss_fn(out: ModelOutput, batch: RLTrainBatch, version: jax.Array | None = None
                ) -> LossOutput:
        targets_BxL = batch.targets
        assert output_shape(out)[:2] == targets_BxL.shape, (output_shape(out),
                                                             targets_BxL.shape)
        # One pass over the logits (chunked for a ``Hidden``) gives logprobs and entropy.
        token = token_stats(out, targets_BxL, temperature, entropy=rl.entropy_coef > 0.0,
                            kept_BxL=batch.kept, kept_cap=kept_cap)  # truncation.py
        outside_BxL, all_mask_BxL = token.outside_BxL, batch.loss_mask
        batch = batch.replace(loss_mask=trunc.inside_mask(all_mask_BxL, outside_BxL))
        logp_BxL = token.logprobs_BxL
        prox_BxL = batch.proximal_logprobs
        if prox_BxL is None:
            prox_BxL = jax.lax.stop_gradient(logp_BxL)
        in_mask_BxL = batch.loss_mask.astype(jnp.float32)
        seg_BxL = batch.segment_ids
        inputs = PolicyInputs(logp_BxL, prox_BxL, batch.behaviour_logprobs, batch.advantages,
                              in_mask_BxL, seg_BxL)
        terms, corr = corrected_terms(rl.policy_loss, inputs, params)
        loss_BxL, stats = terms.loss_BxL, dict(terms.stats)
        if kl_in_loss:
            kl_BxL = kl_fn(jnp.where(in_mask_BxL > 0, logp_BxL, 0.0),
                           jnp.where(in_mask_BxL > 0, batch.ref_logprobs, 0.0))
            loss_BxL = loss_BxL + rl.kl_coef * kl_BxL
            stats["kl_ref"] = jax.lax.stop_gradient(kl_BxL)
        if rl.entropy_coef > 0.0:
            entropy_BxL = token.entropy_BxL
            loss_BxL = loss_BxL - rl.entropy_coef * entropy_BxL
            stats["entropy"] = jax.lax.stop_gradient(entropy_BxL)
        loss_sum, weight = aggregate(loss_BxL, terms.mask_BxL, rl.aggregation, seg_BxL)
        # Each statistic over the tokens the loss was given (``Mean``), not over the loss
        # weight, which counts only the tokens a rollout correction kept.
        aux: dict[str, jax.Array | Mean | MeanMax] = {
            k: Mean(*aggregate(v, in_mask_BxL, rl.aggregation, seg_BxL))
            for k, v in stats.items()}
        if version is not None:
            aux["logprob_mismatch"] = logprob_mismatch(logp_BxL, batch, version)
            if corr is not None:  # a max does not add over minibatches: one-update steps only
                aux["rollout_is_weight"] = rc.weight_stats(corr, in_mask_BxL)
            if outside_BxL is not None:  # truncated sampling, ``batch.kept``
                aux[trunc.METRIC] = MeanMax.of(outside_BxL, all_mask_BxL > 0)
        return loss_sum, weight, aux

    return loss_fn


def logprob_mismatch(logprobs_BxL: jax.Array, batch: RLTrainBatch, version: jax.Array
                     ) -> MeanMax:
    """|behaviour - trainer logprob| over the loss tokens the sampler generated with weight
    version ``version`` (all loss tokens when the batch has no ``versions``): with the
    trainer's own params, sampler and trainer compute the same distribution, so any gap is
    numerics (dtype, kernels, summation order)."""
    selected_BxL = batch.loss_mask > 0
    if batch.versions is not None:
        selected_BxL = selected_BxL & (batch.versions == version)
    gap_BxL = jnp.abs(jax.lax.stop_gradient(logprobs_BxL) - batch.behaviour_logprobs)
    return MeanMax.of(gap_BxL, selected_BxL)


def loss_weight(rl: RLConfig, batch: RLTrainBatch) -> jax.Array:
    """The weight ``make_rl_loss_fn`` divides by, of the whole ``batch`` (with its
    ``proximal_logprobs``): the loss tokens (token_mean) or sequences (sequence_mean) left
    after ``rl.policy_loss``'s own masking. No loss masks tokens by the current logprobs, so
    it needs no model output."""
    in_mask_BxL = batch.loss_mask.astype(jnp.float32)
    prox_BxL = batch.proximal_logprobs
    assert prox_BxL is not None, "loss_weight needs the batch's proximal_logprobs"
    inputs = PolicyInputs(prox_BxL, prox_BxL, batch.behaviour_logprobs, batch.advantages,
                          in_mask_BxL, batch.segment_ids)
    mask_BxL = corrected_terms(rl.policy_loss, inputs, LossParams.from_config(rl))[0].mask_BxL
    return aggregate(jnp.zeros_like(mask_BxL), mask_BxL, rl.aggregation, batch.segment_ids)[1]


def correction_stats(rl: RLConfig, batch: RLTrainBatch) -> dict[str, MeanMax]:
    """``{"rollout_is_weight": MeanMax}`` of the whole ``batch`` (with its
    ``proximal_logprobs``) when ``rl.rollout_correction`` is on, else ``{}``: the step with
    several updates reports it once per batch, as ``logprob_mismatch``."""
    p = rc.CorrectionParams.from_config(rl)
    if not p.on:
        return {}
    ids_BxL, num = sequence_ids(batch.segment_ids, batch.loss_mask.shape)
    mask_BxL = batch.loss_mask.astype(jnp.float32)
    corr = rc.compute(p, batch.proximal_logprobs, batch.behaviour_logprobs, mask_BxL, ids_BxL, num)
    return {"rollout_is_weight": rc.weight_stats(corr, mask_BxL)}
