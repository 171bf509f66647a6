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

from meshrl.tests.launch.pids import alive

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
    assert all(alive(p) for p in pids)
    return launcher, pids


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _kill_leftovers(pids: list[int]) -> None:
    for p in pids:
        if alive(p):
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


# Process 1 starts a child of its own, writes both pids, then ends with ``sys.argv[2]``: an exit
# code, or a signal name it sends itself.
DYING_JOB = ("import os, pathlib, signal, subprocess, sys, time; "
             "i = [a for a in sys.argv if 'process_id=' in a][0].split('=')[1]; "
             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "pathlib.Path(sys.argv[1], i).write_text(f'{os.getpid()} {c.pid}'); "
             "time.sleep(1.0); end = sys.argv[2]; "
             "i == '1' and (os.kill(os.getpid(), getattr(signal, end)) if end.startswith('SIG') "
             "else os._exit(int(end))); time.sleep(60)")


@pytest.mark.parametrize("end, code", [("3", 3), ("SIGKILL", 128 + signal.SIGKILL)])
def test_a_failed_process_is_named_and_every_process_and_child_is_stopped(tmp_path, end, code):
    out = subprocess.run([*LAUNCH, "--num_processes", "2", "--", "-c", DYING_JOB, str(tmp_path),
                          end], capture_output=True, text=True, timeout=60)
    pids = [int(w) for i in range(2) for w in (tmp_path / str(i)).read_text().split()]
    try:
        assert out.returncode == code, out.stderr
        how = "signal 9" if end == "SIGKILL" else "exit code 3"
        assert f"launch/local.py: process 1 ended with {how}; stopping the others" in out.stderr
        assert _gone_within(pids, 5) == []
    finally:
        _kill_leftovers(pids)


def test_the_job_ends_when_the_launchers_reader_goes_away(tmp_path):
    job = "import sys\nfor i in range(200000): print('line', i)"
    launcher = subprocess.Popen([*LAUNCH, "--num_processes", "2", "--", "-c", job],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert launcher.stdout is not None
    launcher.stdout.readline()
    launcher.stdout.close()  # as ``| head -n 1`` does
    try:
        assert launcher.wait(timeout=60) in (0, 1)  # 1: Python reports the closed stdout at exit
    finally:
        launcher.kill()


def test_a_callers_jax_num_cpu_devices_does_not_override_devices_per_process(monkeypatch):
    from meshrl.launch import local

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "2")
    env = local.process_env(4, "cpu")
    assert "JAX_NUM_CPU_DEVICES" not in env
    assert "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"].split()
