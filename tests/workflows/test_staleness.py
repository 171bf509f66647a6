"""Staleness control: admission formula, consumption-time drops, restore without a burst, and
simulated async runs where the trainer advances the weight version as it consumes batches."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading

import pytest

from meshrl.datasets import DatasetError
from meshrl.tests.workflows.fakes import FakeEngine, FakeRewards, decode, prompts
from meshrl.workflows import (
    PromptsExhaustedError,
    RolloutRunner,
    StalenessController,
    Trajectory,
    group_episode_fn,
)


class RecordingController(StalenessController):
    """Checks the admission rule at every single admission."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.admissions: list[tuple[int, int, int]] = []  # (version, accepted, running) before

    def on_submit(self) -> None:
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        assert limit - (self.accepted + self.running) > 0, (self.version, self.accepted,
                                                            self.running)
        self.admissions.append((self.version, self.accepted, self.running))
        super().on_submit()
        assert self.accepted + self.running <= limit


def traj(versions: list[int]) -> Trajectory:
    n = len(versions)
    return Trajectory([1], list(range(n)), [0.0] * n, versions, [1] * n)


def test_capacity_follows_the_admission_formula():
    c = StalenessController(batch_size=4, max_staleness=2, version=3)

    assert c.capacity() == (2 + 3 + 1) * 4
    for _ in range(5):
        c.on_submit()
    c.on_accept()
    c.on_reject()

    assert (c.accepted, c.running, c.rejected) == (1, 3, 1)
    assert c.capacity() == 24 - (1 + 3)


def test_admission_over_capacity_raises():
    c = StalenessController(batch_size=1, max_staleness=0)
    c.on_submit()

    with pytest.raises(RuntimeError, match="over capacity"):
        c.on_submit()


def test_stale_group_is_dropped_counted_and_its_slot_returned():
    c = StalenessController(batch_size=2, max_staleness=1, version=5)
    c.on_submit(), c.on_submit()
    c.on_accept(), c.on_accept()
    fresh, stale = [traj([4, 5]), traj([5])], [traj([5, 5]), traj([3, 5])]

    kept = c.consume(fresh)
    dropped = not c.consume(stale)

    assert kept and dropped
    assert (c.consumed, c.dropped_stale, c.dropped_stale_samples, c.accepted) == (1, 1, 2, 1)
    assert c.staleness_hist == {1: 1, 0: 1}
    assert c.metrics()["rollout/dropped_stale"] == 1.0


def test_feedback_tokens_do_not_count_as_old_versions():
    t = Trajectory([1], [7, 8, 9], [0.0] * 3, [6, -1, 6], [1, 0, 1])

    assert t.oldest_version == 6


def test_version_cannot_go_backwards():
    c = StalenessController(batch_size=1, max_staleness=0, version=3)

    with pytest.raises(ValueError, match="backwards"):
        c.set_version(2)


def test_state_round_trip_restores_counters_without_a_capacity_burst():
    c = StalenessController(batch_size=2, max_staleness=1)
    for v in range(3):  # three steps: 2 groups consumed per step, one group rejected per step
        c.set_version(v)
        for _ in range(3):
            c.on_submit()
        c.on_accept(), c.on_accept(), c.on_reject()
        assert c.consume([traj([v])]) and c.consume([traj([v])])
    c.on_submit()  # one in flight at save time: lost on restart
    state = c.state_dict()

    restored = StalenessController(batch_size=2, max_staleness=1)
    restored.load_state_dict(state)
    restored.set_version(3)

    assert (restored.consumed, restored.rejected, restored.running) == (6, 3, 0)
    assert restored.staleness_hist == c.staleness_hist
    # A fresh controller at version 3 would admit (1 + 3 + 1) * 2 = 10 groups at once.
    assert restored.capacity() == (1 + 1) * 2


async def simulate(*, max_staleness: int, batch_size: int, steps: int, group_size: int = 2,
                   engine: FakeEngine | None = None, controller: StalenessController | None = None,
                   start_version: int = 0, train_s: float = 0.002):
    engine = engine or FakeEngine(tokens=3, jitter_seed=0)
    engine.version = start_version
    controller = controller or RecordingController(batch_size=batch_size,
                                                   max_staleness=max_staleness)
    counters: collections.Counter[str] = collections.Counter()
    group_fn = group_episode_fn(engine, group_size=group_size, filter_equal=False,
                                counters=counters, reward_pool=FakeRewards(), decode=decode)
    runner = RolloutRunner(group_fn, iter([prompts(10_000)]), controller)
    runner.start()
    consumed: list[tuple[int, list[list[Trajectory]]]] = []
    try:
        for v in range(start_version, start_version + steps):
            groups = await runner.get_batch(v)
            consumed.append((v, groups))
            await asyncio.sleep(train_s)  # the train step, during which rollouts continue
            engine.version = v + 1  # publish weights v + 1
    finally:
        await runner.stop()
    return consumed, controller, runner


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_run_never_trains_on_tokens_older_than_max_staleness(max_staleness):
    consumed, controller, _ = asyncio.run(simulate(max_staleness=max_staleness, batch_size=3,
                                                   steps=10))

    lags = [v - min(t.oldest_version for t in g) for v, groups in consumed for g in groups]
    assert all(len(groups) == 3 for _, groups in consumed)
    assert max(lags) <= max_staleness
    assert max(lags) >= 1, "the run should actually be asynchronous"
    assert controller.admissions, "admissions were recorded (and each checked the formula)"
    assert sum(controller.staleness_hist.values()) == 10 * 3 * 2


def test_max_staleness_zero_is_synchronous():
    consumed, controller, _ = asyncio.run(simulate(max_staleness=0, batch_size=2, steps=6))

    for v, groups in consumed:
        for g in groups:
            for t in g:
                assert set(t.versions) == {v}, (v, t.versions)
    assert controller.staleness_hist == {0: 6 * 2 * 2}
    assert controller.dropped_stale == 0


def test_slow_group_from_an_old_version_is_dropped_and_counted_not_trained_on():
    # Group 0 finishes its tokens at version 0 but replies only after several steps.
    engine = FakeEngine(tokens=2, tail_s=lambda r: 0.15 if r.id[0] == 0 else 0.0)

    consumed, controller, runner = asyncio.run(simulate(
        max_staleness=1, batch_size=1, steps=12, engine=engine, train_s=0.02))

    trained_ids = {t.group_id for _, groups in consumed for g in groups for t in g}
    assert 0 not in trained_ids
    assert controller.dropped_stale == 1 and controller.dropped_stale_samples == 2
    assert runner.metrics()["rollout/dropped_stale"] == 1.0


def test_waiting_groups_are_taken_oldest_token_first():
    # Groups finish in id order, but group 1 (a long tail started at version 1) is the one a
    # later version would drop: it goes first, then group 2 (version 2), then arrival order.
    oldest_by_id = {1: 1, 2: 2}

    async def main():
        async def group_fn(item, group_id):
            return [traj([oldest_by_id.get(group_id, 3)] * 2)]

        controller = StalenessController(batch_size=1, max_staleness=2, version=3)
        runner = RolloutRunner(group_fn, iter(prompts(50)), controller)
        runner.start()
        for _ in range(10_000):  # bounded: a broken runner fails the test, never hangs it
            if controller.accepted >= 4:
                break
            await asyncio.sleep(0)
        assert controller.accepted >= 4, controller.accepted
        batches = [await runner.get_batch(3) for _ in range(4)]
        await runner.stop()
        return batches

    batches = asyncio.run(main())

    assert [min(t.oldest_version for t in b[0]) for b in batches] == [1, 2, 3, 3]


def test_restored_runner_continues_without_over_admission():
    _, first, runner = asyncio.run(simulate(max_staleness=1, batch_size=2, steps=4))
    state = runner.state_dict()
    controller = RecordingController(batch_size=2, max_staleness=1)
    controller.load_state_dict(state["controller"])

    consumed, controller, _ = asyncio.run(simulate(max_staleness=1, batch_size=2, steps=3,
                                                   controller=controller, start_version=4))

    # The first admission after restore saw exactly the normal pipeline depth free.
    version, accepted, running = controller.admissions[0]
    assert (version, running) == (4, 0)
    assert (1 + version + 1) * 2 - accepted == (1 + 1) * 2
    assert controller.consumed == first.consumed + 3 * 2
    assert [v for v, _ in consumed] == [4, 5, 6]


def test_get_batch_raises_when_prompts_run_out_and_hands_the_partial_batch_back():
    async def main():
        controller = StalenessController(batch_size=2, max_staleness=0)
        engine = FakeEngine()
        fn = group_episode_fn(engine, group_size=2, filter_equal=False,
                              reward_pool=FakeRewards(), decode=decode)
        runner = RolloutRunner(fn, iter(prompts(3)), controller)
        runner.start()
        first = await runner.get_batch(0)
        engine.version = 1
        with pytest.raises(PromptsExhaustedError, match="1 of 2"):
            await runner.get_batch(1)
        await runner.stop()
        return first, controller, runner.rollout_state()

    first, controller, state = asyncio.run(main())

    assert len(first) == controller.consumed == 2  # the partial batch is not consumed
    assert sum(controller.staleness_hist.values()) == 4  # the trained samples only
    assert len(state["finished"]) == 1  # the untrained group stays in the rollout state


def test_a_group_dropped_as_stale_after_the_prompts_ran_out_is_generated_again():
    # Prompt 1's first try is a long tail with version-0 tokens that finishes only once the
    # runner has read past the last prompt; at version 2 it is stale and must be run again.
    read_past_end = threading.Event()
    version = 0

    def prompt_stream():
        yield from prompts(3)
        read_past_end.set()

    async def main():
        async def group_fn(item, group_id):
            if group_id == 1:
                for _ in range(2_000):  # bounded: a broken runner fails the test, never hangs
                    if read_past_end.is_set():
                        break
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.05)  # the runner takes the end of the prompts in first
                return [dataclasses.replace(traj([0, 0]), group_id=group_id, metadata=item)]
            return [dataclasses.replace(traj([version] * 2), group_id=group_id, metadata=item)]

        nonlocal version
        controller = StalenessController(batch_size=1, max_staleness=1)
        runner = RolloutRunner(group_fn, prompt_stream(), controller)
        runner.start()
        batches = []
        for v in range(3):
            version = v
            batches.append(await asyncio.wait_for(runner.get_batch(v), 10))
        version = 3
        with pytest.raises(PromptsExhaustedError, match="0 of 1"):
            await asyncio.wait_for(runner.get_batch(3), 10)
        await runner.stop()
        return batches, controller, runner

    batches, controller, runner = asyncio.run(main())

    assert read_past_end.is_set()
    assert [b[0][0].metadata["id"] for b in batches] == [0, 2, 1]
    assert [b[0][0].versions for b in batches] == [[0, 0], [1, 1], [2, 2]]
    assert controller.dropped_stale == 1
    assert runner.counters["requeued_stale_groups"] == 1


def test_get_batch_raises_a_user_error_of_the_prompt_iterator_unwrapped():
    def bad_prompts():
        yield from prompts(1)
        raise DatasetError("data.jsonl:2: prompt has 9 tokens > data.max_prompt_len = 8: fix")

    async def main():
        controller = StalenessController(batch_size=2, max_staleness=0)
        fn = group_episode_fn(FakeEngine(), group_size=2, filter_equal=False,
                              reward_pool=FakeRewards(), decode=decode)
        runner = RolloutRunner(fn, bad_prompts(), controller)
        runner.start()
        try:
            with pytest.raises(DatasetError, match="data.jsonl:2"):
                await runner.get_batch(0)
        finally:
            await runner.stop()

    asyncio.run(main())


def test_runner_does_not_block_the_event_loop():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        consumed, _, _ = await simulate(max_staleness=1, batch_size=2, steps=3)
        t.cancel()
        return ticks, consumed

    ticks, consumed = asyncio.run(main())
    assert len(consumed) == 3 and ticks > 3


def test_failed_group_is_counted_and_the_run_continues():
    async def main():
        calls = 0
        good = group_episode_fn(FakeEngine(), group_size=2, filter_equal=False,
                                reward_pool=FakeRewards(), decode=decode)

        async def flaky(item, group_id):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ValueError("boom")
            return await good(item, group_id)

        controller = StalenessController(batch_size=2, max_staleness=0)
        runner = RolloutRunner(flaky, iter(prompts(50)), controller)
        runner.start()
        batch = await runner.get_batch(0)
        await runner.stop()
        return batch, runner, controller

    batch, runner, controller = asyncio.run(main())
    assert len(batch) == 2
    assert runner.counters["errored_groups"] == 1 and controller.rejected >= 1


def test_runner_metrics_and_state_include_filtered_groups():
    async def main():
        counters: collections.Counter[str] = collections.Counter()
        # answer 'z': every reward is 0, so every other group is all-equal and filtered ...
        items = [p | {"answer": "z" if p["id"] % 2 else "k"} for p in prompts(40)]
        fn = group_episode_fn(FakeEngine(), group_size=2, filter_equal=True, counters=counters,
                              reward_pool=FakeRewards(), decode=decode)
        controller = StalenessController(batch_size=2, max_staleness=0)
        runner = RolloutRunner(fn, iter(items), controller, counters=counters)
        runner.start()
        batch = await runner.get_batch(0)
        await runner.stop()
        return batch, runner

    batch, runner = asyncio.run(main())

    assert all(len({t.reward for t in g}) == 2 for g in batch)
    assert runner.metrics()["rollout/filtered_equal_groups"] >= 1
    assert runner.state_dict()["counters"]["filtered_equal_groups"] >= 1
    assert runner.controller.rejected >= runner.counters["filtered_equal_groups"]


def test_a_batchs_episodes_all_reach_the_engine_in_one_event_loop_turn():
    # A sampler admits what was submitted when it wakes: requests spread over loop turns (one
    # worker-thread hop per prompt) made it start on the first group alone.
    class TurnEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.turn, self.turns = 0, []

        def tick(self) -> None:
            self.turn += 1
            asyncio.get_running_loop().call_soon(self.tick)

        async def agenerate(self, request):
            self.turns.append(self.turn)
            return await super().agenerate(request)

    async def main() -> list[int]:
        engine = TurnEngine()
        engine.tick()
        fn = group_episode_fn(engine, group_size=4, filter_equal=False,
                              reward_pool=FakeRewards(), decode=decode)
        runner = RolloutRunner(fn, iter(prompts(50)),
                               StalenessController(batch_size=8, max_staleness=0))
        runner.start()
        await runner.get_batch(0)
        await runner.stop()
        return engine.turns

    turns = asyncio.run(main())

    assert len(turns) == 32
    assert len(set(turns)) == 1, turns
