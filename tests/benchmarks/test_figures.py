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
