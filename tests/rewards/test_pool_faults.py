"""RewardPool under faults: worker limits, the queue deadline, a pool that cannot start, and pool
constants against data columns. Every case runs real worker processes."""

from __future__ import annotations

import os
import time

import pytest

from meshrl.configs.schema import RewardConfig
from meshrl.rewards import RewardPool, RewardPoolError
from meshrl.rewards.worker import CPU_SECONDS_PER_TIMEOUT_SECOND

H = "meshrl.tests.rewards.helpers:"


def test_reward_allocating_past_the_worker_memory_limit_scores_a_counted_zero_and_pool_lives(
        make_pool):
    pool = make_pool([H + "allocates"], timeout_s=30.0, num_workers=1, memory_mb=512)
    assert pool.score(["p"], ["a"], mib=[1024]) == [0.0]
    assert pool.counters["errors"] == 1
    # The same worker goes on scoring, within the limit it was given.
    assert pool.score(["p"], ["a"], mib=[16]) == [1.0]
    assert pool.counters["worker_restarts"] == 0


def test_workers_run_under_the_configured_address_space_and_per_pair_cpu_limits(make_pool):
    pool = make_pool([H + "address_space_limit_mib", H + "cpu_seconds_left"], [1.0, 0.0],
                     timeout_s=2.0, num_workers=1, memory_mb=768)
    components = pool.score_components(["p"], ["a"])
    assert components[H + "address_space_limit_mib"] == [768.0]
    left = components[H + "cpu_seconds_left"][0]
    assert 0.0 < left <= CPU_SECONDS_PER_TIMEOUT_SECOND * 2.0 + 2.0, left


def test_pairs_queued_past_the_deadline_score_counted_zeros_instead_of_waiting_their_turn(
        make_pool):
    pool = make_pool([H + "hangs_on_marker"], timeout_s=2.0, num_workers=1, deadline_s=1.0)
    assert pool.score(["p"], ["abc"]) == [3.0]  # the worker is up: the deadline clock runs
    start = time.monotonic()
    rewards = pool.score(["p"] * 5, ["HANG"] * 5)
    elapsed = time.monotonic() - start
    # One pair runs into its 2 s timeout; the four queued behind it expire at 1 s instead of
    # taking 2 s each in turn (10 s in all).
    assert rewards == [0.0] * 5
    assert pool.counters["timeouts"] == 1 and pool.counters["deadline_zeros"] == 4
    assert elapsed < 6.0, elapsed
    assert pool.metrics()["reward/deadline_zeros"] == 4.0


def test_reward_config_sets_the_deadline_and_worker_memory_of_the_pool():
    config = RewardConfig(names=("math",), deadline_s=7.5, worker_memory_mb=1024)
    pool = RewardPool.from_config(config)
    try:
        assert pool.deadline_s == 7.5 and pool._worker_args[1] == 1024
    finally:
        pool.close()


def test_worker_dead_at_start_up_fails_every_call_with_one_clear_error_within_seconds(make_pool):
    pool = make_pool(["meshrl.tests.rewards.dies_in_worker:reward"], num_workers=2)
    start = time.monotonic()
    with pytest.raises(RewardPoolError, match="exited during start-up"):
        pool.score(["p"], ["a"])
    assert time.monotonic() - start < 30.0
    with pytest.raises(RewardPoolError, match="broken"):
        pool.score(["p"], ["a"])


def test_worker_not_ready_within_the_start_up_timeout_fails_the_pool(make_pool):
    pool = make_pool(["meshrl.tests.rewards.slow_in_worker:reward"], num_workers=1,
                     startup_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(RewardPoolError, match="not ready 1s after it started"):
        pool.score(["p"], ["a"])
    assert time.monotonic() - start < 30.0


def test_a_replacement_worker_that_dies_before_it_is_ready_is_started_again(make_pool):
    from meshrl.tests.rewards import dies_at_start_on_marker as once

    pool = make_pool(["meshrl.tests.rewards.dies_at_start_on_marker:reward"], num_workers=1,
                     timeout_s=5.0)
    assert pool.score(["p"], ["ab"]) == [2.0]
    open(once.MARKER, "w").close()  # the next worker started dies at import
    try:
        assert pool.score(["p"], ["KILL"]) == [0.0]  # its worker dies and is replaced

        assert pool.score(["p"], ["abc"]) == [3.0]  # that one died too; its successor scores
    finally:
        if os.path.exists(once.MARKER):
            os.remove(once.MARKER)
    assert pool.counters["worker_restarts"] == 2


def test_replacement_workers_dying_before_ready_again_and_again_fail_the_pool(make_pool):
    from meshrl.rewards.pool import MAX_START_FAILURES
    from meshrl.tests.rewards import dies_at_start_on_marker as every

    pool = make_pool(["meshrl.tests.rewards.dies_at_start_on_marker:reward"], num_workers=1,
                     timeout_s=5.0)
    assert pool.score(["p"], ["ab"]) == [2.0]
    open(every.ALWAYS, "w").close()
    try:
        assert pool.score(["p"], ["KILL"]) == [0.0]
        with pytest.raises(RewardPoolError, match="a worker exited during start-up"):
            pool.score(["p"], ["abc"])
    finally:
        os.remove(every.ALWAYS)
    assert pool.counters["worker_restarts"] == 1 + MAX_START_FAILURES


def test_pool_constant_wins_over_a_data_column_of_the_same_name(make_pool):
    # A column "format_template" of "..." would accept any text; the pool's template must win.
    pool = make_pool(["format"], timeout_s=10.0, num_workers=1,
                     constants={"format_template": "<think>...</think><answer>...</answer>"})
    assert pool.score(["p"], ["no tags at all"], format_template=["..."]) == [0.0]
    assert pool.score(["p"], ["<think>a</think><answer>b</answer>"],
                      format_template=["..."]) == [1.0]
