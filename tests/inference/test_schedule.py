"""Planning a decode chunk's calls over cache windows (pure host-side arithmetic)."""

from __future__ import annotations

from meshrl.inference.schedule import (
    CPU_WEIGHTS_PASS,
    decode_shapes,
    plan_windows,
    split_cuts,
    weights_pass_cost,
)


def _window(pos: int) -> int:
    return pos  # one cache entry per position keeps the arithmetic readable


def test_cut_is_taken_only_when_saved_cache_reads_outweigh_one_more_call():
    # 4 long rows at 300, 28 rows at 100: the cut at 4 saves 28 x 200 x entry per step.
    positions = [300] * 4 + [100] * 28
    saved = 28 * 200 * 2

    split = plan_windows(positions, 32, (4,), _window, fixed_cost=saved - 1, entry_size=2)
    whole = plan_windows(positions, 32, (4,), _window, fixed_cost=saved, entry_size=2)

    assert split == [(0, 4, 300), (4, 28, 100)]
    assert whole == [(0, 32, 300)]


def test_three_position_levels_decode_as_three_ranges():
    positions = [500] * 4 + [300] * 12 + [64] * 16

    calls = plan_windows(positions, 32, (4, 16), _window, fixed_cost=1000, entry_size=1)

    assert calls == [(0, 4, 500), (4, 12, 300), (16, 16, 64)]


def test_sequences_at_one_position_never_split():
    # A static batch: every live row at the same position, some slots already free.
    for live in (5, 20, 32):
        calls = plan_windows([200] * live, 32, (4, 16), _window, fixed_cost=0, entry_size=1)
        assert calls == [(0, 32, 200)]


def test_free_slots_ride_with_the_last_range_and_no_cut_falls_among_them():
    # 10 live rows: the cut at 16 would leave [16, 32) without a live row to set its window.
    positions = [400] * 4 + [50] * 6

    calls = plan_windows(positions, 32, (4, 16), _window, fixed_cost=0, entry_size=1)

    assert calls == [(0, 4, 400), (4, 28, 50)]


def test_default_cut_is_after_the_smallest_row_bucket():
    assert split_cuts((4, 32), 32) == (4,)
    assert split_cuts((12, 24, 48, 96), 96) == (12,)
    assert split_cuts((32,), 32) == ()
    assert decode_shapes((4, 32), (4,), 32) == ((0, 4), (0, 32), (4, 28))


def test_shapes_cover_every_range_a_plan_can_choose():
    cuts = (4, 16)
    shapes = decode_shapes((4, 32), cuts, 32)

    assert shapes == ((0, 4), (0, 16), (0, 32), (4, 12), (4, 28), (16, 16))
    positions = [900, 700, 500, 400, 300, 200, 100] + [50] * 25
    for fixed in (0, 10, 10_000, 10**9):
        calls = plan_windows(positions, 32, cuts, _window, fixed_cost=fixed, entry_size=1)
        assert {(lo, rows) for lo, rows, _ in calls} <= set(shapes)
        assert sum(rows for _, rows, _ in calls) == 32


def test_weights_pass_costs_less_on_cpu_where_small_weights_stay_in_cache():
    assert weights_pass_cost(1_000_000, "gpu") == 1_000_000
    assert weights_pass_cost(1_000_000, "tpu") == 1_000_000
    assert weights_pass_cost(1_000_000, "cpu") == int(1_000_000 * CPU_WEIGHTS_PASS)
