"""The RL job's train step: PPO minibatches and epochs over one rollout batch, and the
sampler-trainer logprob mismatch.

``make_rl_train_step`` returns ``train_step(state, batch) -> (state, metrics)`` for one rollout
batch. With ``rl.ppo_minibatches = rl.ppo_epochs = 1`` it is ``make_train_step`` (one optimizer
update, bitwise the step without minibatches), its loss told the weight version ``state.step``
so that it reports ``logprob_mismatch``. Otherwise, inside the one jitted step:

1. one forward pass without a backward pass (microbatched, ``trainer.reference``'s
   ``reference_logprobs`` under the current params) scores the batch under the params as they
   are before the batch's first update: these are decoupled PPO's ``proximal_logprobs`` (unless
   the batch brings its own) and the trainer side of ``logprob_mismatch``;
2. the loss weight (tokens or sequences) of the *whole* batch is computed once and divides every
   minibatch's loss and gradient: the minibatch losses of an epoch sum to the batch's loss as
   one update would define it (AReaL and verl divide by each minibatch's own weight instead:
   docs/rl.md);
3. ``lax.scan`` over ``ppo_epochs`` passes of a ``lax.scan`` over ``ppo_minibatches`` strided
   minibatches (row i in minibatch i % K, like the microbatch split, so each minibatch keeps
   the batch's data sharding), one optimizer update each, with ``trainer.microbatches``
   gradient accumulation inside each minibatch and the non-finite guard per update.

Counters: ``state.step`` counts train steps (rollout batches, one per call, whatever the
updates inside), so in the RL job it is the weight version of the params the step starts from;
``weight_version`` goes up by one per step that applied at least one update (the params
changed); ``skipped`` counts skipped updates; the optimizer's own count (in ``opt_state``)
counts applied updates. Metrics: ``loss`` and the loss's aux statistics are the epochs' mean of
the sum over minibatches (each minibatch's share of the batch mean), ``grad_norm`` the mean over
updates, ``updates`` the applied updates, ``logprob_mismatch*`` (and with a rollout correction
``rollout_is_weight*``) from step 1.

Truncated sampling (the batch's ``kept``, ``algorithms.truncation``): every logprob the step
computes -- current, proximal, the trainer side of the mismatch -- is under the policy's
logits truncated to each token's kept count and renormalised; a loss token outside the
trainer's kept set is taken out of the loss mask (step 1 decides it for the whole batch, the
loss again per update) and counted in ``rl/truncation_mismatch_frac``.

MoE routing replay (the batch's ``routing``, ``rl.routing_replay``): every forward of the
step -- the loss's, step 1's and the KL reference's -- routes the recorded positions to the
sampler's experts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshrl.algorithms import policy_loss as pl
from meshrl.algorithms import truncation as trunc
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.logits import token_stats
from meshrl.algorithms.losses import LossFn, Mean, MeanMax, is_mean_max, report_aux
from meshrl.configs.schema import RLConfig
from meshrl.trainer.optimizer import Schedule
from meshrl.trainer.reference import reference_logprobs
from meshrl.trainer.state import TrainState
from meshrl.trainer.step import (
    Batch,
    ForwardFn,
    Metrics,
    StepFn,
    guarded_update,
    make_grads_fn,
    make_train_step,
    merge_rows,
    replay_args,
    scaled_grads,
    split_rows,
)

MEANS = "means"  # the per-update ``Mean`` statistics, combined after the updates


def updates_per_step(rl: RLConfig) -> int:
    """Optimizer updates per rollout batch: ``rl.ppo_minibatches * rl.ppo_epochs``."""
    return rl.ppo_minibatches * rl.ppo_epochs


def truncated_logprobs(forward_fn: ForwardFn, params: Any, batch: RLTrainBatch, *,
                       temperature: float, kept_cap: int = 0, microbatches: int = 1
                       ) -> tuple[jax.Array, jax.Array]:
    """``[B, L]`` log p(target) under softmax(logits / temperature) truncated to each
    token's ``batch.kept`` largest entries, and ``[B, L]`` 1.0 where the target is outside
    that set; both 0 off the loss mask. Microbatched like ``reference_logprobs``."""
    def one(mb: RLTrainBatch) -> tuple[jax.Array, jax.Array]:
        out = forward_fn(params, mb.input_ids, mb.positions, mb.segment_ids, *replay_args(mb))
        t = token_stats(out, mb.targets, temperature, kept_BxL=mb.kept, kept_cap=kept_cap)
        on_BxL = mb.loss_mask > 0
        return jnp.where(on_BxL, t.logprobs_BxL, 0.0), jnp.where(on_BxL, t.outside_BxL, 0.0)

    if microbatches == 1:
        return one(batch)
    outs = jax.lax.map(one, jax.tree.map(lambda v: split_rows(v, microbatches), batch))
    return jax.tree.map(merge_rows, outs)


def _before_updates(forward_fn: ForwardFn, params: Any, batch: RLTrainBatch, *,
                    temperature: float, kept_cap: int, microbatches: int
                    ) -> tuple[jax.Array, RLTrainBatch, dict[str, MeanMax]]:
    """(logprobs under ``params``, the batch without the loss tokens outside the kept set,
    the truncation metric); the batch as is and no metric without ``batch.kept``."""
    if batch.kept is None:
        return reference_logprobs(forward_fn, params, batch, temperature=temperature,
                                  microbatches=microbatches, routing=batch.routing), batch, {}
    logp_BxL, outside_BxL = truncated_logprobs(forward_fn, params, batch,
                                               temperature=temperature, kept_cap=kept_cap,
                                               microbatches=microbatches)
    metric = {trunc.METRIC: MeanMax.of(outside_BxL, batch.loss_mask > 0)}
    return logp_BxL, batch.replace(
        loss_mask=trunc.inside_mask(batch.loss_mask, outside_BxL)), metric


def make_rl_train_step(forward_fn: ForwardFn, loss_fn: LossFn, tx: optax.GradientTransformation,
                       schedule: Schedule, *, rl: RLConfig, temperature: float = 1.0,
                       microbatches: int = 1, kept_cap: int = 0) -> StepFn:
    """The RL step (module docstring). ``loss_fn`` is ``make_rl_loss_fn(rl, temperature,
    kept_cap)`` (it takes ``version=``); ``schedule`` is indexed by train step
    (``make_optimizer`` with ``updates_per_step``); ``kept_cap``: ``sampler.top_k``, a static
    bound on the kept counts of a truncated batch (0: none)."""
    K, E = rl.ppo_minibatches, rl.ppo_epochs

    if K * E == 1:
        def one_update(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
            def versioned(out: Any, mb: Batch) -> Any:
                return loss_fn(out, mb, version=state.step)
            step = make_train_step(forward_fn, versioned, tx, schedule, microbatches=microbatches)
            return step(state, batch)
        return one_update

    accumulate = make_grads_fn(forward_fn, loss_fn, microbatches)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        B = batch.targets.shape[0]
        assert B % (K * microbatches) == 0, (B, K, microbatches)
        # Before any update: the proximal policy and the trainer side of the mismatch. Split as
        # finely as an update's microbatch, so this pass never holds more than one does.
        logp_BxL, batch, truncation = jax.lax.stop_gradient(_before_updates(
            forward_fn, state.params, batch, temperature=temperature, kept_cap=kept_cap,
            microbatches=K * microbatches))
        if batch.proximal_logprobs is None:
            batch = batch.replace(proximal_logprobs=logp_BxL)
        mismatch = pl.logprob_mismatch(logp_BxL, batch, state.step)
        weight = pl.loss_weight(rl, batch)
        denom = jnp.maximum(weight, 1.0)
        mbs = jax.tree.map(lambda v: split_rows(v, K), batch)

        def update(carry: tuple[Any, Any], mb: Batch) -> tuple[tuple[Any, Any], Metrics]:
            params, opt_state = carry
            loss_sum, _, aux, grads = accumulate(params, mb)
            assert not any(is_mean_max(v) for v in aux.values()), sorted(aux)
            grads = scaled_grads(grads, denom, params)
            loss = loss_sum / denom
            params, opt_state, grad_norm, finite = guarded_update(tx, params, opt_state, grads,
                                                                  loss)
            # A ``Mean`` adds over the minibatches and epochs as its sums; the rest is a share
            # of the loss weight.
            means = {k: v for k, v in aux.items() if isinstance(v, Mean)}
            rest = {k: v for k, v in aux.items() if k not in means}
            return (params, opt_state), {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                                         MEANS: means, **report_aux(rest, denom)}

        def epoch(carry: tuple[Any, Any], _: None) -> tuple[tuple[Any, Any], Metrics]:
            return jax.lax.scan(update, carry, mbs)

        (params, opt_state), per_ExK = jax.lax.scan(epoch, (state.params, state.opt_state),
                                                    None, length=E)
        finite_ExK = per_ExK.pop("finite")
        means = {k: Mean(v.total.sum(), v.count.sum()).value()
                 for k, v in per_ExK.pop(MEANS).items()}
        applied = finite_ExK.astype(jnp.int32).sum()
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state,
            weight_version=state.weight_version + (applied > 0).astype(jnp.int32),
            skipped=state.skipped + (K * E - applied))
        grad_norm = per_ExK.pop("grad_norm").mean()
        metrics = {**{k: v.sum() / E for k, v in per_ExK.items()}, **means,
                   "grad_norm": grad_norm, "learning_rate": schedule(state.step),
                   "tokens": weight, "finite": finite_ExK.all(), "skipped": new_state.skipped,
                   "step": state.step, "updates": applied, **report_aux(
                       {"logprob_mismatch": mismatch, **pl.correction_stats(rl, batch),
                        **truncation}, denom)}
        return new_state, metrics

    return train_step
