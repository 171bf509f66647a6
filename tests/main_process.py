"""``main.py`` runs in a child process for the end-to-end tests: started in its own process
group with its output appended to ``<workdir>.log`` beside the workdir, and waited for with a
kill of the whole group on a timeout, so no run outlives its test."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
from collections.abc import Sequence


def log_path(workdir: pathlib.Path) -> pathlib.Path:
    return workdir.parent / f"{workdir.name}.log"


def start(args: Sequence[str], workdir: pathlib.Path, cwd: pathlib.Path,
          env: dict[str, str]) -> subprocess.Popen:
    """``args`` (the command line, without ``--workdir``) on ``workdir``."""
    log = open(log_path(workdir), "ab")  # noqa: SIM115 (closed by the OS)
    return subprocess.Popen([*args, f"--workdir={workdir}"], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, workdir: pathlib.Path, timeout: float) -> None:
    """Wait up to ``timeout`` seconds (then kill the group) and assert a zero exit, showing the
    log's tail otherwise."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path(workdir).read_text(errors="replace")
    assert rc == 0, log[-4000:]
