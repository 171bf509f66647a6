"""Loss functions, chosen by name in config: a small registry instead of learner subclasses.

A loss takes ``(out, batch)``: the model output (logits ``[B, L, V]`` or a ``Hidden``, whose
logits it computes in float32 chunks, see ``logits``) and a ``TrainBatch``. It returns
``(loss_sum, weight_sum, aux_sums)``: sums, not means, so the train step can add them over
microbatches and divide once by the total weight. That makes gradient accumulation equal one
big batch (token-weighted), whatever the microbatch split, for every loss but an MoE model's
load-balancing term: a product of per-expert fractions, it is computed per microbatch (as
Megatron and MaxText do under gradient accumulation) and weighted by its tokens.
``aux_sums`` are divided by the same total weight before they are reported, except a ``Mean``
or ``MeanMax`` entry: a statistic over its own selection of tokens (e.g. the RL job's
``logprob_mismatch``), whose sums (and max) the step combines itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from meshrl.algorithms.batch import TrainBatch
from meshrl.algorithms.logits import (
    Hidden,
    ModelOutput,
    check_temperature,
    tempered,
    token_stats,
)
from meshrl.utils.registry import Registry

__all__ = ["Hidden", "LossFn", "LossOutput", "Mean", "MeanMax", "ModelOutput", "check_temperature",
           "add_outputs", "get_loss", "register", "report_aux", "router_terms", "sft_cross_entropy",
           "tempered",
           "token_logprobs"]



@flax.struct.dataclass
class MeanMax:
    """An aux statistic of non-negative per-token values over the tokens it selects, not over the
    loss weight: ``total`` and ``count`` add and ``max`` takes the maximum over microbatches, and
    ``report_aux`` reports ``name`` = total / count, ``name_max`` and ``name_tokens`` (all 0
    when no token is selected)."""

    total: jax.Array
    count: jax.Array
    max: jax.Array

    @classmethod
    def of(cls, x_BxL: jax.Array, selected_BxL: jax.Array) -> MeanMax:
        """Of the values ``x_BxL >= 0`` where ``selected_BxL`` (bool) is true."""
        x_BxL = jnp.where(selected_BxL, x_BxL, 0.0)
        return cls(x_BxL.sum(), selected_BxL.astype(jnp.float32).sum(), x_BxL.max())

    def merge(self, other: MeanMax) -> MeanMax:
        return MeanMax(self.total + other.total, self.count + other.count,
                       jnp.maximum(self.max, other.max))


@flax.struct.dataclass
class Mean:
    """An aux statistic (of any sign) over its own selection of tokens, not over the loss
    weight: ``total`` and ``count`` add over microbatches and minibatches, and ``report_aux``
    reports total / count (0 when nothing is selected). A loss that drops tokens (a rollout
    correction's rejections) still reports its statistics over the tokens it was given."""

    total: jax.Array
    count: jax.Array

    def merge(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count)

    def value(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1.0)


def is_mean_max(x: object) -> bool:
    return isinstance(x, MeanMax)


def _is_stat(x: object) -> bool:
    return isinstance(x, (Mean, MeanMax))


def add_outputs(a: Any, b: Any) -> Any:
    """Sum of two microbatches' loss outputs (or any pytree holding aux dicts): leaves add,
    ``Mean`` and ``MeanMax`` entries merge."""
    return jax.tree.map(lambda x, y: x.merge(y) if _is_stat(x) else jnp.add(x, y), a, b,
                        is_leaf=_is_stat)


def report_aux(aux: dict[str, jax.Array | MeanMax], denom: jax.Array) -> dict[str, jax.Array]:
    """The reported values of accumulated aux sums: each sum / ``denom`` (the loss weight), and
    for a ``MeanMax`` ``name`` its mean, ``name_max`` and ``name_tokens``."""
    out: dict[str, jax.Array] = {}
    for k, v in aux.items():
        if is_mean_max(v):
            out.update({k: v.total / jnp.maximum(v.count, 1.0), f"{k}_max": v.max,
                        f"{k}_tokens": v.count})
        elif isinstance(v, Mean):
            out[k] = v.value()
        else:
            out[k] = v / denom
    return out


def router_terms(out: ModelOutput, loss_sum: jax.Array, weight: jax.Array,
                 aux: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    """An MoE model's router losses added to a loss output (a dense model's pass through):
    ``aux_loss_coef`` x the load-balancing loss (HF's ``load_balancing_loss_func``: experts x
    the sum over experts of the fraction of top-k assignments times the mean router
    probability, over the real tokens of every layer) plus ``z_loss_coef`` x the z-loss (the
    mean squared log-sum-exp of the router logits), each scaled by ``weight`` like the loss
    sums. Metrics ``moe/aux_loss``, ``moe/z_loss``, ``moe/load_max_over_mean`` (tokens per
    expert, all layers) and ``moe/dropped_frac`` (copies over capacity)."""
    if not isinstance(out, Hidden) or out.router is None:
        return loss_sum, aux
    r = out.router
    rows = jnp.maximum(r["rows"], 1.0)
    counts_E = r["counts"]
    balance = counts_E.shape[0] * jnp.sum((counts_E / rows) * (r["prob_sum"] / rows))
    z_loss = r["z_sum"] / rows
    loss_sum = loss_sum + weight * (out.aux_loss_coef * balance + out.z_loss_coef * z_loss)
    max_over_mean = counts_E.max() / jnp.maximum(counts_E.mean(), 1e-9)
    dropped = r["dropped"] / jnp.maximum(counts_E.sum(), 1.0)
    return loss_sum, {**aux, "moe/aux_loss": balance * weight, "moe/z_loss": z_loss * weight,
                      "moe/load_max_over_mean": max_over_mean * weight,
                      "moe/dropped_frac": dropped * weight}


LossOutput = tuple[jax.Array, jax.Array, dict[str, jax.Array]]
LossFn = Callable[[ModelOutput, TrainBatch], LossOutput]

_LOSSES: Registry[LossFn] = Registry("loss")
register = _LOSSES.register
get_loss = _LOSSES.get


def token_logprobs(out: ModelOutput, targets_BxL: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
    """log p(target) per position under softmax(logits / temperature), in float32 whatever the
    compute dtype; ``out`` is logits or a ``Hidden`` (chunked, see ``logits``). ``temperature``
    is a static Python float; 1 adds no operation at all."""
    return token_stats(out, targets_BxL, temperature).logprobs_BxL


@register("sft")
def sft_cross_entropy(out: ModelOutput, batch: TrainBatch) -> LossOutput:
    """Masked next-token cross-entropy; ``targets`` are already shifted by the data pipeline.

    ``out``: logits ``[B, L, V]`` or a ``Hidden`` (scored chunk by chunk, float32).
    ``token_accuracy`` counts a position as right when the target's logit is the row maximum
    (a tie counts as right). It reuses the max that the log-sum-exp needs: an ``argmax`` over
    the vocab was a separate variadic reduction that cost ~6% of a CPU train step.
    """
    mask_BxL = batch.loss_mask.astype(jnp.float32)
    stats = token_stats(out, batch.targets, correct=True)
    nll_BxL = -stats.logprobs_BxL
    return ((nll_BxL * mask_BxL).sum(), mask_BxL.sum(),
            {"token_accuracy": (stats.correct_BxL * mask_BxL).sum()})
