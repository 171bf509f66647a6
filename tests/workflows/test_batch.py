"""build_rl_batch: padding to a bucket, target alignment, masks and versions, rewards and
advantages per sample, the one RLTrainBatch the trainer takes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.workflows import Trajectory, build_rl_batch


def traj(prompt, completion, mask, versions, reward, group_id=0):
    n = len(completion)
    return Trajectory(list(prompt), list(completion), [-0.5] * n, list(versions), list(mask),
                      reward=reward, group_id=group_id)


def two_groups() -> list[list[Trajectory]]:
    return [[traj([1, 2], [5, 6, 7], [1, 1, 1], [3, 3, 4], 1.0),
             traj([1, 2], [5, 8], [1, 1], [4, 4], 0.0)],
            [traj([3], [9, 90, 91, 9], [1, 0, 0, 1], [4, -1, -1, 4], 0.5, 1),
             traj([3], [9], [1], [4], 0.0, 1)]]


def test_builder_right_pads_to_the_smallest_fitting_bucket_target_aligned():
    batch = build_rl_batch(two_groups(), length_buckets=(4, 8, 16), pad_id=0)

    assert isinstance(batch, RLTrainBatch)
    assert all(v.shape == (4, 8) for v in batch.set_fields().values())
    np.testing.assert_array_equal(batch.input_ids[0], [1, 2, 5, 6, 7, 0, 0, 0])
    np.testing.assert_array_equal(batch.targets[0], [2, 5, 6, 7, 0, 0, 0, 0])
    # position t is trained when token t+1 was generated: tokens 5, 6, 7 sit at 2, 3, 4
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[2], [1, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.versions[0], [-1, 3, 3, 4, -1, -1, -1, -1])
    np.testing.assert_array_equal(batch.versions[2], [4, -1, -1, 4, -1, -1, -1, -1])
    np.testing.assert_allclose(batch.behaviour_logprobs[2], [-0.5, 0, 0, -0.5, 0, 0, 0, 0],
                               rtol=0, atol=0)
    np.testing.assert_array_equal(batch.segment_ids[1], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.positions[1], [0, 1, 2, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.sample_ids[1], [1, 1, 1, 1, -1, -1, -1, -1])


def test_builder_advantages_sum_to_zero_per_group_and_sit_on_the_loss_mask():
    batch = build_rl_batch(two_groups(), length_buckets=(8,), advantage="rloo")

    per_sample = np.asarray([batch.advantages[b][batch.loss_mask[b] > 0][0] for b in range(4)])
    np.testing.assert_allclose(per_sample, [1.0, -1.0, 0.5, -0.5], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(per_sample.reshape(2, 2).sum(-1), 0.0, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(batch.advantages[batch.loss_mask == 0], 0.0)


def test_rollout_metrics_report_the_pool_rewards_and_the_shaped_ones_beside_them():
    from meshrl.trainer.rl_loop import rollout_stats

    groups = two_groups()
    batch = build_rl_batch(groups, length_buckets=(8,), overlong_buffer=2, overlong_max_len=3)

    out = rollout_stats(batch, np.zeros(4), groups, shaped=True)

    assert out["rollout/reward_mean"] == pytest.approx(0.375, rel=0, abs=1e-12)  # 1, 0, .5, 0
    assert out["rollout/shaped_reward_mean"] == pytest.approx(-0.125, rel=0, abs=1e-6)
    assert "rollout/shaped_reward_mean" not in rollout_stats(batch, np.zeros(4), groups, False)


def test_builder_applies_the_overlong_penalty_on_generated_token_counts():
    batch = build_rl_batch(two_groups(), length_buckets=(8,), overlong_buffer=2,
                           overlong_max_len=3)

    # generated tokens 3, 2, 2, 1 with the penalty ramp over (1, 3]
    np.testing.assert_allclose(batch.sample_rewards(), [1.0 - 1.0, 0.0 - 0.5, 0.5 - 0.5, 0.0],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(batch.rewards[batch.sample_ids < 0], 0.0)


def test_builder_rejects_lengths_over_the_largest_bucket_and_ragged_groups():
    with pytest.raises(ValueError, match="trajectory length [0-9]+ exceeds the largest bucket 4; raise"):
        build_rl_batch(two_groups(), length_buckets=(4,))
    with pytest.raises(ValueError, match="same non-zero size"):
        build_rl_batch([two_groups()[0], two_groups()[1][:1]], length_buckets=(8,))


def test_rl_batch_is_a_pytree_of_its_set_fields():
    batch = build_rl_batch(two_groups(), length_buckets=(8,))

    leaves, treedef = jax.tree.flatten(batch)
    rebuilt = jax.tree.unflatten(treedef, leaves)

    assert len(leaves) == 10  # nine step fields and the rewards
    assert isinstance(rebuilt, RLTrainBatch) and rebuilt.ref_logprobs is None
