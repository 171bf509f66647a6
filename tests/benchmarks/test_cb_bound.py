"""The ideal-scheduler estimate of benchmarks/cb_bound.py."""

from __future__ import annotations

import pytest

from meshrl.benchmarks import cb_bound


def test_ideal_seconds_prices_useful_tokens_at_the_all_live_call_cost():
    S, C = cb_bound.SLOTS, cb_bound.CHUNK
    calls = [("prefill", 0, 0, 0, 0.1),
             ("decode", S, S, S, 1e-4 * S * C),        # all live: 1e-4 s a row-step
             ("decode", S, S - 1, S - 1, 0.5),         # a slot idle: not an all-live call
             ("decode", S // 2, S // 2, S, 0.3),       # half of a split chunk
             ("decode", 4, 2, 2, 0.02)]                # a drain chunk

    ideal, per_row_step, drain = cb_bound.ideal_seconds(1000, calls)

    assert per_row_step == pytest.approx(1e-4, rel=1e-9)
    assert ideal == pytest.approx(1000 * 1e-4 + 0.1, rel=1e-9)
    assert drain == pytest.approx(0.02, rel=1e-9)


def test_ideal_seconds_without_an_all_live_call_raises():
    with pytest.raises(RuntimeError, match="no decode call with every slot live"):
        cb_bound.ideal_seconds(10, [("decode", cb_bound.SLOTS, 3, 3, 0.1)])
