"""Planning a decode chunk's calls over cache windows (pure host-side arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import SamplerConfig
from meshrl.inference import schedule
from meshrl.inference.schedule import (
    SHARE_RANGE,
    measure_weights_pass,
    measure_windows,
    plan_calls,
    weights_pass_cost,
    weights_pass_share,
)


def _window(pos: int) -> int:
    return pos  # one cache entry per position keeps the arithmetic readable


BUCKETS = (4, 8, 16, 32)


def test_cut_is_taken_only_when_saved_cache_reads_outweigh_one_more_call():
    # 4 long rows at 300, 28 at 100: one call on every slot reads 32 x 300 entries a step; cut
    # at 16 (the 4 long ones and 12 short ones, then 16 short ones) it reads 16 x 300 + 16 x 100.
    positions = [300] * 4 + [100] * 28
    saved = (32 * 300 - (16 * 300 + 16 * 100)) * 2

    split = plan_calls(positions, BUCKETS, _window, fixed_cost=saved - 1, entry_size=2)
    whole = plan_calls(positions, BUCKETS, _window, fixed_cost=saved, entry_size=2)

    assert split == [(0, 16, 16, 300), (16, 32, 16, 100)]
    assert whole == [(0, 32, 32, 300)]


def test_position_levels_decode_as_ranges_over_their_own_windows():
    positions = [500] * 4 + [300] * 12 + [64] * 16

    calls = plan_calls(positions, BUCKETS, _window, fixed_cost=100, entry_size=1)

    # [4, 16) as 4 + 8 rows reads 1,200 fewer entries than one 16-row call: worth a call.
    assert calls == [(0, 4, 4, 500), (4, 8, 4, 300), (8, 16, 8, 300), (16, 32, 16, 64)]


def test_one_call_runs_on_the_smallest_bucket_holding_the_live_rows():
    for live, rows in ((3, 4), (5, 8), (20, 32), (32, 32)):
        calls = plan_calls([200] * live, BUCKETS, _window, fixed_cost=0, entry_size=1,
                           split=False)
        assert calls == [(0, live, rows, 200)]


def test_a_range_short_of_the_whole_ranking_never_takes_every_slot():
    # 10 live: 4 long ones alone, the other 6 padded to 8 rows (not 32 with the free slots).
    positions = [400] * 4 + [50] * 6

    calls = plan_calls(positions, BUCKETS, _window, fixed_cost=0, entry_size=1)

    assert calls == [(0, 4, 4, 400), (4, 10, 8, 50)]


def test_calls_partition_the_ranking_on_row_buckets_at_any_call_cost():
    rng = np.random.default_rng(0)
    for _ in range(20):
        positions = sorted(rng.integers(1, 1000, rng.integers(1, 33)).tolist(), reverse=True)
        for fixed in (0, 10, 10_000, 10**9):
            calls = plan_calls(positions, BUCKETS, _window, fixed_cost=fixed, entry_size=1)
            assert [lo for lo, *_ in calls] == [0] + [hi for _, hi, *_ in calls[:-1]]
            assert calls[-1][1] == len(positions)
            for lo, hi, rows, window in calls:
                assert rows in BUCKETS and hi - lo <= rows and window == positions[lo]
                assert rows < 32 or (lo, hi) == (0, len(positions))


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
