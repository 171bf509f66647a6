"""kill -9 of the RL job (the default job's smoke variant, one CPU device) at a seeded random
moment after its first checkpoint, then a rerun to the end: ``trained_prompts.jsonl`` lists
every prompt of every epoch exactly once (none skipped, none twice) and no trained token was
staler than ``rollout.max_staleness``."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from meshrl.tests import main_process
from meshrl.tests.xla import cpu_env
from meshrl.workflows.rollout_state import read_trained_prompts

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAIN = [sys.executable, str(ROOT / "main.py"), "--config"]


@dataclass(frozen=True)
class Job:
    args: tuple[str, ...]
    examples: int  # data.num_examples
    steps: int
    max_staleness: int
    kill_window_s: float  # a kill lands this long at most after a new checkpoint
    timeout_s: float = 240


# The default job's smoke variant, no warm start, 16 steps of 4 prompts over 12 examples: five
# epochs and a part, a checkpoint every 2 steps, 2 versions of staleness.
TINY = Job((str(ROOT / "configs/default.py:smoke"), "--config.data.num_examples=12",
            "--config.trainer.steps=16", "--config.rollout.prompts_per_step=4",
            "--config.rollout.max_staleness=2", "--config.checkpoint.every_steps=2",
            "--config.trainer.eval_every=0", "--config.data.eval_examples=2",
            "--config.rl.warm_start_steps=0"), examples=12, steps=16, max_staleness=2,
           kill_window_s=0.6)
# The default job as shipped (300 steps, a checkpoint every 100).
DEFAULT = Job((str(ROOT / "configs/default.py"),), examples=2000, steps=300, max_staleness=2,
              kill_window_s=20.0, timeout_s=900)


def _start(job: Job, workdir: pathlib.Path) -> subprocess.Popen:
    return main_process.start([*MAIN, *job.args], workdir, ROOT, cpu_env())


def _kill_after_a_checkpoint(job: Job, workdir: pathlib.Path, rng: random.Random) -> bool:
    """Start the job, SIGKILL it a random moment (up to ``kill_window_s``) after a checkpoint
    newer than the one it resumed from appears; False when the last step was checkpointed
    first."""
    ckpts = workdir / "checkpoints"
    have = ({p.parent.name for p in ckpts.glob("*/meshrl_manifest.json")} if ckpts.exists()
            else set())
    proc = _start(job, workdir)
    deadline = time.monotonic() + job.timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if {p.parent.name for p in ckpts.glob("*/meshrl_manifest.json")} - have:
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, job.kill_window_s))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return not (ckpts / str(job.steps) / "meshrl_manifest.json").exists()


def _finish(job: Job, workdir: pathlib.Path) -> None:
    main_process.finish(_start(job, workdir), workdir, job.timeout_s)


def check_trained_prompts(job: Job, workdir: pathlib.Path) -> None:
    records = read_trained_prompts(workdir)
    assert [r["step"] for r in records] == list(range(1, job.steps + 1)), records
    ids = [tuple(i) for r in records for i in r["prompt_ids"]]
    ids += [tuple(s[:2]) for r in records for s in r["skipped"]]
    assert len(ids) == len(set(ids)), sorted(ids)  # none twice
    by_epoch: dict[int, set[int]] = {}
    for epoch, index in ids:
        by_epoch.setdefault(epoch, set()).add(index)
    # None skipped: every epoch the run moved past is complete.
    for epoch in range(max(by_epoch)):
        missing = set(range(job.examples)) - by_epoch.get(epoch, set())
        assert not missing, (epoch, sorted(missing))


def check_staleness(job: Job, workdir: pathlib.Path) -> None:
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == job.steps
    assert summary["max_staleness_seen"] <= job.max_staleness
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    lags = [r["rollout/batch_staleness_max"] for r in rows if "rollout/batch_staleness_max" in r]
    assert lags and max(lags) <= job.max_staleness, lags


def run_killed(job: Job, workdir: pathlib.Path, seed: int, kills: int) -> int:
    """``kills`` seeded kills (each after a new checkpoint), then a rerun to the end; returns
    how many kills landed before the job ended by itself."""
    rng = random.Random(seed)
    landed = 0
    while landed < kills and _kill_after_a_checkpoint(job, workdir, rng):
        landed += 1
    _finish(job, workdir)
    check_trained_prompts(job, workdir)
    check_staleness(job, workdir)
    return landed


@pytest.mark.slow  # seed 0 of the one-kill test runs by default
def test_two_seeded_kills_then_rerun_train_every_prompt_exactly_once(tmp_path):
    # One run killed up to twice at seeded moments, each resuming the last: three starts at most.
    assert run_killed(TINY, tmp_path / "run", seed=0, kills=2) == 2


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 20))])
def test_seeded_kill_then_rerun_trains_every_prompt_exactly_once(tmp_path, seed):
    assert run_killed(TINY, tmp_path / "run", seed=seed, kills=1) == 1


@pytest.mark.slow  # the default job (about 2 minutes on 2 CPU cores) and two reruns
def test_default_job_killed_twice_still_gains_accuracy(tmp_path):
    workdir = tmp_path / "run"
    assert run_killed(DEFAULT, workdir, seed=0, kills=2) == 2
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.15, summary
