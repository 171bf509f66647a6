"""The reference policy of the RL job's KL penalty (``rl.kl_coef > 0``), as in verl and AReaL.

The reference is the policy at RL step 0 (the ``model.hf_path`` checkpoint or the SFT warm
start), frozen: ``ReferencePolicy`` holds its own copy of those params on the trainer's
shardings (the train step donates the state, so the state's buffers cannot be shared) and one
jitted, sharded ``apply(batch)`` that runs once per RL step before the train step:

* scores the batch's targets under the reference at the sampler's temperature
  (``token_logprobs(forward(ref, ...), targets, T)``, 0 off the loss mask), microbatched like
  the train step and, from the jobs' ``decoder_forward``, with the logits in float32 chunks of
  ``trainer.logits_chunk`` tokens, so its logits never outgrow the step's;
* ``rl.kl_where == "loss"``: sets the batch's ``ref_logprobs`` (``make_rl_loss_fn``
  adds ``kl_coef * KL(current || ref)`` per token and reports it as ``kl_ref``);
* ``rl.kl_where == "reward"``: replaces ``advantages`` by ``kl_reward_advantages`` (rewards
  minus ``kl_coef`` times each sequence's summed KL(behaviour || ref), advantages recomputed
  with the same registered estimator over the batch's contiguous groups) times the loss mask;
  the batch's ``sample_ids`` map each token to its sample and the batch's ``rewards`` give each
  sample's reward, so packed rows work the same;
* returns the token mean of KL(behaviour || ref) (``rl.kl_estimator``) as the metric
  ``kl_behaviour_ref``, in either mode.

On-policy distillation (``distill.teacher``, docs/distill.md) uses the same path with a
teacher in the reference's place: its own forward and params (another width or depth, the
student's tokenizer), scoring the batch's targets the same way, and the batch's advantages replaced on
the device by ``algorithms.distill.distill_advantages`` (log p_teacher - log p_behaviour per
token, no group baseline), its metric ``distill_reverse_kl``.

Cost: one more copy of the params (no optimizer state) on the trainer mesh, and one forward
pass per step without activations kept for a backward pass. A LoRA run's reference holds no
copy: it is the adapter-disabled forward over the engine's frozen base (``base``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms import kl as kl_lib
from meshrl.algorithms.batch import RLTrainBatch, TrainBatch
from meshrl.algorithms.distill import distill_advantages, reverse_kl
from meshrl.algorithms.kl import kl_reward_advantages
from meshrl.algorithms.losses import check_temperature, token_logprobs
from meshrl.configs.schema import DistillConfig, RLConfig
from meshrl.trainer.step import ForwardFn, merge_rows, split_rows


def ref_fields(rl: RLConfig) -> tuple[str, ...]:
    """The optional ``RLTrainBatch`` fields the train step gets: ``ref_logprobs`` when the KL
    is in the loss, ``rewards`` (for the reference's advantages) when it is in the reward."""
    if not rl.kl_coef > 0.0:
        return ()
    return ("ref_logprobs",) if rl.kl_where == "loss" else ("rewards",)


def sample_values(values_BxL: jax.Array, sample_ids_BxL: jax.Array, samples: int) -> jax.Array:
    """``[samples]``: the per-sample value each token of a sample carries (e.g. its reward)."""
    ids_BxL = jnp.where(sample_ids_BxL >= 0, sample_ids_BxL, samples)
    return jnp.zeros((samples,), values_BxL.dtype).at[ids_BxL].set(values_BxL, mode="drop")


def _by_microbatch(fn: Any, batch: Any, m: int) -> jax.Array:
    """``fn`` over ``m`` strided microbatches (row i in microbatch i % m, as the train step
    splits), results put back in row order."""
    if m == 1:
        return fn(batch)
    return merge_rows(jax.lax.map(fn, jax.tree.map(lambda v: split_rows(v, m), batch)))


def reference_logprobs(forward_fn: ForwardFn, ref_params: Any, batch: TrainBatch, *,
                       temperature: float, microbatches: int = 1,
                       routing: jax.Array | None = None) -> jax.Array:
    """``[B, L]`` log p_ref(target) under softmax(logits / temperature); 0 off the loss mask.
    ``routing``: the batch's MoE routing replay (``RLTrainBatch.routing``), for forwards of the
    model that sampled it (never a distillation teacher's)."""
    def one(mbr: tuple[TrainBatch, Any]) -> jax.Array:
        mb, replay = mbr
        out = forward_fn(ref_params, mb.input_ids, mb.positions, mb.segment_ids,
                         *(() if replay is None else (replay,)))
        logp_BxL = token_logprobs(out, mb.targets, temperature)
        return jnp.where(mb.loss_mask > 0, logp_BxL, 0.0)

    # Only the fields the forward pass reads are split into microbatches.
    core = TrainBatch(input_ids=batch.input_ids, targets=batch.targets,
                      loss_mask=batch.loss_mask, positions=batch.positions,
                      segment_ids=batch.segment_ids)
    ref_BxL = _by_microbatch(one, (core, routing), microbatches)
    assert ref_BxL.shape == batch.targets.shape, (ref_BxL.shape, batch.targets.shape)
    return ref_BxL


def frozen_copy(params: Any, params_sh: Any) -> Any:
    """A copy of ``params`` in buffers of its own on ``params_sh``: the caller's params become
    the train state, which each step donates, so a frozen reference cannot share them."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=params_sh)(params)


def _kl_apply(rl: RLConfig, forward_fn: ForwardFn, *, samples: int, temperature: float,
              group_size: int, microbatches: int) -> Any:
    """The KL reference's ``apply(params, batch) -> (batch, metrics)`` (module docstring)."""
    kl_fn = kl_lib.get(rl.kl_estimator)
    in_loss = rl.kl_where == "loss"

    def apply(ref_params: Any, batch: RLTrainBatch) -> tuple[RLTrainBatch, dict[str, jax.Array]]:
        # The frozen reference is the sampled model's step-0 params: it replays the routing too.
        ref_BxL = reference_logprobs(forward_fn, ref_params, batch, temperature=temperature,
                                     microbatches=microbatches, routing=batch.routing)
        mask_BxL = batch.loss_mask.astype(jnp.float32)
        behaviour_BxL = jnp.where(mask_BxL > 0, batch.behaviour_logprobs, 0.0)
        kl_BxL = kl_fn(behaviour_BxL, ref_BxL) * mask_BxL
        metrics = {"kl_behaviour_ref": kl_BxL.sum() / jnp.maximum(mask_BxL.sum(), 1.0)}
        if in_loss:
            return batch.replace(ref_logprobs=ref_BxL), metrics
        # Rows may be packed: each token finds its sample's reward by ``sample_ids``.
        ids_BxL = batch.sample_ids
        rewards_B = sample_values(batch.rewards, ids_BxL, samples)
        adv_B = kl_reward_advantages(rl, rewards_B, batch.behaviour_logprobs, ref_BxL,
                                     mask_BxL, group_size, sample_ids_BxL=ids_BxL)
        advantages_BxL = (adv_B[jnp.maximum(ids_BxL, 0)] * mask_BxL).astype(
            batch.advantages.dtype)
        return batch.replace(advantages=advantages_BxL), metrics

    return apply


def _distill_apply(distill: DistillConfig, forward_fn: ForwardFn, *, temperature: float,
                   microbatches: int) -> Any:
    """The teacher's ``apply(params, batch) -> (batch, metrics)``: the batch's advantages become
    ``algorithms.distill.distill_advantages`` (per token: log p_teacher - log p_behaviour, plus
    ``distill.reward_weight`` times the task advantages the batch brought), on the device."""
    def apply(teacher_params: Any, batch: RLTrainBatch
              ) -> tuple[RLTrainBatch, dict[str, jax.Array]]:
        teacher_BxL = reference_logprobs(forward_fn, teacher_params, batch,
                                         temperature=temperature, microbatches=microbatches)
        mask_BxL = batch.loss_mask
        adv_BxL = distill_advantages(teacher_BxL, batch.behaviour_logprobs, mask_BxL,
                                     batch.advantages, distill.reward_weight)
        metrics = {"distill_reverse_kl": reverse_kl(teacher_BxL, batch.behaviour_logprobs,
                                                    mask_BxL)}
        return batch.replace(advantages=adv_BxL.astype(batch.advantages.dtype)), metrics

    return apply


class ReferencePolicy:
    """Frozen params and the per-step function that puts their scores into the batch: the KL
    reference (step-0 params, ``rl.kl_coef > 0``) or, with ``distill``, the distillation
    teacher (its own forward, params and shardings, on the trainer's mesh; ``arch`` its
    architecture, for evaluating it)."""

    def __init__(self, rl: RLConfig, forward_fn: ForwardFn, params: Any, params_sh: Any,
                 mesh: Mesh, batch_sh: RLTrainBatch, *, samples: int, temperature: float,
                 group_size: int, microbatches: int = 1, distill: DistillConfig | None = None,
                 arch: Any = None, base: Callable[[], Any] | None = None) -> None:
        check_temperature(temperature)
        # ``base``: a LoRA run's reference reads the engine's frozen base at each apply (the
        # train step donates and returns it, so it is neither held nor copied here).
        self._base = base
        if base is not None:
            self.params = None
            apply = _kl_apply(rl, forward_fn, samples=samples, temperature=temperature,
                              group_size=group_size, microbatches=microbatches)
        elif distill is not None:
            # The teacher's params are its own (no train state donates them): no copy.
            self.params = params
            apply = _distill_apply(distill, forward_fn, temperature=temperature,
                                   microbatches=microbatches)
        else:
            if not rl.kl_coef > 0.0:
                raise ValueError(f"rl.kl_coef = {rl.kl_coef}: a reference policy needs > 0")
            self.params = frozen_copy(params, params_sh)
            apply = _kl_apply(rl, forward_fn, samples=samples, temperature=temperature,
                              group_size=group_size, microbatches=microbatches)
        self.arch = arch
        replicated = NamedSharding(mesh, PartitionSpec())
        in_sh = batch_sh.replace(ref_logprobs=None)
        self._apply = jax.jit(apply, in_shardings=(params_sh, in_sh),
                              out_shardings=(batch_sh, replicated))

    def apply(self, batch: RLTrainBatch) -> tuple[RLTrainBatch, dict[str, jax.Array]]:
        """(the train step's batch, ``{"kl_behaviour_ref" or "distill_reverse_kl": scalar}``);
        no host sync."""
        return self._apply(self.params if self._base is None else self._base(), batch)
