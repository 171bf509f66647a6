"""Loss functions, chosen by name in config: a small registry instead of learner subclasses.

A loss takes ``(logits_BxLxV, batch)`` (a ``TrainBatch``) and returns ``(loss_sum, weight_sum, aux_sums)``: sums, not
means, so the train step can add them over microbatches and divide once by the total weight. That
makes gradient accumulation equal one big batch (token-weighted), whatever the microbatch split.
``aux_sums`` are divided by the same total weight before they are reported.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshrl.algorithms.batch import TrainBatch

LossOutput = tuple[jax.Array, jax.Array, dict[str, jax.Array]]
LossFn = Callable[[jax.Array, TrainBatch], LossOutput]

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


def token_logprobs(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
    """log p(target) per position under softmax(logits / temperature), in float32 whatever the
    compute dtype. ``temperature`` is a static Python float; 1 adds no operation at all."""
    logits_BxLxV = tempered(logits_BxLxV, temperature)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    picked_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return picked_BxL - logz_BxL


def check_temperature(temperature: float) -> None:
    """Raise ValueError unless ``temperature > 0``: greedy decoding (0) has no distribution."""
    if not temperature > 0.0:
        raise ValueError(f"temperature = {temperature}: must be > 0 (greedy decoding has no "
                         f"distribution to score)")


def tempered(logits_BxLxV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """float32 ``logits / temperature``: the distribution the sampler draws from at that
    temperature (``inference.sampling.filter_logits`` casts, then divides, in the same order)."""
    check_temperature(temperature)
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    if temperature == 1.0:  # no division at all: T = 1 stays bitwise what it always was
        return logits_BxLxV
    return logits_BxLxV / temperature


@register("sft")
def sft_cross_entropy(logits_BxLxV: jax.Array, batch: TrainBatch) -> LossOutput:
    """Masked next-token cross-entropy; ``targets`` are already shifted by the data pipeline.

    ``token_accuracy`` counts a position as right when the target's logit is the row maximum
    (a tie counts as right). It reuses the max that the log-sum-exp needs: an ``argmax`` over
    the vocab was a separate variadic reduction that cost ~6% of a CPU train step.
    """
    targets_BxL = batch.targets
    mask_BxL = batch.loss_mask.astype(jnp.float32)
    assert logits_BxLxV.shape[:2] == targets_BxL.shape, (logits_BxLxV.shape, targets_BxL.shape)
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    max_BxL = jax.lax.stop_gradient(jnp.max(logits_BxLxV, axis=-1))
    logz_BxL = max_BxL + jnp.log(jnp.sum(jnp.exp(logits_BxLxV - max_BxL[..., None]), axis=-1))
    picked_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    nll_BxL = logz_BxL - picked_BxL
    correct_BxL = (picked_BxL >= max_BxL).astype(jnp.float32)
    return ((nll_BxL * mask_BxL).sum(), mask_BxL.sum(),
            {"token_accuracy": jax.lax.stop_gradient(correct_BxL * mask_BxL).sum()})
