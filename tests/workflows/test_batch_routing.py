"""build_rl_batch with MoE routing replay: each generated token's recorded experts
(``Trajectory.routing``, ``[layers, k]``) land in the batch's ``routing`` at the position that
predicts the token (target-aligned like every field), -1 elsewhere, padded and packed alike; a
trajectory without them is refused; the episode records them (None on feedback) and the
rollout state saves and restores them."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from meshrl.workflows import Trajectory, build_rl_batch
from meshrl.workflows.rollout_state import decode_group, encode_group

SHAPE = (2, 3)  # (layers, k)


def _experts(token: int) -> np.ndarray:
    """Distinct ids per token, so a shift by one position shows."""
    return (np.arange(6, dtype=np.int32).reshape(SHAPE) + token) % 50


def _traj(prompt, completion, mask, group_id=0):
    n = len(completion)
    routing = [_experts(t) if m else None for t, m in zip(completion, mask)]
    return Trajectory(list(prompt), list(completion), [-0.5] * n, [0] * n, list(mask),
                      reward=float(group_id), group_id=group_id, routing=routing)


def _groups():
    return [[_traj([1, 2], [5, 6, 7], [1, 1, 1]), _traj([1, 2], [5, 8], [1, 1])],
            [_traj([3], [9, 40, 41, 10], [1, 0, 0, 1], 1), _traj([3], [11], [1], 1)]]


def test_routing_is_at_the_predicting_position_and_minus_one_elsewhere():
    batch = build_rl_batch(_groups(), length_buckets=(8,), routing=SHAPE)

    assert batch.routing.shape == (4, 8, *SHAPE) and batch.routing.dtype == np.int32
    # Row 2: prompt [3], completion [9, 40, 41, 10] with feedback 40, 41 (mask 0).
    for pos, token in ((0, 9), (3, 10)):
        np.testing.assert_array_equal(batch.routing[2, pos], _experts(token))
        assert batch.targets[2, pos] == token
    on = batch.loss_mask > 0
    assert np.all(batch.routing[~on] == -1)
    assert np.all(batch.routing[on] >= 0)


def test_packed_rows_carry_each_sequences_routing():
    padded = build_rl_batch(_groups(), length_buckets=(8,), routing=SHAPE)
    packed = build_rl_batch(_groups(), length_buckets=(8,), routing=SHAPE, rows=(2, 4))

    assert packed.routing.shape == (packed.rows, 8, *SHAPE)
    on = packed.loss_mask > 0
    by_target = {int(t): r.tolist() for t, r in zip(packed.targets[on], packed.routing[on])}
    assert by_target == {int(t): r.tolist() for t, r in
                         zip(padded.targets[padded.loss_mask > 0],
                             padded.routing[padded.loss_mask > 0])}
    assert np.all(packed.routing[~on] == -1)


def test_batch_without_replay_has_no_routing_field():
    batch = build_rl_batch(_groups(), length_buckets=(8,))

    assert batch.routing is None and "routing" not in batch.set_fields()


def test_a_trajectory_without_routing_is_refused_in_a_replay_batch():
    groups = _groups()
    groups[1][1] = dataclasses.replace(groups[1][1], routing=None)

    with pytest.raises(ValueError, match="1 trajectories .first: sample 3. have no recorded "
                                         "routing"):
        build_rl_batch(groups, length_buckets=(8,), routing=SHAPE)


def test_routing_of_another_length_is_rejected():
    with pytest.raises(ValueError, match="2 completion ids.*1 routing entries"):
        Trajectory([1], [5, 6], [0.0, 0.0], [0, 0], [1, 1], routing=[_experts(5)])


def test_rollout_state_round_trip_keeps_the_routing():
    group = _groups()[1]
    entry = json.loads(json.dumps(encode_group({"prompt_ids": [3]}, group)))

    _, restored = decode_group(entry)
    before = build_rl_batch([group], length_buckets=(8,), routing=SHAPE)
    after = build_rl_batch([restored], length_buckets=(8,), routing=SHAPE)
    np.testing.assert_array_equal(after.routing, before.routing)


class _RoutedEngine:
    """Two tokens per turn, each with its experts, as the sampler records them."""

    version = 0

    async def agenerate(self, request):
        from meshrl.inference.sampler import Completion
        return Completion(request, [11, 12], [-0.1, -0.2], [-0.3, -0.4], [0, 0], "length",
                          routing=[_experts(11), _experts(12)])


class _Env:
    async def astep(self, item, completion_text, turn):
        from meshrl.workflows.episode import EnvStep
        return EnvStep(feedback_ids=[70, 71], done=turn == 1, reward=1.0)


def test_episode_records_the_samplers_routing_with_none_on_feedback():
    from meshrl.workflows.episode import EpisodeSettings, arun_episode

    traj = asyncio.run(arun_episode(_RoutedEngine(), {"prompt_ids": [1, 2]}, reward_pool=None,
                                    decode=str, env=_Env(),
                                    settings=EpisodeSettings(max_turns=2)))

    assert traj.completion_ids == [11, 12, 70, 71, 11, 12]
    assert [r is None for r in traj.routing] == [False, False, True, True, False, False]
    np.testing.assert_array_equal(traj.routing[5], _experts(12))
