"""build_rl_batch with truncated sampling: each trajectory's per-token kept counts land in the
batch's ``kept`` target-aligned (0 off the loss mask), padded and packed alike; a trajectory
without them is refused, and an untruncated batch has no ``kept`` at all."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshrl.workflows import Trajectory, build_rl_batch


def _traj(prompt, completion, mask, kept, group_id=0):
    n = len(completion)
    return Trajectory(list(prompt), list(completion), [-0.5] * n, [0] * n, list(mask),
                      reward=float(group_id), group_id=group_id, kept=kept)


def _groups(kept_b=(5, 3)):
    return [[_traj([1, 2], [5, 6, 7], [1, 1, 1], [7, 4, 2]),
             _traj([1, 2], [5, 8], [1, 1], list(kept_b))],
            [_traj([3], [9, 90, 91, 9], [1, 0, 0, 1], [6, 0, 0, 1], 1),
             _traj([3], [9], [1], [96], 1)]]


def test_kept_counts_are_target_aligned_and_zero_off_the_loss_mask():
    batch = build_rl_batch(_groups(), length_buckets=(8,), kept=True)

    np.testing.assert_array_equal(batch.kept[0], [0, 7, 4, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.kept[2], [6, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.kept[3], [96, 0, 0, 0, 0, 0, 0, 0])
    assert batch.kept.dtype == np.int32
    assert np.all((batch.kept > 0) == (batch.loss_mask > 0))


def test_packed_rows_carry_each_sequences_kept_counts():
    padded = build_rl_batch(_groups(), length_buckets=(8,), kept=True)
    packed = build_rl_batch(_groups(), length_buckets=(8,), kept=True, rows=(2, 4))

    on = packed.loss_mask > 0
    assert sorted(packed.kept[on].tolist()) == sorted(padded.kept[padded.loss_mask > 0].tolist())
    assert np.all(packed.kept[~on] == 0)


def test_untruncated_batch_has_no_kept_field():
    batch = build_rl_batch(_groups(), length_buckets=(8,))

    assert batch.kept is None and "kept" not in batch.set_fields()


def test_a_trajectory_without_kept_counts_is_refused_in_a_truncated_batch():
    groups = _groups()
    groups[1][0] = dataclasses.replace(groups[1][0], kept=None)

    with pytest.raises(ValueError, match="1 trajectories .first: sample 2. have no kept counts"):
        build_rl_batch(groups, length_buckets=(8,), kept=True)


def test_kept_counts_of_another_length_are_rejected():
    with pytest.raises(ValueError, match="2 completion ids.*1 kept counts"):
        _traj([1], [5, 6], [1, 1], [3])


class _KeptEngine:
    """Two tokens per turn, each with its kept count, as the real sampler records them."""

    version = 0

    async def agenerate(self, request):
        from meshrl.inference.sampler import Completion
        return Completion(request, [11, 12], [-0.1, -0.2], [-0.3, -0.4], [0, 0], "length",
                          kept=[4, 9])


class _Env:
    async def astep(self, item, completion_text, turn):
        from meshrl.workflows.episode import EnvStep
        return EnvStep(feedback_ids=[70, 71, 72], done=turn == 1, reward=1.0)


def test_episode_records_the_samplers_kept_counts_with_zero_on_feedback():
    import asyncio

    from meshrl.workflows.episode import EpisodeSettings, arun_episode

    traj = asyncio.run(arun_episode(_KeptEngine(), {"prompt_ids": [1, 2]}, reward_pool=None,
                                    decode=str, env=_Env(),
                                    settings=EpisodeSettings(max_turns=2)))

    assert traj.completion_ids == [11, 12, 70, 71, 72, 11, 12]
    assert traj.kept == [4, 9, 0, 0, 0, 4, 9]
