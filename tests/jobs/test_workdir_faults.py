"""main.py's workdir checks, run for real: a second run on a workdir another run holds exits 1 with
one line naming the holder, and changes no file there (its dry run still passes); so does every
process of a two-process run; a group-writable default workdir (no --workdir: under
$XDG_CACHE_HOME) is refused the same way (tests/utils/test_workdir.py has every refusal)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SFT = [str(ROOT / "main.py"), "--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
       "--config.trainer.steps=1", "--config.logging.progress_bar=false"]
HOLDER = ("import sys, time; from meshrl.utils.workdir import WorkdirLock; "
          "WorkdirLock(sys.argv[1], '.meshrl.lock', 'rl').acquire(); "
          "print('locked', flush=True); time.sleep(120)")


def _main(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SFT, *args], capture_output=True, text=True,
                          env=cpu_env(**env), timeout=300)


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def held(tmp_path):
    """A workdir with a checkpoint-like file, locked by a live stand-in run."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    workdir.chmod(0o700)
    (workdir / "checkpoints" / "3" / "state").write_bytes(os.urandom(64))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    yield workdir, holder
    holder.kill()
    holder.wait()


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error: " in line]


@pytest.mark.slow  # the two-process case refuses a held workdir the same way
def test_a_second_run_on_a_held_workdir_exits_1_naming_the_holder_and_changes_nothing(held):
    workdir, holder = held
    before = _snapshot(workdir)

    dry = _main("--workdir", str(workdir), "--dry_run")
    out = _main("--workdir", str(workdir))

    assert dry.returncode == 0, dry.stderr[-2000:]  # the dry run takes no lock
    assert out.returncode == 1, out.stderr[-2000:]
    assert _error_lines(out.stderr) == [
        f"error: workdir {workdir}: in use by another run (pid {holder.pid} on host "
        f"{os.uname().nodename} since {_started(workdir)}, job rl; lock file "
        f"{workdir / '.meshrl.lock'}): wait for it to end or stop it, or pass another --workdir"]
    assert _snapshot(workdir) == before
    assert holder.poll() is None


def _started(workdir: pathlib.Path) -> str:
    return json.loads((workdir / ".meshrl.lock").read_text())["started"]


@pytest.mark.distributed
def test_every_process_of_a_two_process_run_refuses_a_held_workdir(held):
    workdir, holder = held
    before = _snapshot(workdir)

    out = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--num_processes",
                          "2", "--devices_per_process", "4", "--", *SFT, "--workdir",
                          str(workdir)], capture_output=True, text=True, env=cpu_env(),
                         timeout=300)

    assert out.returncode == 1, out.stdout[-3000:]
    for p in ("p0", "p1"):
        assert any(line.startswith(f"[{p}] error: workdir {workdir}: in use by another run "
                                   f"(pid {holder.pid} ") for line in out.stdout.splitlines()), \
            out.stdout[-3000:]
    assert _snapshot(workdir) == before
    assert holder.poll() is None


def test_without_workdir_the_run_uses_the_users_cache_and_refuses_it_group_writable(tmp_path):
    workdir = tmp_path / "cache" / "meshrl" / "workdir"
    workdir.mkdir(parents=True)
    workdir.chmod(0o775)

    out = _main(XDG_CACHE_HOME=str(tmp_path / "cache"))

    assert out.returncode == 1
    assert _error_lines(out.stderr) == [
        f"error: workdir {workdir}: mode 0775 lets group or others write into it: "
        f"`chmod go-w {workdir}`, or pass another --workdir"]
    assert list(workdir.iterdir()) == []
