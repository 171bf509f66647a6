"""Log-probabilities under a truncated sampling distribution (top-k, top-p, min-p).

Every truncating filter of the sampler (``inference.sampling``) keeps a prefix of the tokens
sorted by scaled logit, so the kept set of a token is "the ``n`` largest of softmax(logits /
T)'s logits", ties at the threshold included, and the sampler records that ``n`` (``kept``)
per generated token. The trainer runs the same model, so it rebuilds the set from its own
logits: with z = logits / T and t the ``n``-th largest z,

    log p(y) = z_y - logsumexp({z_v : z_v >= t})

and ``y`` is *outside* the set when z_y < t (possible only through numerics or stale params:
the sampler never draws outside its set). Such a token's value stays finite (z_y minus the
set's log-sum-exp, no -inf) and the loss masks it out (``outside_BxL``).

Cost: with a static cap on ``n`` (``sampler.top_k > 0``) the threshold is a ``lax.top_k`` of
``cap`` entries per token; without one (top-p or min-p alone) it needs a full sort of the
vocabulary per token, chunk by chunk like the logits themselves (docs/rl.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshrl.configs.schema import SamplerConfig

# The fraction of loss tokens outside the trainer's kept set (a ``losses.MeanMax``).
METRIC = "rl/truncation_mismatch_frac"


def kept_threshold(z_xV: jax.Array, kept_x: jax.Array, cap: int = 0) -> jax.Array:
    """The ``kept``-th largest entry of each row of ``z_xV`` (stop-gradient); ``kept`` <= 0
    or > V means the whole vocabulary. ``cap`` > 0 promises ``kept`` <= ``cap`` up to ties
    at the threshold (the sampler's top-k): a ``lax.top_k`` of ``cap`` entries, not a sort."""
    V = z_xV.shape[-1]
    n_x = jnp.where((kept_x <= 0) | (kept_x > V), V, kept_x)
    z_xV = jax.lax.stop_gradient(z_xV)
    if 0 < cap < V:
        # A tie at the top-k threshold can make the sampler keep more than cap tokens; the
        # cap-th value is then the threshold value itself.
        top_xC = jax.lax.top_k(z_xV, cap)[0]
        n_x = jnp.minimum(n_x, cap)
    else:
        top_xC = -jnp.sort(-z_xV, axis=-1)
    return jnp.take_along_axis(top_xC, (n_x - 1)[..., None], axis=-1)[..., 0]


def truncated_stats(z_xV: jax.Array, picked_x: jax.Array, kept_x: jax.Array, cap: int,
                    *, entropy: bool) -> tuple[jax.Array, jax.Array | None, jax.Array,
                                               jax.Array]:
    """(log p(target), entropy or None, row max, outside) under each row's truncated,
    renormalised distribution (module docstring). ``z_xV`` is float32 logits / T,
    ``picked_x`` the target's entry of it; ``outside`` is float32 1 where the target is not in
    the set."""
    threshold_x = kept_threshold(z_xV, kept_x, cap)
    in_set_xV = z_xV >= threshold_x[..., None]
    max_x = jax.lax.stop_gradient(jnp.max(z_xV, axis=-1))  # always in the set
    shifted_xV = z_xV - max_x[..., None]
    # where, not a -inf fill: exp of an excluded entry is finite and gets no gradient.
    log_sum_x = jnp.log(jnp.sum(jnp.where(in_set_xV, jnp.exp(shifted_xV), 0.0), axis=-1))
    logprobs_x = picked_x - (max_x + log_sum_x)
    entropy_x = None
    if entropy:
        logp_xV = shifted_xV - log_sum_x[..., None]
        entropy_x = -jnp.where(in_set_xV, jnp.exp(logp_xV) * logp_xV, 0.0).sum(-1)
    outside_x = jax.lax.stop_gradient((picked_x < threshold_x).astype(jnp.float32))
    return logprobs_x, entropy_x, max_x, outside_x


def inside_mask(loss_mask_BxL: jax.Array, outside_BxL: jax.Array | None) -> jax.Array:
    """float32 loss mask without the tokens outside the trainer's kept set (``None``: no
    truncation, the mask as is)."""
    mask_BxL = loss_mask_BxL.astype(jnp.float32)
    return mask_BxL if outside_BxL is None else mask_BxL * (1.0 - outside_BxL)



def truncates(sampler: SamplerConfig) -> bool:
    """Whether ``sampler``'s settings truncate the distribution it samples from."""
    return sampler.top_k > 0 or sampler.top_p < 1.0 or sampler.min_p > 0.0


def batch_fields(sampler: SamplerConfig) -> tuple[str, ...]:
    """The optional ``RLTrainBatch`` fields truncated sampling adds: ``("kept",)`` or ()."""
    return ("kept",) if truncates(sampler) else ()
