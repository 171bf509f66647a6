"""The workdir a job writes: checked before the first write and held by one run at a time.

Contract:
* ``default_workdir()``: ``$XDG_CACHE_HOME/meshrl/workdir`` (``~/.cache/meshrl/workdir`` when
  the variable is unset), the workdir of a run started without ``--workdir``: the user's own,
  where a shared default such as ``/tmp/meshrl`` is any user's to create first.
* ``prepare(workdir)``: creates a missing local workdir with mode 0700 (its parents with the
  umask's modes), then refuses with a ``WorkdirError`` (one line: the path, what is wrong, the
  fix) a workdir that is a symlink, not a directory, owned by another user than this process's
  effective uid, or writable by group or others. Anyone who can write into the workdir can put a
  symlink where the run writes ``summary.json``, ``samples.jsonl`` or metrics, or replace its
  checkpoints; the final path component must be the directory itself (a symlink higher up, such
  as macOS's ``/tmp``, is fine).
* ``WorkdirLock(workdir, name)``: ``acquire()`` takes an exclusive ``fcntl.flock`` on
  ``<workdir>/<name>`` and writes the holder (host, pid, start time, job) into it;
  ``release()`` empties it and unlocks. The kernel drops the lock when its holder dies, SIGKILL
  included, so a lock file whose holder is gone is taken over, with a log line naming it. A lock
  held by a live run is a ``WorkdirError`` naming the workdir and the holder.
* Object-store workdirs (``gs://...``) have neither owners nor locks: no check, no lock, a log
  line. A local file system without ``flock`` (some network mounts) runs unlocked with a
  warning. The lock file is the lock: deleting it by hand while a run holds it lets a second
  run in.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pwd
import socket
import stat
from typing import Any

from meshrl.utils import log, paths
from meshrl.utils.errors import UserError

_log = log.get_logger("workdir")


class WorkdirError(UserError):
    """The workdir cannot be used by this run: unsafe to write, or held by another run."""


def default_workdir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "meshrl", "workdir")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _problem(path: str, st: os.stat_result) -> str | None:
    """Why ``path`` (lstat ``st``) is not a workdir this process may write, or None."""
    if stat.S_ISLNK(st.st_mode):
        return (f"workdir {path}: is a symlink (to {os.readlink(path)}): pass the directory "
                f"itself as --workdir")
    if not stat.S_ISDIR(st.st_mode):
        return f"workdir {path}: is not a directory: pass a directory as --workdir"
    me = os.geteuid()
    if st.st_uid != me:
        return (f"workdir {path}: owned by {_user(st.st_uid)}, not by this user "
                f"({_user(me)}): pass a workdir you own as --workdir")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        return (f"workdir {path}: mode {mode:04o} lets group or others write into it: "
                f"`chmod go-w {path}`, or pass another --workdir")
    return None


def prepare(workdir: paths.PathLike) -> None:
    """Create a missing workdir (mode 0700) and refuse one this process should not write."""
    if "[" in os.fspath(workdir):
        # Orbax finds a checkpoint's files by glob patterns built on the directory's path, where
        # "[...]" is a character class: the save succeeds and the restore fails.
        raise WorkdirError(f"workdir {os.fspath(workdir)}: holds '[', which the checkpointer "
                           f"reads as a glob character class (its checkpoints would not "
                           f"restore): pass a path without '[' as --workdir")
    if paths.is_uri(workdir):
        paths.as_path(workdir).mkdir(parents=True, exist_ok=True)
        return
    path = os.path.abspath(os.fspath(workdir))
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:  # another process of this run, or another run, was first
                pass
            st = os.lstat(path)
    except OSError as e:  # a file where a parent directory should be, no permission
        raise WorkdirError(f"workdir {path}: cannot create or read it ({e.strerror}): pass a "
                           f"directory you can write as --workdir") from None
    problem = _problem(path, st)
    if problem:
        raise WorkdirError(problem)


def _holder_text(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder not yet written"
    return (f"pid {holder.get('pid')} on host {holder.get('host')} since "
            f"{holder.get('started')}, job {holder.get('job')}")


def _read_holder(fd: int) -> dict[str, Any] | None:
    raw = os.pread(fd, 4096, 0)
    try:
        holder = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        text = raw[:80].decode(errors="replace")
        return {"pid": "?", "host": "?", "started": "?", "job": text} if raw.strip() else None
    return holder if isinstance(holder, dict) else None


class WorkdirLock:
    """One run per workdir and lock name; see the module docstring."""

    def __init__(self, workdir: paths.PathLike, name: str, job: str) -> None:
        uri = paths.is_uri(workdir)
        self.workdir = os.fspath(workdir) if uri else os.path.abspath(os.fspath(workdir))
        self.job = job
        self.path = os.path.join(self.workdir, name)
        self._fd: int | None = None

    def acquire(self) -> None:
        if paths.is_uri(self.workdir):
            _log.info("workdir %s is on an object store: no lock; run one job there at a time",
                      self.workdir)
            return
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirError(
                f"workdir {self.workdir}: in use by another run ({_holder_text(holder)}; lock "
                f"file {self.path}): wait for it to end or stop it, or pass another --workdir"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            _log.warning("workdir %s: this file system cannot lock files (%s): running without "
                         "a lock; run one job there at a time", self.workdir, e.strerror)
            return
        previous = _read_holder(fd)
        if previous:  # written by a holder that died without releasing: the kernel let go
            _log.warning("workdir %s: took over the lock of a run that is gone (%s)",
                         self.workdir, _holder_text(previous))
        self._write_holder(fd)
        self._fd = fd

    def _open(self) -> int:
        # O_NOFOLLOW: a symlink planted as the lock file must not make us write elsewhere.
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600)
        except OSError as e:  # ELOOP: the lock file is a symlink; EACCES: not ours
            if not os.path.lexists(self.path):  # the directory refuses a new file
                raise WorkdirError(f"workdir {self.workdir}: cannot create files there "
                                   f"({e.strerror}): make it writable, or pass another "
                                   f"--workdir") from None
            raise WorkdirError(f"workdir lock file {self.path}: cannot open it ({e.strerror}): "
                               f"remove it, or pass another --workdir") from None

    def _write_holder(self, fd: int) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": self.job,
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except OSError as e:  # a full disk: say so before the run fails on its first save
            os.close(fd)
            raise WorkdirError(f"workdir lock file {self.path}: cannot write it ({e.strerror}): "
                               f"free space there, or pass another --workdir") from None

    def release(self) -> None:
        """Empty the lock file (a later run then has nothing to take over) and unlock it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:  # left as it is, the next run takes it over with a log line
            pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
