"""SIGKILL at random moments: the SFT job always resumes from the newest finished checkpoint,
never moves a finished step aside, and ends with the params of an uninterrupted run (bitwise).

The parent watches ``<workdir>/checkpoints`` and kills ``main.py`` in one of three moments:
while Orbax's temporary directory of a step exists ("during" a save), right after a step
appears under its final name ("after"), or at a random time since start ("random").
"""

from __future__ import annotations

import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from meshrl.tests.trees import assert_trees_equal, final_params
from meshrl.tests.xla import cpu_env
from meshrl.trainer.checkpoint import MANIFEST, TMP_SUFFIX

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAGS = ("--config.trainer.eval_every=0", "--config.checkpoint.every_steps=2",
         "--config.mesh.data=2", "--config.logging.progress_bar=false",
         "--config.logging.tensorboard=false", "--config.data.num_examples=64")
_RESUMED = re.compile(r"resuming at step (\d+)")


def _env(cache: pathlib.Path) -> dict[str, str]:
    # The compilation cache makes each restart cheap; the programs (and so the bits) are the same.
    return cpu_env(2, JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _start(workdir: pathlib.Path, steps: int, env: dict[str, str], log: pathlib.Path
           ) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "main.py"), "--config",
           str(ROOT / "configs" / "sft_synthetic.py") + ":smoke", "--workdir", str(workdir),
           f"--config.trainer.steps={steps}", *FLAGS]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _steps(ckpt: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.glob("*") if p.name.isdigit()) if ckpt.exists() \
        else []


def _tmp_dirs(ckpt: pathlib.Path) -> set[tuple[str, int]]:
    """Orbax's temporary step directories, with their creation time (a rerun reuses names)."""
    if not ckpt.exists():
        return set()
    out = set()
    for p in ckpt.iterdir():
        try:
            if p.name.endswith(TMP_SUFFIX):
                out.add((p.name, p.stat().st_ctime_ns))
        except FileNotFoundError:  # renamed or cleaned up while we looked
            pass
    return out


def _kill_at_a_moment(proc: subprocess.Popen, ckpt: pathlib.Path, mode: str,
                      rng: random.Random, before_s: float, timeout: float = 120.0
                      ) -> bool | None:
    """SIGKILL ``proc`` at a moment of kind ``mode``; ``None`` when it finished first, else
    whether a save of this run was in flight at the kill."""
    t0, known, stale = time.monotonic(), set(_steps(ckpt)), _tmp_dirs(ckpt)
    at = t0 + rng.uniform(0.05, 1.0) * before_s
    while proc.poll() is None:
        now = time.monotonic()
        assert now - t0 < timeout, "the SFT run neither finished nor reached a kill point"
        hit = (mode == "random" and now >= at) or (mode == "during" and _tmp_dirs(ckpt) - stale) or \
            (mode == "after" and set(_steps(ckpt)) - known)
        if hit:
            time.sleep(rng.uniform(0.0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return bool(_tmp_dirs(ckpt) - stale)
        time.sleep(0.002)
    return None


def _run_with_kills(tmp_path: pathlib.Path, steps: int, kills: int, seed: int) -> None:
    env = _env(tmp_path / "jax_cache")
    straight = tmp_path / "straight"
    ref = _start(straight, steps, env, tmp_path / "straight.log")
    assert ref.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]

    rng, workdir = random.Random(seed), tmp_path / "killed"
    ckpt = workdir / "checkpoints"
    modes = ["during", "random", "after"]
    done, during, attempt = 0, 0, 0
    first_save_s = 0.0  # "random" kills land before a (warm) start reaches its first save
    expect_resume: int | None = None
    while True:
        log = tmp_path / f"attempt{attempt}.log"
        t0 = time.monotonic()
        proc = _start(workdir, steps, env, log)
        mode = modes[attempt % 3] if attempt < kills else "none"
        in_save = (None if mode == "none" else
                   _kill_at_a_moment(proc, ckpt, mode, rng, first_save_s))
        first_save_s = first_save_s or time.monotonic() - t0
        killed = in_save is not None
        if not killed:
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        text = log.read_text()
        resumed = _RESUMED.search(text)
        if resumed or not killed:
            # A kill before the restore finished leaves no line; every start that restored
            # must have taken the newest step that was finished at the previous kill.
            got = int(resumed.group(1)) if resumed else None
            assert got == expect_resume, (attempt, got, expect_resume, text[-2000:])
        assert "unusable" not in text, text[-2000:]
        assert not list(ckpt.glob("corrupt.*")), "a finished step was moved aside"
        if not killed:
            break
        done += 1
        during += bool(in_save)
        finished = _steps(ckpt)
        assert all((ckpt / str(s) / MANIFEST).exists() for s in finished), finished
        expect_resume = finished[-1] if finished else None
        attempt += 1

    assert done >= kills, f"only {done} of {kills} kills landed before the run finished"
    assert during >= 1, "no kill landed while a save was in flight"
    assert_trees_equal(final_params(workdir, steps), final_params(straight, steps))


@pytest.mark.distributed
@pytest.mark.slow  # ~75 s; a kill and a resume to identical params stay in the default run:
# tests/trainer/test_checkpoint.py (resume after kill); the kill -9 ones are slow too
def test_sft_killed_three_times_resumes_from_newest_step_with_identical_params(tmp_path):
    _run_with_kills(tmp_path, steps=20, kills=3, seed=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_killed_twenty_times_resumes_from_newest_step_with_identical_params(tmp_path):
    _run_with_kills(tmp_path, steps=60, kills=21, seed=1)
