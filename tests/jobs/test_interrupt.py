"""Ctrl-C (SIGINT) during a run stops it between steps with one line, ``stopped at step N;
checkpoint saved: <path>``, and the checkpoint resumes."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SFT = [sys.executable, str(ROOT / "main.py"), "--config",
       str(ROOT / "configs/sft_synthetic.py:smoke"), "--config.trainer.eval_every=0",
       "--config.checkpoint.every_steps=0", "--config.logging.tensorboard=False"]


def _wait_for(path: pathlib.Path, pattern: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(errors="replace")):
            return
        assert proc.poll() is None, path.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {timeout} s: {path.read_text()[-3000:]}")


def _run(args: list[str], out: pathlib.Path, *, interrupt_after: str | None = None,
         timeout: float = 240) -> tuple[int, str]:
    with open(out, "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=cpu_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if interrupt_after is not None:
            _wait_for(out, interrupt_after, proc, timeout)
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, out.read_text(errors="replace")


@pytest.mark.slow
def test_sigint_during_sft_saves_the_step_prints_one_line_and_the_run_resumes_there(tmp_path):
    workdir = tmp_path / "run"
    rc, text = _run([*SFT, f"--workdir={workdir}", "--config.trainer.steps=100000"],
                    tmp_path / "first.log", interrupt_after=r"step 1/100000 ")

    assert rc == 130, text[-3000:]
    last = text.strip().splitlines()[-1]
    match = re.fullmatch(r"stopped at step (\d+); checkpoint saved: (\S+)", last)
    assert match, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    step = int(match.group(1))
    assert pathlib.Path(match.group(2)) == workdir / "checkpoints" / str(step)
    rc, text = _run([*SFT, f"--workdir={workdir}", f"--config.trainer.steps={step + 1}"],
                    tmp_path / "second.log")

    assert rc == 0, text[-3000:]
    assert f"resuming at step {step}" in text


def test_a_first_ctrl_c_stops_a_job_without_steps_at_once(tmp_path):
    # The evaluate job polls for weight versions: no loop of its reads the step-boundary flag,
    # so a first Ctrl-C must not be swallowed as a stop request.
    args = [sys.executable, str(ROOT / "main.py"), "--config",
            str(ROOT / "configs/default.py:smoke"), "--config.job=evaluate",
            "--config.evaluate.timeout_s=120", "--config.evaluate.poll_s=0.2",
            "--workdir", str(tmp_path / "run")]

    t0 = time.monotonic()
    rc, out = _run(args, tmp_path / "out.log", interrupt_after="watching .* for weight versions",
                   timeout=120)

    assert rc == 130, out[-3000:]
    assert "interrupted: stopped at once" in out and time.monotonic() - t0 < 100


def test_ctrl_c_before_jax_has_a_backend_stops_at_once_and_starts_none():
    # Asking JAX for the process count would start a one-process backend, and the run's
    # jax.distributed.initialize would then fail.
    probe = ("import os, signal, jax\n"
             "from jax._src import xla_bridge\n"
             "from meshrl.utils import interrupt\n"
             "interrupt.install()\n"
             "try:\n"
             "    os.kill(os.getpid(), signal.SIGINT)\n"
             "    print('no stop')\n"
             "except KeyboardInterrupt:\n"
             "    print('stopped', xla_bridge.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=cpu_env(),
                         capture_output=True, text=True, timeout=120)

    assert out.stdout.strip() == "stopped False", out.stdout + out.stderr
