"""RolloutBatch: padding to a bucket, masks and versions, advantages, the trainer's view."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshrl.workflows import RolloutBatch, Trajectory, build_rollout_batch


def traj(prompt, completion, mask, versions, reward, group_id=0):
    n = len(completion)
    return Trajectory(list(prompt), list(completion), [-0.5] * n, list(versions), list(mask),
                      reward=reward, group_id=group_id)


def two_groups() -> list[list[Trajectory]]:
    return [[traj([1, 2], [5, 6, 7], [1, 1, 1], [3, 3, 4], 1.0),
             traj([1, 2], [5, 8], [1, 1], [4, 4], 0.0)],
            [traj([3], [9, 90, 91, 9], [1, 0, 0, 1], [4, -1, -1, 4], 0.5, 1),
             traj([3], [9], [1], [4], 0.0, 1)]]


def test_builder_right_pads_to_the_smallest_fitting_bucket_and_masks_only_generated_tokens():
    batch = build_rollout_batch(two_groups(), length_buckets=(4, 8, 16), pad_id=0)

    assert batch.shape == (4, 8) and (batch.num_groups, batch.group_size) == (2, 2)
    np.testing.assert_array_equal(batch.tokens_BxL[0], [1, 2, 5, 6, 7, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask_BxL[2], [0, 1, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.versions_BxL[0], [-1, -1, 3, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(batch.versions_BxL[2], [-1, 4, -1, -1, 4, -1, -1, -1])
    np.testing.assert_allclose(batch.behaviour_logprobs_BxL[2], [0, -0.5, 0, 0, -0.5, 0, 0, 0],
                               rtol=0, atol=0)
    np.testing.assert_array_equal(batch.segment_ids_BxL[1], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.positions_BxL[1], [0, 1, 2, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.group_ids_B, [0, 0, 1, 1])


def test_builder_advantages_sum_to_zero_per_group():
    batch = build_rollout_batch(two_groups(), length_buckets=(8,), advantage="rloo")

    np.testing.assert_allclose(batch.advantages_B.reshape(2, 2).sum(-1), 0.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(batch.advantages_B, [1.0, -1.0, 0.5, -0.5], rtol=1e-6, atol=1e-6)


def test_builder_applies_the_overlong_penalty_on_generated_token_counts():
    batch = build_rollout_batch(two_groups(), length_buckets=(8,), overlong_buffer=2,
                                overlong_max_len=3)

    # generated tokens 3, 2, 2, 1 with the penalty ramp over (1, 3]
    np.testing.assert_allclose(batch.rewards_B, [1.0 - 1.0, 0.0 - 0.5, 0.5 - 0.5, 0.0],
                               rtol=1e-6, atol=1e-6)


def test_builder_rejects_lengths_over_the_largest_bucket_and_ragged_groups():
    with pytest.raises(ValueError, match="exceeds the largest length bucket 4"):
        build_rollout_batch(two_groups(), length_buckets=(4,))
    with pytest.raises(ValueError, match="same non-zero size"):
        build_rollout_batch([two_groups()[0], two_groups()[1][:1]], length_buckets=(8,))


def test_train_batch_is_target_aligned():
    batch = build_rollout_batch(two_groups(), length_buckets=(8,), advantage="drgrpo")

    tb = batch.to_train_batch()

    assert all(v.shape == (4, 8) for v in jax.tree.leaves(tb))
    np.testing.assert_array_equal(tb.targets[0], [2, 5, 6, 7, 0, 0, 0, 0])
    # position t is trained when token t+1 was generated: tokens 5, 6, 7 sit at 2, 3, 4
    np.testing.assert_array_equal(tb.loss_mask[0], [0, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(tb.versions[0], [-1, 3, 3, 4, -1, -1, -1, -1])
    np.testing.assert_allclose(tb.advantages[0], 0.5 * tb.loss_mask[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(tb.behaviour_logprobs[0], -0.5 * tb.loss_mask[0], rtol=0,
                               atol=0)


def test_rollout_batch_is_a_pytree_with_static_group_layout():
    batch = build_rollout_batch(two_groups(), length_buckets=(8,))

    leaves, treedef = jax.tree.flatten(batch)
    rebuilt = jax.tree.unflatten(treedef, leaves)

    assert len(leaves) == 9
    assert isinstance(rebuilt, RolloutBatch) and rebuilt.group_size == 2
