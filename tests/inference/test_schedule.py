"""Planning a decode chunk's calls over cache windows (pure host-side arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from meshrl.configs.schema import SamplerConfig
from meshrl.inference import schedule
from meshrl.inference.schedule import (
    SHARE_RANGE,
    decode_shapes,
    measure_weights_pass,
    measure_windows,
    plan_windows,
    split_cuts,
    weights_pass_cost,
    weights_pass_share,
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


def _never() -> float:
    raise AssertionError("measured although the share needs no measurement")


def test_configured_share_prices_the_weights_pass_without_measuring():
    cfg = SamplerConfig(decode_split_weights_pass=0.25)

    share = weights_pass_share(cfg, "cpu", True, "configured", _never)

    assert share == 0.25
    assert weights_pass_cost(1_000_000, share) == 250_000


def test_accelerator_or_sampler_that_never_splits_prices_a_pass_as_one_without_measuring():
    cfg = SamplerConfig()

    assert weights_pass_share(cfg, "gpu", True, "gpu", _never) == 1.0
    assert weights_pass_share(cfg, "tpu", True, "tpu", _never) == 1.0
    assert weights_pass_share(cfg, "cpu", False, "no-split", _never) == 1.0


def test_share_is_measured_once_per_process_for_each_sampler_shape(monkeypatch):
    monkeypatch.setattr(schedule, "_measured", {})
    calls = []

    def measure() -> float:
        calls.append(1)
        return 0.2

    shares = [weights_pass_share(SamplerConfig(), "cpu", True, key, measure)
              for key in ("a", "a", "b")]

    assert shares == [0.2, 0.2, 0.2]
    assert len(calls) == 2


def test_timed_windows_are_the_shortest_and_the_longest_within_the_span():
    assert measure_windows((32, 48, 64, 96, 128, 192, 256, 384, 512)) == (32, 256)
    assert measure_windows((32, 48, 64)) == (32, 64)
    assert measure_windows((16,)) == (16, 16)


def test_one_window_has_nothing_to_difference_and_prices_a_pass_as_one():
    assert measure_weights_pass(_never, (32, 32), 1, {"w": jnp.zeros((4,))}) == 1.0


def test_measured_share_on_cpu_is_finite_positive_and_runs_each_window_reps_plus_one_times():
    # A stand-in decode whose cost grows with the window: attention of 8 rows over a cache.
    cache_BxTxD = jnp.ones((8, 2048, 64), jnp.float32)
    attend = jax.jit(lambda w: jax.nn.softmax(
        jnp.einsum("bd,btd->bt", cache_BxTxD[:, 0], cache_BxTxD[:, :w]), -1), static_argnums=0)
    params = {"w1": jnp.ones((256, 256)), "w2": jnp.ones((256,))}
    windows: list[int] = []

    def decode_at(w: int) -> jax.Array:
        windows.append(w)
        return attend(w)

    share = measure_weights_pass(decode_at, (256, 2048), 8 * 64, params, reps=3)

    # Its cost is bounded by calls, not by a clock: one compiling run and ``reps`` timed runs
    # per window.
    assert sorted(windows) == [256] * 4 + [2048] * 4
    assert SHARE_RANGE[0] <= share <= SHARE_RANGE[1]


@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan")])
def test_weights_pass_share_outside_zero_and_finite_is_rejected(value):
    with pytest.raises(ValueError, match="sampler.decode_split_weights_pass"):
        SamplerConfig(decode_split_weights_pass=value)
