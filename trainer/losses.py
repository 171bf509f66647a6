"""Loss functions, chosen by name in config: a small registry instead of learner subclasses.

A loss takes ``(logits_BxLxV, batch)`` and returns ``(loss_sum, weight_sum, aux_sums)``: sums, not
means, so the train step can add them over microbatches and divide once by the total weight. That
makes gradient accumulation equal one big batch (token-weighted), whatever the microbatch split.
``aux_sums`` are divided by the same total weight before they are reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

LossOutput = tuple[jax.Array, jax.Array, dict[str, jax.Array]]
LossFn = Callable[[jax.Array, Mapping[str, jax.Array]], LossOutput]

_LOSSES: dict[str, LossFn] = {}


def register(name: str) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        if name in _LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        _LOSSES[name] = fn
        return fn
    return deco


def get_loss(name: str) -> LossFn:
    if name not in _LOSSES:
        raise KeyError(f"loss {name!r} is not registered; known: {sorted(_LOSSES)}")
    return _LOSSES[name]


def token_logprobs(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """log p(target) per position, in float32 whatever the compute dtype."""
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    picked_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return picked_BxL - logz_BxL


@register("sft")
def sft_cross_entropy(logits_BxLxV: jax.Array, batch: Mapping[str, jax.Array]) -> LossOutput:
    """Masked next-token cross-entropy; ``targets`` are already shifted by the data pipeline."""
    targets_BxL = batch["targets"]
    mask_BxL = batch["loss_mask"].astype(jnp.float32)
    assert logits_BxLxV.shape[:2] == targets_BxL.shape, (logits_BxLxV.shape, targets_BxL.shape)
    nll_BxL = -token_logprobs(logits_BxLxV, targets_BxL)
    correct_BxL = (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)
    return ((nll_BxL * mask_BxL).sum(), mask_BxL.sum(),
            {"token_accuracy": (correct_BxL * mask_BxL).sum()})
