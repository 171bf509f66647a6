"""Progress off a terminal: a line at least every ``every_s`` seconds, with step/s and an ETA
from the recent pace (a fake clock stands in for time)."""

from __future__ import annotations

import io

from meshrl.trainer import progress as progress_lib
from meshrl.trainer.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Records:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)


def _eta_s(text: str) -> float:
    parts = [int(p) for p in text.split(":")]
    return float(sum(p * 60 ** i for i, p in enumerate(reversed(parts))))


def test_slow_run_off_a_terminal_logs_at_least_every_30_s_with_step_rate(monkeypatch):
    records = _Records()
    monkeypatch.setattr(progress_lib, "_log", records)
    clock = _Clock()
    progress = Progress(1000, 0, stream=io.StringIO(), clock=clock)

    for step in range(1, 41):  # 10 s a step: 10% of the run is 1,000 s away
        clock.now += 10.0
        progress.update(step, 0.5, 100.0)

    logged = [int(line.split()[1].split("/")[0]) for line in records.lines]
    assert logged == [1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37, 40]
    assert all(" 0.1 step/s ETA " in line for line in records.lines[1:])


def test_eta_follows_the_recent_pace_not_the_compile_dominated_first_step():
    clock = _Clock()
    progress = Progress(100, 0, stream=io.StringIO(), clock=clock, log_lines=False)
    clock.now = 300.0  # the first step compiles for 5 minutes
    progress.update(1, 1.0, 1.0)
    for step in range(2, 21):  # then 1 s a step
        clock.now += 1.0
        progress.update(step, 1.0, 1.0)

    assert abs(progress.steps_per_s() - 1.0) < 1e-9
    assert _eta_s(progress.eta(20)) == 80.0  # 80 steps left at 1 step/s


def test_eta_converges_when_the_pace_changes_after_the_window():
    clock = _Clock()
    progress = Progress(1000, 0, stream=io.StringIO(), clock=clock, log_lines=False,
                        window_s=60.0)
    for step in range(1, 101):  # 1 s a step, then 2 s a step
        clock.now += 1.0 if step <= 50 else 2.0
        progress.update(step, 1.0, 1.0)

    assert abs(progress.steps_per_s() - 0.5) < 1e-9
    assert _eta_s(progress.eta(100)) == 1800.0


def test_eta_of_a_step_not_yet_updated_counts_it_done_now():
    clock = _Clock()
    progress = Progress(101, 0, stream=io.StringIO(), clock=clock, log_lines=False)
    clock.now = 100.0  # the first step, compiling
    assert _eta_s(progress.eta(1)) == 10000.0  # 100 s a step so far

    progress.update(1, 1.0, 1.0)
    clock.now = 102.0  # the job asks for step 2's ETA before update(2)
    assert _eta_s(progress.eta(2)) == 198.0  # 99 steps at the second step's 2 s
