"""A reward that scores every sample alike stops the rollout with one line naming its answer
format; the trainer's wait logs what the rollout is doing; the step's all-groups figures."""

from __future__ import annotations

import asyncio
import collections
import itertools

import pytest

from meshrl.tests.workflows.fakes import FakeEngine, FakeRewards, decode, prompts
from meshrl.trainer.report import rl_step_line
from meshrl.utils.errors import UserError
from meshrl.workflows import RolloutRunner, StalenessController, group_episode_fn
from meshrl.workflows import runner as runner_lib
from meshrl.workflows.watch import RewardStallError, RolloutWatch, window_metrics


def _runner(*, answer: str, filter_equal: bool, max_in_a_row: int, token_s: float = 0.0005,
            status_every_s: float = 30.0) -> RolloutRunner:
    watch = RolloutWatch(reward_names=["gsm8k"], filter_equal=filter_equal, group_size=2,
                         max_in_a_row=max_in_a_row)
    counters: collections.Counter[str] = collections.Counter()
    group_fn = group_episode_fn(FakeEngine(token_s=token_s), group_size=2,
                                filter_equal=filter_equal, watch=watch, counters=counters,
                                reward_pool=FakeRewards(), decode=decode)
    return RolloutRunner(group_fn, itertools.cycle(prompts(8, answer)),
                         StalenessController(batch_size=2, max_staleness=8), watch=watch,
                         counters=counters,
                         status_every_s=status_every_s)


async def _batches(runner: RolloutRunner, n: int) -> list[list]:
    runner.start()
    try:
        return [await asyncio.wait_for(runner.get_batch(v), timeout=30.0) for v in range(n)]
    finally:
        await runner.stop()


def test_all_equal_groups_filtered_stop_after_max_in_a_row_naming_format_and_setting():
    runner = _runner(answer="z", filter_equal=True, max_in_a_row=20)  # every reward 0

    with pytest.raises(RewardStallError) as info:
        asyncio.run(_batches(runner, 1))

    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert "20 groups in a row had every sample scored alike (rewards 0)" in message
    assert "reward 'gsm8k' expects '#### N'" in message
    assert "rollout.filter_equal_groups=false" in message
    assert "rollout.max_filtered_in_a_row = 20" in message
    assert runner.counters["filtered_equal_groups"] >= 20
    assert runner.counters["accepted_groups"] == 0


def test_one_reward_value_for_the_first_groups_stops_with_filtering_off():
    runner = _runner(answer="z", filter_equal=False, max_in_a_row=6)

    with pytest.raises(RewardStallError, match="the first 6 scored groups all got reward 0"):
        asyncio.run(_batches(runner, 10))
    assert runner.watch.scored >= 6 and runner.counters["accepted_groups"] >= 6


def test_mixed_rewards_never_stop_and_zero_disables_the_stop():
    mixed = _runner(answer="k", filter_equal=True, max_in_a_row=3)  # sample 0 right, 1 wrong
    unbounded = _runner(answer="z", filter_equal=False, max_in_a_row=0)

    assert [len(b) for b in asyncio.run(_batches(mixed, 3))] == [2, 2, 2]
    assert [len(b) for b in asyncio.run(_batches(unbounded, 5))] == [2] * 5
    assert unbounded.watch.error is None and mixed.watch.error is None


def test_waiting_for_a_batch_logs_filtered_kept_and_in_flight(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(runner_lib.log, "info", lambda msg, *a: lines.append(msg % a))
    # Slow completions: the trainer waits several status intervals for its batch.
    runner = _runner(answer="k", filter_equal=True, max_in_a_row=0, token_s=0.05,
                     status_every_s=0.03)

    asyncio.run(_batches(runner, 1))

    waiting = [line for line in lines if line.startswith("rollout: waiting")]
    assert waiting, lines
    assert "for the batch of version 1" in waiting[0]
    assert "/2 groups ready" in waiting[0] and "in flight" in waiting[0]
    assert "kept" in waiting[0] and "filtered (every sample scored alike)" in waiting[0]


def test_step_line_shows_all_groups_mean_reward_and_kept_fraction():
    watch = RolloutWatch(reward_names=["gsm8k"], filter_equal=True, group_size=2,
                         max_in_a_row=0)
    for rewards, kept in (([1.0, 0.0], True), ([0.0, 0.0], False), ([0.0, 0.0], False),
                          ([1.0, 1.0], False)):
        watch.on_scored(rewards, kept)

    metrics = window_metrics(watch.take_window())
    line = rl_step_line(1, 10, {"rollout/reward_mean": 0.5, **metrics}, "00:10")

    assert metrics["rollout/reward_mean_all"] == pytest.approx(3 / 8, rel=0, abs=1e-12)
    assert metrics["rollout/kept_fraction"] == pytest.approx(0.25, rel=0, abs=1e-12)
    assert "reward 0.500 (all 4 groups 0.375, kept 0.250)" in line
    assert window_metrics(watch.take_window()) == {}  # a new window starts empty
