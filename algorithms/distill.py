"""On-policy distillation's advantage (``distill.teacher``): the student samples, a frozen
teacher scores the student's tokens, and each token's advantage is the negative of the
per-token reverse KL estimate,

    A_t = log p_teacher(y_t | y_<t) - log p_student_old(y_t | y_<t),

as in Thinking Machines' on-policy distillation, verl, slime and SkyRL: no group baseline and
no discounting, so every token is pushed towards the teacher by how much the teacher prefers it
to the student that sampled it. ``p_student_old`` is the behaviour policy (the sampler's
logprobs), so the advantage summed over a sequence is the k1 estimate of
``-KL(student || teacher)`` on the sequence the student sampled. An optional task advantage
(the registered ``rl.advantage`` over the rewards, already in the batch) is added with weight
``distill.reward_weight``. The existing policy losses then train on these advantages.

Pure array math: jit-able on jax arrays and runnable on numpy arrays, one token at a time, so
packed rows (several sequences per row) need no sample ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def distill_advantages(teacher_BxL: jax.Array, behaviour_BxL: jax.Array, mask_BxL: jax.Array,
                       task_advantages_BxL: jax.Array | None = None,
                       reward_weight: float = 0.0) -> jax.Array:
    """``[B, L]`` advantages: ``teacher - behaviour (+ reward_weight * task)`` on the loss
    mask, 0 off it (whatever the inputs hold there)."""
    assert teacher_BxL.shape == behaviour_BxL.shape == mask_BxL.shape, (
        teacher_BxL.shape, behaviour_BxL.shape, mask_BxL.shape)
    on_BxL = mask_BxL > 0
    adv_BxL = jnp.where(on_BxL, teacher_BxL - behaviour_BxL, 0.0).astype(jnp.float32)
    if task_advantages_BxL is not None and reward_weight:
        assert task_advantages_BxL.shape == mask_BxL.shape, task_advantages_BxL.shape
        adv_BxL = adv_BxL + reward_weight * jnp.where(on_BxL, task_advantages_BxL, 0.0)
    return adv_BxL


def reverse_kl(teacher_BxL: jax.Array, behaviour_BxL: jax.Array, mask_BxL: jax.Array
               ) -> jax.Array:
    """Token mean over the loss mask of ``log p_student - log p_teacher`` on the student's own
    samples: the k1 estimate of KL(student || teacher), the quantity distillation drives to 0."""
    on_BxL = mask_BxL > 0
    kl_BxL = jnp.where(on_BxL, behaviour_BxL - teacher_BxL, 0.0)
    return kl_BxL.sum() / jnp.maximum(on_BxL.sum(), 1)
