"""Planning a decode chunk's calls over cache windows (pure host-side arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import SamplerConfig
from meshrl.inference import schedule
from meshrl.inference.schedule import (
    CallCosts,
    call_costs,
    fit_call_costs,
    measure_call_costs,
    measure_shapes,
    measure_windows,
    plan_calls,
)


def _window(pos: int) -> int:
    return pos  # one cache entry per position keeps the arithmetic readable


BUCKETS = (4, 8, 16, 32)


def test_cut_is_taken_only_when_saved_cache_reads_outweigh_one_more_call():
    # 4 long rows at 300, 28 at 100: one call on every slot reads 32 x 300 entries a step; cut
    # at 16 (the 4 long ones and 12 short ones, then 16 short ones) it reads 16 x 300 + 16 x 100.
    positions = [300] * 4 + [100] * 28
    saved = (32 * 300 - (16 * 300 + 16 * 100)) * 2

    split = plan_calls(positions, BUCKETS, _window, CallCosts(saved - 1, 0), entry_size=2)
    whole = plan_calls(positions, BUCKETS, _window, CallCosts(saved, 0), entry_size=2)

    assert split == [(0, 16, 16, 300), (16, 32, 16, 100)]
    assert whole == [(0, 32, 32, 300)]


def test_padding_rows_a_cut_adds_are_priced_by_the_row_cost():
    # 4 long rows at 300, 10 short at 100, 1,000 a call. Cut after the long ones, the short
    # ones pad to 16 rows: 1,200 + 1,600 entries on 20 rows. Cut after 8, the long ones take 4
    # short ones along: 2,400 + 800 entries on 16 rows. 400 entries buy 4 padding rows.
    positions = [300] * 4 + [100] * 10

    cheap_rows = plan_calls(positions, BUCKETS, _window, CallCosts(1000, 99), entry_size=1)
    dear_rows = plan_calls(positions, BUCKETS, _window, CallCosts(1000, 101), entry_size=1)

    assert cheap_rows == [(0, 4, 4, 300), (4, 14, 16, 100)]
    assert dear_rows == [(0, 8, 8, 300), (8, 14, 8, 100)]


def test_position_levels_decode_as_ranges_over_their_own_windows():
    positions = [500] * 4 + [300] * 12 + [64] * 16

    calls = plan_calls(positions, BUCKETS, _window, CallCosts(100, 0), entry_size=1)

    # [4, 16) as 4 + 8 rows reads 1,200 fewer entries than one 16-row call: worth a call.
    assert calls == [(0, 4, 4, 500), (4, 8, 4, 300), (8, 16, 8, 300), (16, 32, 16, 64)]


def test_one_call_runs_on_the_smallest_bucket_holding_the_live_rows():
    for live, rows in ((3, 4), (5, 8), (20, 32), (32, 32)):
        calls = plan_calls([200] * live, BUCKETS, _window, None, entry_size=1)
        assert calls == [(0, live, rows, 200)]


def test_a_range_short_of_the_whole_ranking_never_takes_every_slot():
    # 10 live: 4 long ones alone, the other 6 padded to 8 rows (not 32 with the free slots).
    positions = [400] * 4 + [50] * 6

    calls = plan_calls(positions, BUCKETS, _window, CallCosts(0, 0), entry_size=1)

    assert calls == [(0, 4, 4, 400), (4, 10, 8, 50)]


def test_calls_partition_the_ranking_on_row_buckets_at_any_call_cost():
    rng = np.random.default_rng(0)
    for _ in range(20):
        positions = sorted(rng.integers(1, 1000, rng.integers(1, 33)).tolist(), reverse=True)
        for costs in (CallCosts(0, 0), CallCosts(10, 5), CallCosts(10_000, 0), CallCosts(10**9, 0),
                      CallCosts(0, 10**6)):
            calls = plan_calls(positions, BUCKETS, _window, costs, entry_size=1)
            assert [lo for lo, *_ in calls] == [0] + [hi for _, hi, *_ in calls[:-1]]
            assert calls[-1][1] == len(positions)
            for lo, hi, rows, window in calls:
                assert rows in BUCKETS and hi - lo <= rows and window == positions[lo]
                assert rows < 32 or (lo, hi) == (0, len(positions))


def _never() -> CallCosts:
    raise AssertionError("measured although the costs need no measurement")


def test_configured_costs_are_used_without_measuring():
    cfg = SamplerConfig(decode_call_costs=(1e6, 2e5))

    assert call_costs(cfg, 1000, True, "configured", _never) == CallCosts(1e6, 2e5)


def test_deprecated_weights_pass_share_prices_a_call_at_that_share_of_the_weights(caplog):
    cfg = SamplerConfig(decode_split_weights_pass=0.25)

    costs = call_costs(cfg, 1_000_000, True, "deprecated", _never)

    assert costs == CallCosts(250_000, 0)
    assert "decode_split_weights_pass is deprecated" in caplog.text
    assert "decode_call_costs = (250000, 0)" in caplog.text


def test_sampler_that_may_not_measure_and_has_no_configured_costs_never_splits():
    assert call_costs(SamplerConfig(), 1000, False, "spans-processes", _never) is None


def test_costs_are_measured_once_per_process_for_each_sampler_shape(monkeypatch):
    monkeypatch.setattr(schedule, "_measured", {})
    calls = []

    def measure() -> CallCosts:
        calls.append(1)
        return CallCosts(5.0, 1.0)

    costs = [call_costs(SamplerConfig(), 1000, True, key, measure) for key in ("a", "a", "b")]

    assert costs == [CallCosts(5.0, 1.0)] * 3
    assert len(calls) == 2


def test_timed_windows_are_the_shortest_and_the_longest_within_the_span():
    assert measure_windows((32, 48, 64, 96, 128, 192, 256, 384, 512)) == (32, 256)
    assert measure_windows((32, 48, 64)) == (32, 64)
    assert measure_windows((16,)) == (16, 16)


def test_timed_shapes_are_every_row_over_both_windows_and_the_fewest_rows_over_the_longer():
    shapes = measure_shapes((4, 8, 16, 32), (32, 48, 64, 96, 128, 192, 256, 384))

    assert shapes == ((32, 32), (32, 256), (4, 256))


def _seconds(call: float, row: float, entry: float, shapes) -> dict:
    return {(r, w): call + r * (row + w * entry) for r, w in shapes}


def test_fit_recovers_the_call_and_row_costs_in_cache_elements():
    shapes = measure_shapes((4, 32), (32, 256))
    # 2 ms a call, 50 us a row, 0.2 us an entry of 1,000 elements: 0.2 ns an element.
    costs = fit_call_costs(_seconds(2e-3, 5e-5, 2e-7, shapes), entry_size=1000)

    assert costs.call == pytest.approx(1e7) and costs.row == pytest.approx(2.5e5)


def test_longer_window_that_costs_nothing_more_means_no_cut_can_pay():
    shapes = measure_shapes((4, 32), (32, 256))

    assert fit_call_costs(_seconds(2e-3, 5e-5, 0.0, shapes), entry_size=1000) is None
    assert fit_call_costs(_seconds(2e-3, 5e-5, -1e-9, shapes), entry_size=1000) is None


def test_negative_parts_from_timing_noise_count_as_zero():
    shapes = ((32, 32), (32, 256), (4, 256))
    # The fewest rows timed slower than every row: the row part fits negative; and a call
    # part below zero.
    noisy = {(32, 32): 1e-3, (32, 256): 1e-3 + 32 * 224 * 1e-7, (4, 256): 2e-3}

    costs = fit_call_costs(noisy, entry_size=1)

    assert costs.row == 0 and costs.call > 0
    below = fit_call_costs(_seconds(-1e-3, 5e-5, 2e-7, shapes), entry_size=1)
    assert below.call == 0 and below.row > 0


def test_shapes_with_nothing_to_difference_are_not_timed():
    assert measure_call_costs(_never, ((32, 32), (32, 32), (4, 32)), 1) is None
    assert measure_call_costs(_never, ((4, 32), (4, 256), (4, 256)), 1) is None


def test_measured_costs_are_finite_non_negative_and_each_shape_runs_reps_plus_one_times():
    # A stand-in decode whose cost grows with rows and window: attention over a cache.
    cache_BxTxD = jnp.ones((32, 2048, 64), jnp.float32)
    attend = jax.jit(lambda r, w: jax.nn.softmax(
        jnp.einsum("bd,btd->bt", cache_BxTxD[:r, 0], cache_BxTxD[:r, :w]), -1),
        static_argnums=(0, 1))
    shapes: list[tuple[int, int]] = []

    def decode_at(rows: int, window: int) -> jax.Array:
        shapes.append((rows, window))
        return attend(rows, window)

    costs = measure_call_costs(decode_at, ((32, 256), (32, 2048), (4, 2048)), 64, reps=3)

    # Its cost is bounded by calls, not by a clock: one compiling run and ``reps`` timed runs
    # per shape.
    assert sorted(shapes) == [(4, 2048)] * 4 + [(32, 256)] * 4 + [(32, 2048)] * 4
    if costs is not None:  # None: the longer window timed no slower (a loaded machine)
        assert 0 <= costs.call < float("inf") and 0 <= costs.row < float("inf")


@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan")])
def test_weights_pass_share_outside_zero_and_finite_is_rejected(value):
    with pytest.raises(ValueError, match="sampler.decode_split_weights_pass"):
        SamplerConfig(decode_split_weights_pass=value)


@pytest.mark.parametrize("value", [(1.0,), (1.0, 2.0, 3.0), (-1.0, 0.0), (1.0, float("inf")),
                                   (float("nan"), 0.0)])
def test_call_costs_other_than_two_finite_non_negative_numbers_are_rejected(value):
    with pytest.raises(ValueError, match=r"sampler.decode_call_costs = .*: must be \(\)"):
        SamplerConfig(decode_call_costs=value)


def test_the_deprecated_weights_pass_beside_decode_call_costs_is_refused():
    with pytest.raises(ValueError, match=r"decode_split_weights_pass = 0.25: deprecated, and "
                                         r"sampler.decode_call_costs = \(1.0, 2.0\) is set"):
        SamplerConfig(decode_split_weights_pass=0.25, decode_call_costs=(1.0, 2.0))
