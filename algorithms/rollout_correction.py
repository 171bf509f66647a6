"""Rollout correction (``rl.rollout_correction``): importance weights for the gap between the
policy that sampled the tokens and the one the trainer scores them with.

The weight of a loss token is rho_t = pi_old(t) / pi_behav(t): ``pi_old`` the trainer's
proximal logprobs (the params before the batch's first update), ``pi_behav`` the sampler's
recorded ``behaviour_logprobs``. It is stop-gradient and acts on the per-token policy loss of
whichever ``rl.policy_loss`` is chosen, so it composes with every loss and every advantage
estimator. Sequence-level variants use rho_seq = prod_t rho_t over the loss tokens of each
sequence (a sum of log ratios per sequence; packed rows keep their sequences apart).

* ``tis_token`` / ``tis_seq``: truncated IS, weight min(rho, C) with C = ``rl.correction_cap``
  (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
  verl's ``rollout_is`` = token / sequence with ``rollout_is_threshold``).
* ``mis_token`` / ``mis_seq``: masked IS, weight rho inside [low, high] (``rl.correction_low``,
  ``rl.correction_high``); tokens (sequences) outside are rejected: they leave the loss mask,
  so neither their value nor their count enters the loss (verl's rejection sampling,
  ``rollout_rs`` with ``rollout_rs_threshold_lower`` / ``rollout_rs_threshold``).
* ``icepop``: IcePop (Ling team, Ring-1T 2025), weight M(rho) = rho inside [alpha, beta] =
  [low, high] and 0 outside; masked tokens contribute zero but still count in the normaliser
  (the paper's 1 / |y| per sequence), keeping their KL and entropy terms.

Every log ratio is bounded to [-20, 20] before ``exp`` (verl's safety bound), so neither the
weight nor its product over a long sequence overflows.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from meshrl.algorithms.losses import MeanMax
from meshrl.configs.schema import RLConfig

Mode = Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop"]
MODES: tuple[str, ...] = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop")
_MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class CorrectionParams:
    """Static hyper-parameters (hashable); the defaults are the config's (``from_config``)."""

    mode: str  # one of MODES
    cap: float  # TIS truncation C
    low: float  # MIS / IcePop band [low, high]
    high: float

    @classmethod
    def from_config(cls, rl: RLConfig) -> CorrectionParams:
        return cls(mode=rl.rollout_correction, cap=rl.correction_cap, low=rl.correction_low,
                   high=rl.correction_high)

    @property
    def on(self) -> bool:
        return self.mode != "none"


OFF = CorrectionParams(mode="none", cap=1.0, low=0.0, high=1.0)


class Correction(NamedTuple):
    weight_BxL: jax.Array  # noqa: N815 -- multiplies the per-token loss (stop-gradient)
    keep_BxL: jax.Array  # noqa: N815 -- float mask of tokens left in the loss (and its weight)
    rho_BxL: jax.Array  # noqa: N815 -- raw rho (token or sequence), before truncation/masking
    stats: dict[str, jax.Array]  # per-token [B, L] statistics, averaged over the input mask


def log_rho(proximal_BxL: jax.Array, behaviour_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """log(pi_old / pi_behav) per token, 0 off the mask (padding may hold -inf), bounded."""
    log_BxL = jnp.where(mask_BxL > 0, proximal_BxL - behaviour_BxL, 0.0)
    return jax.lax.stop_gradient(jnp.clip(log_BxL, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def compute(p: CorrectionParams, proximal_BxL: jax.Array, behaviour_BxL: jax.Array,
            mask_BxL: jax.Array, ids_BxL: jax.Array, num: int) -> Correction:
    """The correction of ``p.mode`` (not "none") for the loss tokens ``mask_BxL``; ``ids_BxL``
    and ``num`` name each token's sequence (``policy_loss.sequence_ids``)."""
    assert p.on, "compute() needs a rollout correction other than 'none'"
    mask_BxL = mask_BxL.astype(jnp.float32)
    log_BxL = log_rho(proximal_BxL, behaviour_BxL, mask_BxL)
    seq_log_S = jax.ops.segment_sum(log_BxL.reshape(-1), ids_BxL.reshape(-1), num_segments=num)
    seq_log_BxL = seq_log_S[ids_BxL]
    if p.mode.endswith("_seq"):
        log_BxL = jnp.clip(seq_log_BxL, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho_BxL = jnp.exp(log_BxL)
    if p.mode.startswith("tis"):
        hit_BxL = (rho_BxL > p.cap).astype(jnp.float32)
        weight_BxL, keep_BxL = jnp.minimum(rho_BxL, p.cap), mask_BxL
    else:
        inside_BxL = (rho_BxL >= p.low) & (rho_BxL <= p.high)
        hit_BxL = 1.0 - inside_BxL.astype(jnp.float32)
        weight_BxL = jnp.where(inside_BxL, rho_BxL, 0.0)
        # MIS rejects (the token leaves the normaliser); IcePop zeroes (it stays counted).
        keep_BxL = mask_BxL if p.mode == "icepop" else mask_BxL * (1.0 - hit_BxL)
    stats = {"rollout_corr_frac": hit_BxL, "rollout_seq_log_ratio": seq_log_BxL}
    return Correction(weight_BxL * mask_BxL, keep_BxL, rho_BxL, stats)


def weight_stats(c: Correction, mask_BxL: jax.Array) -> MeanMax:
    """Mean and max of the raw weight rho over the loss tokens (a sequence's rho on each of its
    tokens), reported as ``rollout_is_weight``, ``_max`` and ``_tokens``."""
    return MeanMax.of(c.rho_BxL, mask_BxL > 0)
