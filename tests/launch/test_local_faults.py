"""launch/local.py stopped from outside: SIGTERM or SIGHUP (a CI cancel, ``timeout``, a closed ssh
connection) stops every process of the job, their own children included, and the launcher exits
128 + the signal; SIGKILL of the launcher, which no handler sees, still takes the job's
processes with it (Linux: PR_SET_PDEATHSIG). Checked by pid in /proc."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]

# Each process starts a child of its own (as a reward pool does), writes "<pid> <child pid>" to
# <dir>/<process id>, and then runs for a minute.
JOB = ("import os, pathlib, subprocess, sys, time; "
       "i = [a for a in sys.argv if 'process_id=' in a][0].split('=')[1]; "
       "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
       "pathlib.Path(sys.argv[1], i + '.tmp').write_text(f'{os.getpid()} {c.pid}'); "
       "os.rename(pathlib.Path(sys.argv[1], i + '.tmp'), pathlib.Path(sys.argv[1], i)); "
       "time.sleep(60)")


def _alive(pid: int) -> bool:
    """Running, not a zombie: an orphan's zombie lingers where PID 1 does not reap."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start(tmp_path: pathlib.Path, processes: int = 2) -> tuple[subprocess.Popen, list[int]]:
    """The launcher running JOB; the pids of its processes and of their children."""
    launcher = subprocess.Popen([*LAUNCH, "--num_processes", str(processes), "--", "-c", JOB,
                                 str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len([p for p in tmp_path.iterdir() if p.suffix != ".tmp"]) < processes:
        assert time.monotonic() < deadline and launcher.poll() is None, "job did not start"
        time.sleep(0.05)
    pids = [int(w) for i in range(processes) for w in (tmp_path / str(i)).read_text().split()]
    assert all(_alive(p) for p in pids)
    return launcher, pids


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill_leftovers(pids: list[int]) -> None:
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_launcher_leaves_no_process_of_the_job(tmp_path, sig):
    launcher, pids = _start(tmp_path)
    try:
        launcher.send_signal(sig)
        code = launcher.wait(timeout=30)

        assert code == 128 + sig
        assert _gone_within(pids, 5) == []
    finally:
        launcher.kill()
        _kill_leftovers(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_launcher_takes_the_job_processes_with_it(tmp_path):
    launcher, pids = _start(tmp_path)
    jobs = pids[0::2]  # the launcher's own processes; their children are theirs to stop
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)

        assert _gone_within(jobs, 5) == []
    finally:
        _kill_leftovers(pids)
