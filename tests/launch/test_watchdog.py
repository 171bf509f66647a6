"""Hangs and deaths of one process in a 2-process job: a process that skips a step's
collectives ends in every process's watchdog report, not a silent hang; a kill -9 of one
process makes the launcher stop the other and exit non-zero, and the same command resumes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py"), "--num_processes", "2",
          "--devices_per_process", "2", "--"]
pytestmark = pytest.mark.distributed
SFT_ARGS = ["--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
            "--config.mesh.data=2", "--config.mesh.tensor=2", "--config.trainer.eval_every=0",
            "--config.logging.progress_bar=false"]


@pytest.mark.slow  # three processes and a watchdog timeout; test_local's failing-process run stays
def test_a_process_that_skips_a_collective_ends_in_watchdog_reports(tmp_path):
    env = {**os.environ, "MESHRL_TEST_FAULT": "hang_at_step:3"}
    t0 = time.monotonic()
    out = subprocess.run([*LAUNCH, str(ROOT / "tests" / "launch" / "fault_main.py"), *SFT_ARGS,
                          "--config.distributed.step_timeout_s=8",
                          "--config.distributed.first_step_timeout_s=180",
                          "--workdir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

    assert out.returncode == 124, out.stdout[-3000:]
    assert time.monotonic() - t0 < 200
    # Process 1 stopped before step 3, so step 2's metrics were never read (they are read one
    # step late). Process 0, waiting in step 3's collectives, then fails on the closed
    # connection or is stopped by the launcher.
    report = [line for line in out.stdout.splitlines() if "watchdog: no step completed" in line]
    assert any(line.startswith("[p1]") and "last completed step: 1; last program launched: "
               "train step 2" in line for line in report), out.stdout[-3000:]
    assert "[p1] Thread 0x" in out.stdout and "fault_main.py" in out.stdout  # the stacks


def _pid_of(process_id: int, workdir: pathlib.Path) -> int | None:
    for proc in pathlib.Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it just ended
            continue
        if (f"--config.distributed.process_id={process_id}".encode() in args
                and str(workdir).encode() in args):
            return int(proc.name)
    return None


@pytest.mark.slow
def test_kill_9_of_one_process_stops_the_job_and_the_same_command_resumes(tmp_path):
    cmd = [*LAUNCH, "main.py", *SFT_ARGS, "--config.trainer.steps=400",
           "--config.checkpoint.every_steps=10", "--config.distributed.step_timeout_s=60",
           "--workdir", str(tmp_path)]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "checkpoints" / "20").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.2)
    victim = _pid_of(1, tmp_path)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    job.wait(timeout=60)

    assert job.returncode != 0 and time.monotonic() - t_kill < 60
    assert _pid_of(0, tmp_path) is None  # no orphan
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] >= 20 and summary["processes"] == 2
