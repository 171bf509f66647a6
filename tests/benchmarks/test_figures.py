"""The shared benchmark statistics: interleaving, medians with spreads, floors."""

from __future__ import annotations

import json

import pytest

from meshrl.benchmarks import figures


def test_interleave_rotates_order_and_discards_warmup():
    calls: list[str] = []

    def side(name: str, seconds: float):
        def run() -> float:
            calls.append(name)
            return seconds
        return run

    times = figures.interleave({"a": side("a", 1.0), "b": side("b", 2.0), "c": side("c", 3.0)},
                               rounds=3, warmup=1, verbose=False)

    assert times == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_interleave_rejects_zero_rounds():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        figures.interleave({"a": lambda: 1.0}, rounds=0)


def test_spread_reports_median_not_best():
    assert figures.spread("ratio", [3.0, 1.0, 2.0, 10.0, 2.5]) == {
        "ratio": 2.5, "ratio_spread": [1.0, 10.0]}


def test_paired_ratios_pair_rounds_and_reject_unequal_lengths():
    assert figures.paired_ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="equal, non-empty"):
        figures.paired_ratios([1.0], [1.0, 2.0])


def test_emit_with_a_beaten_floor_prints_invalid_and_exits_nonzero(capsys):
    floors = figures.Floors()
    floors.check("train", real_s=0.90, floor_s=1.0)

    with pytest.raises(SystemExit) as exc:
        figures.emit({"benchmark": "x", "ratio": 0.9}, floors)

    assert exc.value.code == 1
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["valid"] is False and "train" in last["invalid"][0]


def test_emit_within_slack_is_valid(capsys):
    floors = figures.Floors()
    floors.check("train", real_s=0.96, floor_s=1.0)  # within the 5% slack

    figures.emit({"benchmark": "x"}, floors)

    assert json.loads(capsys.readouterr().out.strip())["valid"] is True


def test_rl_step_headline_ratios_below_their_floor_make_the_run_invalid():
    # Medians of each side can pass while the paired per-step headline is below the floor.
    from meshrl.benchmarks import rl_step

    steps = [2, 3, 4]
    rows = {s: {"step": st, "generate": 0.3, "reward": 0.0, "batch_build": 0.0, "train": tr,
                "handoff": 0.01, "other": 0.0}
            for s, st, tr in zip(steps, [1.0, 0.9, 2.0], [0.72, 0.63, 1.40], strict=True)}
    floor_rows = {s: {"generate_floor": 0.3, "train_floor": tf, "handoff_floor": 0.01}
                  for s, tf in zip(steps, [0.79, 0.69, 0.69], strict=True)}

    out, floors = rl_step.summarize(rows, floor_rows, steps)

    assert out["overhead_ratio"] < 0.95 and out["train_ratio"] < 0.95
    assert [p.split(":")[0] for p in floors.problems] == ["overhead_ratio", "train_ratio"]


def test_check_ratio_flags_only_a_headline_below_one_by_more_than_the_slack():
    floors = figures.Floors()
    floors.check_ratio("within", 0.96)
    floors.check_ratio("beaten", 0.94)
    assert [p.split(":")[0] for p in floors.problems] == ["beaten"]
