"""RewardPool: timeouts, errors and dead workers become counted zeros; weights compose."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from meshrl.configs.schema import RewardConfig
from meshrl.rewards import RewardPool

H = "meshrl.tests.rewards.helpers:"


def test_reward_that_sleeps_forever_scores_zero_within_the_timeout(make_pool):
    pool = make_pool([H + "sleep_forever"], timeout_s=0.5, num_workers=2)
    start = time.monotonic()
    rewards = pool.score(["p", "q"], ["a", "b"])
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 0.0]
    assert pool.counters["timeouts"] == 2 and pool.counters["errors"] == 0
    assert elapsed < 0.5 + 10.0  # 0.5 s per call in parallel + worker start-up
    assert pool.metrics()["reward/timeouts"] == 2.0


def test_hung_worker_is_replaced_and_later_calls_still_score(make_pool):
    pool = make_pool([H + "hangs_on_marker"], timeout_s=0.5, num_workers=1)
    assert pool.score(["p", "p", "p"], ["abc", "HANG", "hello"]) == [3.0, 0.0, 5.0]
    assert pool.counters["timeouts"] == 1 and pool.counters["worker_restarts"] == 1
    assert pool.score(["p"], ["four"]) == [4.0]


def _running(pid: int) -> bool:
    try:  # a zombie (state Z) whose parent died and was not reaped yet counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_process_a_reward_started_dies_with_its_worker_at_the_timeout(make_pool, tmp_path):
    pid_file = tmp_path / "pid"
    pool = make_pool([H + "starts_a_sleeper_and_hangs"], timeout_s=0.5, num_workers=1)

    assert pool.score(["p"], ["a"], pid_file=[str(pid_file)]) == [0.0]

    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


@pytest.mark.parametrize("name", ["always_raises", "returns_nan", "kills_worker",
                                  # float() would take these: not one number per completion
                                  "returns_a_string", "returns_a_bool",
                                  "returns_two_per_completion"])
def test_failing_reward_scores_zero_and_counts_an_error(make_pool, name: str):
    pool = make_pool([H + name], timeout_s=0.5, num_workers=1)
    assert pool.score(["p", "q"], ["a", "b"]) == [0.0, 0.0]
    assert pool.counters["errors"] == 2 and pool.counters["timeouts"] == 0


def test_weighted_composition_follows_reward_config(make_pool):
    config = RewardConfig(names=("math", "format"), weights=(1.0, 0.5), timeout_s=5.0,
                          num_workers=2)
    pool = RewardPool.from_config(config)
    try:
        completions = ["<think>2+2</think><answer>\\boxed{4}</answer>", "4", "<think>x</think>"
                       "<answer>5</answer>"]
        assert pool.score(["q"] * 3, completions, answer=["4"] * 3) == [1.5, 1.0, 0.5]
        components = pool.score_components(["q"], ["4"], answer=["4"])
        assert components == {"math": [1.0], "format": [0.0]}
    finally:
        pool.close()


def test_ascore_does_not_block_the_event_loop(make_pool):
    pool = make_pool([H + "sleep_forever"], timeout_s=0.5, num_workers=1)

    async def main() -> tuple[list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        rewards = await pool.ascore(["p"], ["a"])
        task.cancel()
        return rewards, ticks

    rewards, ticks = asyncio.run(main())
    assert rewards == [0.0] and ticks >= 5


def test_concurrent_calls_share_the_workers_and_are_scored_side_by_side(make_pool, tmp_path):
    # Each call holds one completion whose reward waits (in its worker) for the other call's:
    # scored one call after the other, the first would give up and score 0.
    pool = make_pool([H + "meets_the_others"], timeout_s=30.0, num_workers=2)
    fields = {"barrier_dir": [str(tmp_path / "barrier")], "parties": [2]}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(pool.score, ["p"], [c], **fields) for c in ("a", "b")]
        rewards = [f.result(timeout=60) for f in futures]
    assert rewards == [[1.0], [1.0]]
    assert pool.counters["calls"] == 2 and pool.counters["timeouts"] == 0


class _RefusingExecutor(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("ascore used a thread of the event loop's executor")


def test_concurrent_ascore_calls_are_scored_side_by_side_without_executor_threads(
        make_pool, tmp_path):
    # A thread per waiting call would cap the calls in flight at the executor's size; here
    # the executor refuses all work, and the two calls must still meet inside the workers.
    pool = make_pool([H + "meets_the_others"], timeout_s=30.0, num_workers=2)
    fields = {"barrier_dir": [str(tmp_path / "barrier")], "parties": [2]}

    async def main() -> list[list[float]]:
        asyncio.get_running_loop().set_default_executor(_RefusingExecutor(1))
        return list(await asyncio.gather(*(pool.ascore(["p"], [c], **fields)
                                           for c in ("a", "b"))))

    assert asyncio.run(main()) == [[1.0], [1.0]]
    assert pool.counters["calls"] == 2 and pool.counters["timeouts"] == 0


async def _running_ascore(pool: RewardPool, completion: str) -> asyncio.Future:
    """An ``ascore`` call, returned once a worker runs it."""
    call = asyncio.ensure_future(pool.ascore(["p"], [completion]))
    while not any(w.task is not None for w in pool._workers):
        await asyncio.sleep(0.01)
    return call


def test_close_fails_an_awaiting_ascore_call_instead_of_hanging_it(make_pool):
    pool = make_pool([H + "sleep_forever"], timeout_s=60.0, num_workers=1)

    async def main() -> None:
        call = await _running_ascore(pool, "a")
        pool.close()
        await asyncio.wait_for(call, timeout=30)

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(main())


def test_ascore_cancelled_before_its_loop_closed_leaves_the_pool_working(make_pool):
    pool = make_pool([H + "sleeps_then_scores"], timeout_s=30.0, num_workers=1)

    async def cancel_a_running_call() -> None:
        (await _running_ascore(pool, "abc")).cancel()

    asyncio.run(cancel_a_running_call())  # the loop is closed before the worker answers
    assert pool.score(["p"], ["four"]) == [4.0]
    assert pool.counters["calls"] == 2 and pool.counters["errors"] == 0


def test_close_fails_a_waiting_call_instead_of_hanging_it(make_pool):
    pool = make_pool([H + "sleep_forever"], timeout_s=60.0, num_workers=1)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        future = ex.submit(pool.score, ["p"], ["a"])
        while not any(w.task is not None for w in pool._workers):  # the call is running
            time.sleep(0.01)
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=30)
    with pytest.raises(RuntimeError, match="broken"):
        pool.score(["p"], ["a"])


def test_unknown_reward_or_mismatched_fields_fail_fast():
    with pytest.raises(KeyError, match="unknown reward 'maths'"):
        RewardPool(["maths"])
    with pytest.raises(ValueError, match="one weight each"):
        RewardPool(["math"], [1.0, 2.0])
    pool = RewardPool(["math"])
    with pytest.raises(ValueError, match="need 2 entries"):
        pool.score(["a", "b"], ["1", "2"], answer=["1"])
    pool.close()


def test_empty_batch_scores_nothing_without_starting_workers():
    pool = RewardPool(["math"])
    assert pool.score([], [], answer=[]) == [] and pool._workers == []
    assert asyncio.run(pool.ascore([], [], answer=[])) == [] and pool._workers == []
    pool.close()


def test_math_reward_bounds_symbolic_work_so_adversarial_powers_fail_fast():
    from meshrl.rewards import get

    start = time.monotonic()
    assert get("math")(["q"], ["\\boxed{(a+b+c+d)^{99}}"], answer=["x"]) == [0.0]
    assert time.monotonic() - start < 2.0
