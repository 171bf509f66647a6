"""Preference losses (DPO family), chosen by ``dpo.loss``: pure functions in a registry.

Every loss takes per-pair sums over the completion tokens -- the policy's log p(chosen) and
log p(rejected) (``pc_P``, ``pr_P``), the frozen reference's (``rc_P``, ``rr_P``) and the
completions' token counts (``nc_P``, ``nr_P``) -- and returns ``(loss_P, reward_c_P,
reward_r_P)``: the per-pair loss and each completion's implicit reward.

* ``dpo`` (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; label smoothing
  epsilon as in conservative DPO, Mitchell 2023, and TRL's ``sigmoid`` loss):
  ``h = beta * ((pc - rc) - (pr - rr))``, ``loss = -(1 - eps) log s(h) - eps log s(-h)``.
* ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", eq. 17) over per-token log-ratios, as TRL's ``ipo`` and as the authors advise
  (summed ones make the target gap 1 / (2 beta) depend on the completions' lengths):
  ``h = (pc - rc) / nc - (pr - rr) / nr``, ``loss = (h - 1 / (2 beta))^2``, rewards
  ``beta * (pc - rc) / nc`` and ``beta * (pr - rr) / nr``.
* ``simpo`` (Meng et al. 2024, "SimPO", eq. 6): no reference;
  ``loss = -log s(beta * pc / nc - beta * pr / nr - gamma)``.

``make_preference_loss_fn`` turns one of them into the train step's ``LossFn`` over a
``PreferenceBatch`` (the pair layout is documented there).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshrl.algorithms.batch import PreferenceBatch
from meshrl.algorithms.losses import LossOutput, ModelOutput, token_logprobs
from meshrl.utils.registry import Registry

PairLoss = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
_PREFERENCE: Registry[PairLoss] = Registry("preference loss")
register = _PREFERENCE.register
get = _PREFERENCE.get
names = _PREFERENCE.names
# Losses that read the reference's logprobs (the others skip the reference forward).
NEEDS_REFERENCE = ("dpo", "ipo")
# Losses whose implicit rewards are per-token averages.
PER_TOKEN_REWARDS = ("ipo", "simpo")


@register("dpo")
def dpo_loss(pc_P: jax.Array, pr_P: jax.Array, rc_P: jax.Array, rr_P: jax.Array,
             nc_P: jax.Array, nr_P: jax.Array, *, beta: float, label_smoothing: float = 0.0,
             gamma: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    del nc_P, nr_P, gamma
    reward_c_P, reward_r_P = beta * (pc_P - rc_P), beta * (pr_P - rr_P)
    h_P = reward_c_P - reward_r_P
    loss_P = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(h_P)
              - label_smoothing * jax.nn.log_sigmoid(-h_P))
    return loss_P, reward_c_P, reward_r_P


@register("ipo")
def ipo_loss(pc_P: jax.Array, pr_P: jax.Array, rc_P: jax.Array, rr_P: jax.Array,
             nc_P: jax.Array, nr_P: jax.Array, *, beta: float, label_smoothing: float = 0.0,
             gamma: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    del label_smoothing, gamma
    ratio_c_P = (pc_P - rc_P) / jnp.maximum(nc_P, 1.0)
    ratio_r_P = (pr_P - rr_P) / jnp.maximum(nr_P, 1.0)
    h_P = ratio_c_P - ratio_r_P
    return (h_P - 1.0 / (2.0 * beta)) ** 2, beta * ratio_c_P, beta * ratio_r_P


@register("simpo")
def simpo_loss(pc_P: jax.Array, pr_P: jax.Array, rc_P: jax.Array, rr_P: jax.Array,
               nc_P: jax.Array, nr_P: jax.Array, *, beta: float, label_smoothing: float = 0.0,
               gamma: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    del rc_P, rr_P, label_smoothing
    reward_c_P = beta * pc_P / jnp.maximum(nc_P, 1.0)
    reward_r_P = beta * pr_P / jnp.maximum(nr_P, 1.0)
    return -jax.nn.log_sigmoid(reward_c_P - reward_r_P - gamma), reward_c_P, reward_r_P


def pair_sums(values_BxL: jax.Array, mask_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``([P], [P])``: the masked row sums of the chosen rows (even) and rejected rows (odd)."""
    rows_B = (values_BxL * mask_BxL).sum(-1)
    return rows_B[0::2], rows_B[1::2]


def make_preference_loss_fn(name: str, *, beta: float, label_smoothing: float = 0.0,
                            gamma: float = 0.0) -> Callable[[ModelOutput, PreferenceBatch],
                                                            LossOutput]:
    """The train step's loss: ``(sum of pair losses, pairs, aux sums)`` with aux
    ``reward_margin`` (chosen minus rejected implicit reward), ``reward_accuracy`` (chosen
    reward > rejected; with a reference, by more than float rounding of the logprob sums:
    1e-6 x beta x their magnitudes, over the lengths where the rewards are per token) and ``reward_chosen`` / ``reward_rejected``, each summed over pairs (the
    step divides by the pair count). A pair whose rows are all masked (padding) counts for
    nothing."""
    pair_loss = get(name)
    uses_ref = name in NEEDS_REFERENCE

    def loss_fn(out: ModelOutput, batch: PreferenceBatch) -> LossOutput:
        B, L = batch.targets.shape
        assert B % 2 == 0, f"a preference batch holds (chosen, rejected) row pairs, got {B} rows"
        mask_BxL = batch.loss_mask.astype(jnp.float32)
        logp_BxL = token_logprobs(out, batch.targets)
        pc_P, pr_P = pair_sums(logp_BxL, mask_BxL)
        nc_P, nr_P = pair_sums(jnp.ones_like(mask_BxL), mask_BxL)
        if uses_ref:
            rc_P, rr_P = pair_sums(batch.ref_logprobs, mask_BxL)
        else:
            rc_P = rr_P = jnp.zeros_like(pc_P)
        loss_P, reward_c_P, reward_r_P = pair_loss(
            pc_P, pr_P, rc_P, rr_P, nc_P, nr_P, beta=beta, label_smoothing=label_smoothing,
            gamma=gamma)
        real_P = ((nc_P > 0) & (nr_P > 0)).astype(jnp.float32)
        margin_P = reward_c_P - reward_r_P
        # The reference is a separately compiled forward: while the policy equals it the
        # margin is float rounding of the sums, not a preference. A pair counts as ranked right
        # only past that rounding.
        # Without a reference there is no such rounding: plain ``margin > 0``.
        noise_P = (1e-6 * beta * (jnp.abs(pc_P) + jnp.abs(pr_P) + jnp.abs(rc_P) + jnp.abs(rr_P))
                   / (jnp.minimum(jnp.maximum(nc_P, 1.0), jnp.maximum(nr_P, 1.0))
                      if name in PER_TOKEN_REWARDS else 1.0)
                   if uses_ref else 0.0)
        aux = {"reward_margin": (margin_P * real_P).sum(),
               "reward_accuracy": ((margin_P > noise_P) * real_P).sum(),
               "reward_chosen": (reward_c_P * real_P).sum(),
               "reward_rejected": (reward_r_P * real_P).sum()}
        return (loss_P * real_P).sum(), real_P.sum(), aux

    return loss_fn
