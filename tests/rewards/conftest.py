"""Fixtures shared by the reward tests."""

from __future__ import annotations

import pytest

from meshrl.rewards import RewardPool


@pytest.fixture
def make_pool():
    pools: list[RewardPool] = []

    def make(*args, **kwargs) -> RewardPool:
        pools.append(RewardPool(*args, **kwargs))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()
