"""On-policy distillation's advantage (``algorithms/distill.py``) against a numpy reference on
hand-made logprobs and masks: padded rows, packed rows, the task-reward weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.algorithms.distill import distill_advantages, reverse_kl

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _numpy_advantages(teacher, behaviour, mask, task=None, weight=0.0):
    """The definition, one token at a time: A_t = log p_T - log p_S (+ w * task), 0 off mask."""
    out = np.zeros(mask.shape, np.float32)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t] > 0:
                out[b, t] = teacher[b, t] - behaviour[b, t]
                if task is not None:
                    out[b, t] += weight * task[b, t]
    return out


def _hand_made():
    # Two padded rows: prompt positions (mask 0) hold junk the advantage must ignore.
    teacher = np.array([[9.0, -0.1, -2.0, -0.5, 7.0],
                        [3.0, 4.0, -1.0, -3.0, -0.2]], np.float32)
    behaviour = np.array([[-5.0, -0.7, -0.4, -0.5, 1.0],
                          [2.0, 2.0, -2.5, -0.1, -1.2]], np.float32)
    mask = np.array([[0, 1, 1, 1, 0],
                     [0, 0, 1, 1, 1]], np.float32)
    return teacher, behaviour, mask


def test_advantage_is_teacher_minus_student_logprob_on_the_mask_and_zero_off_it():
    teacher, behaviour, mask = _hand_made()

    got = np.asarray(distill_advantages(teacher, behaviour, mask))

    np.testing.assert_allclose(got, _numpy_advantages(teacher, behaviour, mask), **TOL)
    np.testing.assert_allclose(got[0, 1:4], [0.6, -1.6, 0.0], **TOL)  # by hand
    assert (got[mask == 0] == 0).all()


def test_task_advantage_is_added_with_its_weight_and_ignored_at_weight_zero():
    teacher, behaviour, mask = _hand_made()
    task = np.array([[5.0, 1.0, 1.0, 1.0, 5.0],
                     [5.0, 5.0, -1.0, -1.0, -1.0]], np.float32)

    weighted = np.asarray(distill_advantages(teacher, behaviour, mask, task, 0.5))
    plain = np.asarray(distill_advantages(teacher, behaviour, mask, task, 0.0))

    np.testing.assert_allclose(weighted, _numpy_advantages(teacher, behaviour, mask, task, 0.5),
                               **TOL)
    np.testing.assert_allclose(plain, _numpy_advantages(teacher, behaviour, mask), **TOL)


def test_packed_row_gives_each_token_the_advantage_it_has_unpacked():
    teacher, behaviour, mask = _hand_made()
    # Both sequences packed into one row (the second one's prompt token first), plus padding.
    packed = [np.concatenate([x[0, :4], x[1, 1:], [0.0]])[None] for x in (teacher, behaviour)]
    packed_mask = np.concatenate([mask[0, :4], mask[1, 1:], [0.0]])[None]

    got = np.asarray(distill_advantages(*packed, packed_mask))

    unpacked = _numpy_advantages(teacher, behaviour, mask)
    np.testing.assert_allclose(got[0, :4], unpacked[0, :4], **TOL)
    np.testing.assert_allclose(got[0, 4:8], unpacked[1, 1:], **TOL)
    assert got[0, 8] == 0.0


def test_reverse_kl_is_the_token_mean_of_student_minus_teacher_and_jits():
    teacher, behaviour, mask = _hand_made()
    on = mask > 0
    want = (behaviour - teacher)[on].mean()

    got = jax.jit(reverse_kl)(jnp.asarray(teacher), jnp.asarray(behaviour), jnp.asarray(mask))

    np.testing.assert_allclose(float(got), want, **TOL)
    # A student equal to the teacher is at KL 0 and gets advantage 0 everywhere.
    assert float(reverse_kl(teacher, teacher, mask)) == 0.0
    assert not np.asarray(distill_advantages(teacher, teacher, mask)).any()


def test_empty_mask_gives_zero_kl_not_nan():
    teacher, behaviour, mask = _hand_made()

    assert float(reverse_kl(teacher, behaviour, np.zeros_like(mask))) == 0.0
