"""utils/workdir.py on real directories and real processes: a symlinked, foreign-owned,
group/other-writable or non-directory workdir is refused with one line and left as it was; a
missing one is created private; a lock held by a live process refuses a second run and leaves
the holder running; the lock of a killed run is taken over with a log line naming it."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from meshrl.utils.workdir import WorkdirError, WorkdirLock, default_workdir, prepare

# A stand-in run: takes the lock, says so, and holds it until killed.
HOLDER = ("import sys, time; from meshrl.utils.workdir import WorkdirLock; "
          "WorkdirLock(sys.argv[1], '.meshrl.lock', 'rl').acquire(); "
          "print('locked', flush=True); time.sleep(120)")


def _holder(workdir: pathlib.Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    return p


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def records():
    """The meshrl.workdir log records, wherever ``log.setup`` left propagation in this worker."""
    logger, handler = logging.getLogger("meshrl.workdir"), _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_missing_workdir_is_created_private_even_under_a_group_writable_umask(tmp_path):
    old = os.umask(0o002)
    try:
        prepare(tmp_path / "a" / "run")
    finally:
        os.umask(old)

    assert (tmp_path / "a" / "run").stat().st_mode & 0o777 == 0o700
    prepare(tmp_path / "a" / "run")  # a rerun accepts what the first run created


def test_a_symlinked_workdir_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)

    with pytest.raises(WorkdirError) as e:
        prepare(tmp_path / "run")

    assert _one_line(e).startswith(f"workdir {tmp_path / 'run'}: is a symlink (to {target})")
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_group_or_other_writable_workdir_is_refused_with_the_chmod_fix(tmp_path, mode):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)

    with pytest.raises(WorkdirError) as e:
        prepare(run)

    assert _one_line(e) == (f"workdir {run}: mode {mode:04o} lets group or others write into "
                            f"it: `chmod go-w {run}`, or pass another --workdir")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_workdir_owned_by_another_user_is_refused_naming_both_uids(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, 12345, 12345)

    with pytest.raises(WorkdirError) as e:
        prepare(run)

    assert _one_line(e).startswith(f"workdir {run}: owned by uid 12345, not by this user "
                                   f"(uid 0")
    assert run.stat().st_uid == 12345


@pytest.mark.parametrize("name", ["run[1]", "a[b/run"])
def test_a_workdir_path_with_a_glob_bracket_is_refused_before_anything_is_created(tmp_path, name):
    target = tmp_path / name
    with pytest.raises(WorkdirError, match=r"holds '\[', which the checkpointer reads as a glob"):
        prepare(target)
    assert list(tmp_path.iterdir()) == []


def test_a_file_as_workdir_is_refused(tmp_path):
    (tmp_path / "run").write_text("data")

    with pytest.raises(WorkdirError, match="is not a directory"):
        prepare(tmp_path / "run")
    assert (tmp_path / "run").read_text() == "data"


def test_a_workdir_below_a_file_is_refused_with_one_line(tmp_path):
    (tmp_path / "file").write_text("data")

    with pytest.raises(WorkdirError) as e:
        prepare(tmp_path / "file" / "sub" / "run")

    assert _one_line(e) == (f"workdir {tmp_path / 'file' / 'sub' / 'run'}: cannot create or read "
                            f"it (Not a directory): pass a directory you can write as --workdir")


def test_a_lock_file_that_cannot_be_written_is_refused_with_one_line(tmp_path):
    # A real write failure: a file size limit of 0 bytes makes the holder's write fail (EFBIG),
    # as a full disk would (ENOSPC).
    script = ("import resource, signal, sys; from meshrl.utils.workdir import WorkdirError, "
              "WorkdirLock; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
              "try:\n    WorkdirLock(sys.argv[1], '.meshrl.lock', 'rl').acquire()\n"
              "except WorkdirError as e:\n    sys.exit(str(e))")

    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)

    assert out.returncode == 1
    assert out.stderr.strip() == (f"workdir lock file {tmp_path / '.meshrl.lock'}: cannot write "
                                  f"it (File too large): free space there, or pass another "
                                  f"--workdir")


def test_the_default_workdir_is_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_workdir() == str(tmp_path / "cache" / "meshrl" / "workdir")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_workdir() == str(tmp_path / "home" / ".cache" / "meshrl" / "workdir")


def test_a_second_run_on_a_locked_workdir_is_refused_naming_the_holder_and_the_holder_runs_on(
        tmp_path):
    holder = _holder(tmp_path)
    try:
        before = (tmp_path / ".meshrl.lock").read_text()

        with pytest.raises(WorkdirError) as e:
            WorkdirLock(tmp_path, ".meshrl.lock", "sft").acquire()

        line = _one_line(e)
        assert line.startswith(f"workdir {tmp_path}: in use by another run (pid {holder.pid} "
                               f"on host ")
        assert "wait for it to end or stop it, or pass another --workdir" in line
        assert (tmp_path / ".meshrl.lock").read_text() == before
        assert json.loads(before)["pid"] == holder.pid
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_log_line_naming_it(tmp_path, records):
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = WorkdirLock(tmp_path, ".meshrl.lock", "rl")

    lock.acquire()
    try:
        assert (f"took over the lock of a run that is gone (pid {holder.pid} on host"
                in records.text)
        assert json.loads((tmp_path / ".meshrl.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_released_lock_is_empty_and_the_next_run_takes_it_without_a_takeover(
        tmp_path, records):
    with WorkdirLock(tmp_path, ".meshrl.lock", "rl"):
        pass
    assert (tmp_path / ".meshrl.lock").read_text() == ""

    with WorkdirLock(tmp_path, ".meshrl.lock", "rl"):
        pass
    assert "took over" not in records.text


def test_locks_of_different_names_do_not_exclude_each_other(tmp_path):
    holder = _holder(tmp_path)
    try:
        with WorkdirLock(tmp_path, ".meshrl.evaluate.lock", "evaluate"):
            assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_a_symlink_planted_as_the_lock_file_is_refused_and_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".meshrl.lock").symlink_to(victim)

    with pytest.raises(WorkdirError, match=r"lock file .*\.meshrl\.lock: cannot open it"):
        WorkdirLock(run, ".meshrl.lock", "rl").acquire()
    assert victim.read_text() == "keep"


def test_a_workdir_that_refuses_new_files_says_so_not_remove_the_lock(tmp_path, monkeypatch):
    import errno

    def read_only(path, flags, mode=0o777):  # as a read-only directory answers (root ignores
        raise PermissionError(errno.EACCES, "Permission denied", path)  # chmod here)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(WorkdirError, match=r"workdir .*run: cannot create files there "
                                           r"\(Permission denied\): make it writable"):
        WorkdirLock(tmp_path / "run", ".meshrl.lock", "rl").acquire()


def test_a_file_system_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch, records):
    # No such file system is at hand in CI; flock fails there with ENOLCK, as raised here.
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with WorkdirLock(tmp_path, ".meshrl.lock", "rl"):
        pass
    assert "this file system cannot lock files" in records.text


def test_an_object_store_workdir_takes_no_lock(records):
    t0 = time.monotonic()
    with WorkdirLock("gs://bucket/run", ".meshrl.lock", "rl"):
        pass
    assert "is on an object store: no lock" in records.text
    assert time.monotonic() - t0 < 5  # no network call was attempted
