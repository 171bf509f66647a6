"""KL-to-reference estimators (``rl.kl_estimator``).

Schulman's estimators of KL(pi || ref) from samples of pi, per token, with
``log_ratio = logp - ref_logp``:
  k1 = log_ratio                              (unbiased, high variance, can be negative)
  k2 = 0.5 * log_ratio**2                     (biased, low variance, >= 0)
  k3 = exp(-log_ratio) - 1 + log_ratio        (unbiased, low variance, >= 0)
All are pure and jit-able. ``kl_in_reward`` is the "KL in the reward" variant: the summed
per-token KL of each sequence is subtracted from its reward before advantages are computed;
``kl_reward_advantages`` applies it per ``rl.*`` and reruns the advantage estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from meshrl.algorithms import advantages as adv_lib
from meshrl.utils.registry import Registry

if TYPE_CHECKING:
    from meshrl.configs.schema import RLConfig

KLFn = Callable[[jax.Array, jax.Array], jax.Array]  # (logprobs_BxL, ref_logprobs_BxL) -> BxL
_KL: Registry[KLFn] = Registry("kl estimator")
register = _KL.register
get = _KL.get


@register("k1")
def k1(logprobs_BxL: jax.Array, ref_logprobs_BxL: jax.Array) -> jax.Array:
    return logprobs_BxL - ref_logprobs_BxL


@register("k2")
def k2(logprobs_BxL: jax.Array, ref_logprobs_BxL: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(logprobs_BxL - ref_logprobs_BxL)


@register("k3")
def k3(logprobs_BxL: jax.Array, ref_logprobs_BxL: jax.Array) -> jax.Array:
    # Clamp the log-ratio: exp of a large negative log-ratio overflows in float32 and one bad
    # token would turn the whole loss into inf.
    log_ratio_BxL = jnp.clip(logprobs_BxL - ref_logprobs_BxL, -20.0, 20.0)
    return jnp.exp(-log_ratio_BxL) - 1.0 + log_ratio_BxL


def kl_in_reward(rewards_B: jax.Array, logprobs_BxL: jax.Array, ref_logprobs_BxL: jax.Array,
                 loss_mask_BxL: jax.Array, *, coef: float, estimator: str,
                 sample_ids_BxL: jax.Array | None = None) -> jax.Array:
    """Rewards minus ``coef`` times each sequence's summed per-token KL (masked tokens: 0).
    The KL is a constant of the reward, so it carries no gradient. Row b is sample b, or with
    ``sample_ids_BxL`` (packed rows) each token belongs to sample ``sample_ids_BxL`` (-1: none)."""
    kl_BxL = get(estimator)(logprobs_BxL, ref_logprobs_BxL) * loss_mask_BxL
    if sample_ids_BxL is None:
        kl_B = kl_BxL.sum(-1)
    else:  # out-of-range ids (padding's -1) are dropped by the scatter
        kl_B = jax.ops.segment_sum(kl_BxL.reshape(-1), sample_ids_BxL.reshape(-1),
                                   num_segments=rewards_B.shape[0])
    return rewards_B - coef * jax.lax.stop_gradient(kl_B)


def kl_reward_advantages(rl: RLConfig, rewards_B: jax.Array, behaviour_logprobs_BxL: jax.Array,
                         ref_logprobs_BxL: jax.Array, loss_mask_BxL: jax.Array,
                         group_size: int, sample_ids_BxL: jax.Array | None = None) -> jax.Array:
    """Advantages for ``rl.kl_where == "reward"``: subtract ``rl.kl_coef`` times each sequence's
    summed KL(behaviour || reference) from its reward, then rerun ``rl.advantage``. Run it once
    per batch before the train step (it needs whole groups; the step's microbatches are strided
    rows, not groups) and put the result in the batch's ``advantages``. Token arrays may be
    packed rows: ``sample_ids_BxL`` then names each token's sample (index into ``rewards_B``)."""
    rewards_B = rewards_B.astype(jnp.float32)
    mask_BxL = loss_mask_BxL.astype(jnp.float32)
    tokens_B = (mask_BxL.sum(-1) if sample_ids_BxL is None else jax.ops.segment_sum(
        mask_BxL.reshape(-1), sample_ids_BxL.reshape(-1), num_segments=rewards_B.shape[0]))
    if rl.kl_coef > 0.0 and rl.kl_where == "reward":
        rewards_B = kl_in_reward(
            rewards_B, jnp.where(mask_BxL > 0, behaviour_logprobs_BxL, 0.0),
            jnp.where(mask_BxL > 0, ref_logprobs_BxL, 0.0), mask_BxL, coef=rl.kl_coef,
            estimator=rl.kl_estimator, sample_ids_BxL=sample_ids_BxL)
    return adv_lib.compute(rl.advantage, rewards_B, group_size, eps=rl.adv_eps,
                           tokens_B=tokens_B)
