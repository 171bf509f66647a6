"""The rollout runner stops, with one clear error, on a cause that fails every group (a broken
reward pool, any error in every episode) instead of dropping groups until the watchdog fires."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from meshrl.rewards import RewardPool, RewardPoolError
from meshrl.tests.workflows.fakes import FakeEngine, FakeRewards, decode, prompts
from meshrl.utils.errors import UserError
from meshrl.workflows import (
    RolloutFailedError,
    RolloutRunner,
    StalenessController,
    group_episode_fn,
)


async def _first_batch(group_fn, max_failed_groups: int, timeout_s: float = 30.0):
    runner = RolloutRunner(group_fn, itertools.cycle(prompts(8)),
                           StalenessController(batch_size=2, max_staleness=1),
                           max_failed_groups=max_failed_groups)
    runner.start()
    try:
        return await asyncio.wait_for(runner.get_batch(0), timeout=timeout_s), runner
    finally:
        await runner.stop()


def test_every_group_failing_stops_the_runner_after_max_failed_groups_naming_the_error():
    async def broken(item, group_id):
        await asyncio.sleep(0)
        raise ValueError("the verifier is misconfigured")

    start = time.monotonic()
    with pytest.raises(RolloutFailedError) as info:
        asyncio.run(_first_batch(broken, max_failed_groups=5))
    assert time.monotonic() - start < 10.0
    message = str(info.value)
    assert "5 groups in a row failed" in message and "rollout.max_failed_groups = 5" in message
    assert "ValueError: the verifier is misconfigured" in message
    assert isinstance(info.value, UserError)  # main.py prints it as one line


def test_failures_between_successes_never_reach_the_bound():
    good = group_episode_fn(FakeEngine(), group_size=2, filter_equal=False,
                            reward_pool=FakeRewards(), decode=decode)
    calls = itertools.count()

    async def every_other(item, group_id):
        if next(calls) % 2 == 0:
            raise ValueError("flaky")
        return await good(item, group_id)

    # Failures return at once and successes later, so failures come in runs of up to the
    # runner's capacity ((1 + 1) x 2 groups here): the bound sits well above that.
    batch, runner = asyncio.run(_first_batch(every_other, max_failed_groups=20))
    assert len(batch) == 2 and runner.counters["errored_groups"] >= 2


def test_broken_reward_pool_stops_the_runner_at_once_with_the_pools_error():
    pool = RewardPool(["meshrl.tests.rewards.dies_in_worker:reward"], num_workers=1)
    try:
        group_fn = group_episode_fn(FakeEngine(), group_size=2, filter_equal=False,
                                    reward_pool=pool, decode=decode)
        start = time.monotonic()
        # The bound is out of reach: only the pool's own error can stop the runner this early.
        with pytest.raises(RewardPoolError, match="exited during start-up"):
            asyncio.run(_first_batch(group_fn, max_failed_groups=10_000))
        assert time.monotonic() - start < 30.0
    finally:
        pool.close()



class _DyingSampler:
    """A sampler whose decode step fails, as on a device out of memory."""

    version = 0

    def __init__(self) -> None:
        self.queue: list = []

    def validate(self, request) -> None:
        pass

    def submit(self, request) -> None:
        self.queue.append(request)

    def withdraw(self, request_id) -> bool:
        return False

    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 12.5GiB")


def test_a_failed_sampler_stops_the_runner_at_once_naming_its_cause(caplog):
    from meshrl.inference import AsyncSampler, SamplerFailedError

    engine = AsyncSampler(_DyingSampler())
    try:
        group_fn = group_episode_fn(engine, group_size=2, filter_equal=False,
                                    reward_pool=FakeRewards(), decode=decode)
        # The bound is out of reach: only the sampler's own failure can stop the runner.
        with pytest.raises(SamplerFailedError, match="decode loop failed: RuntimeError: "
                                                     "RESOURCE_EXHAUSTED"):
            asyncio.run(_first_batch(group_fn, max_failed_groups=10_000))
    finally:
        engine.shutdown()
    # One traceback (the sampler's), not one per failed group.
    assert sum(r.exc_info is not None for r in caplog.records) == 1
