"""The ideal-scheduler estimate of benchmarks/cb_bound.py."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.benchmarks import cb_bound

CALL, ROW_STEP, ENTRY = 5e-3, 50e-6, 0.2e-6


def _call(rows: int, window: int) -> tuple:
    secs = CALL + rows * cb_bound.CHUNK * (ROW_STEP + window * ENTRY)
    return ("decode", rows, rows, rows, window, secs)


def test_fit_recovers_the_call_cost_model_and_ignores_prefill_calls():
    calls = [_call(r, w) for r in (4, 8, 16, 32) for w in (96, 256, 1024)]
    calls.append(("prefill", 0, 0, 0, 0, 9.0))

    coef, err = cb_bound.fit_call_cost(calls)

    np.testing.assert_allclose(coef, [CALL, ROW_STEP, ENTRY], rtol=1e-6)
    assert err < 1e-6


def test_ideal_prices_each_token_at_its_own_window_in_full_calls():
    coef = np.array([CALL, ROW_STEP, ENTRY])
    positions = [10, 200]
    window_for = {10: 64, 200: 256}.get

    got = cb_bound.ideal_seconds(positions, coef, window_for, prefill_s=0.5)

    per_token_call = CALL / (cb_bound.SLOTS * cb_bound.CHUNK)
    want = 2 * (per_token_call + ROW_STEP) + ENTRY * (64 + 256) + 0.5
    assert got == pytest.approx(want, rel=1e-12)


def test_fit_with_too_few_decode_calls_raises():
    with pytest.raises(RuntimeError, match="needs >= 3 decode calls, got 2"):
        cb_bound.fit_call_cost([_call(4, 96), _call(8, 96)])


def test_fifo_ideal_refills_a_freed_slot_and_pays_every_step_of_the_tail(monkeypatch):
    monkeypatch.setattr(cb_bound, "SLOTS", 2)
    coef = np.array([CALL, ROW_STEP, 0.0])
    # Two slots, requests of 1, 3 and 2 decode steps in arrival order: step 1 runs requests 0 and 1,
    # steps 2-3 requests 1 and 2 (2 refilled the step after 0 ended); 3 steps, 6 row-steps.
    got = cb_bound.fifo_ideal_seconds([1, 3, 2], coef, lambda p: 64, prefill_s=0.0)

    assert got == pytest.approx(3 * CALL / cb_bound.CHUNK + 6 * ROW_STEP, rel=1e-12)


def test_fifo_ideal_is_never_below_the_unconstrained_ideal():
    coef = np.array([CALL, ROW_STEP, ENTRY])
    steps = [3, 40, 7, 300, 12, 5, 90, 64] * 8
    positions = [cb_bound.PROMPT + k for n in steps for k in range(n)]
    window_for = lambda p: 64 * (p // 64 + 1)  # noqa: E731

    fifo = cb_bound.fifo_ideal_seconds(steps, coef, window_for, prefill_s=0.0)
    ideal = cb_bound.ideal_seconds(positions, coef, window_for, prefill_s=0.0)

    assert fifo >= ideal
