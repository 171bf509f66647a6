"""launch/sweep.py end to end: a 2 x 2 sweep of the smoke RL job through the real CLI and the
real main.py (one CPU device per trial, as tests/jobs/test_rl.py runs the smoke job), its
rerun, and a trial main.py rejects."""

from __future__ import annotations

import csv
import pathlib
import subprocess
import sys
import textwrap

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SWEEP_PY = ROOT / "launch" / "sweep.py"
NAMES = ["seed=0,learning_rate=0.001", "seed=0,learning_rate=0.0003",
         "seed=1,learning_rate=0.001", "seed=1,learning_rate=0.0003"]
# Two RL steps after a two-step warm start, no mid-run eval: the shapes stay the smoke job's,
# so the trials share the compilation cache tests/conftest.py sets up. The learning rate is a
# constant of the compiled train step: with the seed as the outer axis, the two trials that run
# first (--parallel 2) compile both rates and the other two find every program in the cache.
HEADER = f"""
from meshrl.launch import sweep as hyper
CONFIG = "{ROOT / 'configs' / 'default.py'}:smoke"
FIXED = {{"trainer.steps": 2, "rl.warm_start_steps": 2, "trainer.eval_every": 0}}
def axes():
    return hyper.product(hyper.sweep("trainer.seed", [0, 1]),
                         hyper.sweep("trainer.learning_rate", [1e-3, 3e-4]))
"""


def _env() -> dict[str, str]:
    return cpu_env()  # one CPU device per trial, not the suite's 8 fake ones


def _sweep(sweep_file: pathlib.Path, workdir: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SWEEP_PY), str(sweep_file), "--workdir",
                           str(workdir), "--parallel", "2"], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=400)


def _snapshot(workdir: pathlib.Path) -> dict[str, tuple[int, str]]:
    return {n: ((workdir / n / "summary.json").stat().st_mtime_ns,
                (workdir / n / "sweep.log").read_text()) for n in NAMES}


@pytest.mark.slow  # five smoke runs of main.py, ~50 s on 2 cores; tests/launch/test_sweep.py covers the launcher logic in the default run
def test_2x2_smoke_sweep_writes_table_csv_and_plot_reruns_nothing_and_reports_a_bad_trial(
        tmp_path):
    good, bad, workdir = tmp_path / "good.py", tmp_path / "bad.py", tmp_path / "sweep"
    good.write_text(textwrap.dedent(HEADER) + "def sweep():\n    return axes()\n")
    bad.write_text(textwrap.dedent(HEADER) + "def sweep():\n    return axes() + "
                   "[{'trainer.seed': 0, 'trainer.learning_rate': -1.0}]\n")

    first = _sweep(good, workdir)

    assert first.returncode == 0, first.stdout + first.stderr[-4000:]
    table = first.stdout.splitlines()
    assert table[0].split()[:4] == ["trial", "status", "trainer.seed", "trainer.learning_rate"]
    assert {"accuracy_before", "accuracy_after", "reward_last", "wall_s"} <= set(table[0].split())
    assert [line.split()[:2] for line in table[1:5]] == [[n, "done"] for n in NAMES]
    with open(workdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["status"], r["trainer.seed"]) for r in rows] == [
        (n, "done", n[5]) for n in NAMES]
    for r in rows:
        assert 0.0 <= float(r["accuracy_after"]) <= 1.0 and float(r["wall_s"]) > 0, r
        assert r["steps"] == "2" and "eval_after.eval/greedy_accuracy" in r
    assert (workdir / "sweep_curves.png").stat().st_size > 1000

    before = _snapshot(workdir)
    again = _sweep(good, workdir)

    assert again.returncode == 0, again.stderr[-4000:]
    assert "4 trials, 4 finished, 0 to run" in again.stderr
    assert _snapshot(workdir) == before  # no trial ran again

    third = _sweep(bad, workdir)

    assert third.returncode == 1
    assert "5 trials, 4 finished, 1 to run" in third.stderr
    assert ["seed=0,learning_rate=-1.0", "failed"] in [ln.split()[:2] for ln in
                                                       third.stdout.splitlines()]
    assert "  | error: trainer.learning_rate = -1.0" in third.stdout, third.stdout
    assert _snapshot(workdir) == before
