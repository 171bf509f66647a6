"""Episodes: single-turn and multi-turn masks/versions/logprobs, rejection, group filtering."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from meshrl.tests.workflows.fakes import FakeEngine, FakeRewards, ScriptedEnv, decode, prompts
from meshrl.workflows import EpisodeSettings, arun_episode, arun_group


def run(coro):
    return asyncio.run(coro)


def test_single_turn_episode_masks_generated_tokens_and_records_versions():
    engine, rewards = FakeEngine(tokens=3), FakeRewards()
    engine.version = 4
    item = prompts(1)[0]

    traj = run(arun_episode(engine, item, reward_pool=rewards, decode=decode, group_id=7))

    assert traj.prompt_ids == [1, 2]
    assert traj.completion_ids == [10, 11, 12]
    assert traj.loss_mask == [1, 1, 1]
    assert traj.versions == [4, 4, 4]
    np.testing.assert_allclose(traj.logprobs, [-0.1, -0.2, -0.3], rtol=1e-6, atol=1e-6)
    assert (traj.reward, traj.group_id, traj.finish_reason) == (1.0, 7, "length")
    # Reward fields come from the example, minus the episode inputs.
    assert rewards.calls[0]["answer"] == ["k"] and "prompt_ids" not in rewards.calls[0]
    assert rewards.calls[0]["completions"] == [decode([10, 11, 12])]


def test_multi_turn_feedback_has_mask_zero_and_version_minus_one():
    engine, env = FakeEngine(tokens=2), ScriptedEnv(done_after=3, reward=2.0)
    item = prompts(1)[0]

    async def episode():
        task = asyncio.create_task(arun_episode(
            engine, item, reward_pool=FakeRewards(), decode=decode, env=env,
            settings=EpisodeSettings(max_turns=5)))
        while len(engine.requests) < 2:  # bump the weights between turns 1 and 2
            await asyncio.sleep(0)
        engine.version = 1
        return await task

    traj = run(episode())

    assert traj.completion_ids == [10, 11, 90, 91, 10, 11, 91, 92, 10, 11]
    assert traj.loss_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert traj.versions == [0, 0, -1, -1, 1, 1, -1, -1, 1, 1]
    assert traj.logprobs[2:4] == [0.0, 0.0]
    assert traj.reward == 2.0 and traj.oldest_version == 0
    # Each turn's request sees the whole context so far, feedback included.
    assert list(engine.requests[1].prompt_ids) == [1, 2, 10, 11, 90, 91]
    assert [t for _, t in env.seen] == [0, 1, 2]


def test_multi_turn_stops_at_max_turns_and_scores_with_the_pool_without_env_reward():
    engine, rewards = FakeEngine(tokens=1), FakeRewards()
    env = ScriptedEnv(done_after=99, reward=None)

    traj = run(arun_episode(engine, prompts(1)[0], reward_pool=rewards, decode=decode, env=env,
                            settings=EpisodeSettings(max_turns=2)))

    assert traj.loss_mask == [1, 0, 0, 1]
    # Only model text is scored, not the environment's feedback.
    assert rewards.calls[0]["completions"] == [decode([10, 10])]


def test_multi_turn_respects_the_total_length_budget():
    engine = FakeEngine(tokens=3)

    traj = run(arun_episode(engine, prompts(1)[0], reward_pool=FakeRewards(), decode=decode,
                            env=ScriptedEnv(done_after=99),
                            settings=EpisodeSettings(max_turns=10, max_total_len=9)))
    cut = run(arun_episode(FakeEngine(tokens=3), prompts(1)[0], reward_pool=FakeRewards(),
                           decode=decode, env=ScriptedEnv(done_after=99),
                           settings=EpisodeSettings(max_turns=10, max_total_len=7)))

    assert len(traj) == 9  # 2 prompt + 3 model + 2 feedback + 2 model (budget cut)
    assert traj.finish_reason == "length" and traj.loss_mask[-1] == 1
    # Feedback that would leave no room for a model token is not appended.
    assert cut.completion_ids == [10, 11, 12] and cut.finish_reason == "length"


def test_environment_reject_returns_none_and_the_group_counts_it():
    counters: collections.Counter[str] = collections.Counter()

    group = run(arun_group(FakeEngine(), prompts(1)[0], group_size=3, group_id=0,
                           counters=counters, reward_pool=FakeRewards(), decode=decode,
                           env=ScriptedEnv(done_after=1, reject=True)))

    assert group is None
    assert counters == {"rejected_groups": 1}


def test_a_failing_episode_cancels_its_groups_other_episodes_before_the_error_propagates():
    class Engine(FakeEngine):
        running = 0

        async def agenerate(self, request):
            if request.id[1] == 0:  # sample 0 of the group fails at once
                await asyncio.sleep(0.01)
                raise RuntimeError("episode 0 fails")
            Engine.running += 1
            try:
                return await super().agenerate(request)
            finally:
                Engine.running -= 1

    async def main():
        with pytest.raises(RuntimeError, match="episode 0 fails"):
            await arun_group(Engine(tokens=200, token_s=0.01), prompts(1)[0], group_size=4,
                             group_id=0, reward_pool=FakeRewards(), decode=decode)
        return Engine.running  # no sibling left generating, unowned

    assert run(main()) == 0


def test_group_with_distinct_rewards_is_kept_with_one_sample_index_each():
    counters: collections.Counter[str] = collections.Counter()

    group = run(arun_group(FakeEngine(), prompts(1, answer="k")[0], group_size=4, group_id=3,
                           counters=counters, reward_pool=FakeRewards(), decode=decode))

    assert [t.reward for t in group] == [1.0, 0.0, 0.0, 0.0]
    assert [t.metadata["sample_index"] for t in group] == [0, 1, 2, 3]
    assert {t.group_id for t in group} == {3}
    assert counters == {"accepted_groups": 1}


@pytest.mark.parametrize("filter_equal, expect_kept", [(True, False), (False, True)])
def test_dynamic_filtering_drops_groups_with_equal_rewards_and_counts_them(filter_equal,
                                                                          expect_kept):
    counters: collections.Counter[str] = collections.Counter()
    item = prompts(1, answer="z")[0]  # no sample starts with 'z': every reward is 0

    group = run(arun_group(FakeEngine(), item, group_size=4, group_id=0, counters=counters,
                           filter_equal=filter_equal, reward_pool=FakeRewards(), decode=decode))

    assert (group is not None) == expect_kept
    assert counters["filtered_equal_groups"] == (0 if expect_kept else 1)
