"""The tool sandbox's child process (stdlib only: run as ``python -I -S sandbox_child.py``).

It reads one JSON request per line on stdin, ``{"tool": ..., "arguments": {...}}``, and answers
each with one JSON line ``{"ok": bool, "output": str}`` on its result pipe (the descriptor its
first argument names). Before it reads anything it locks itself down, in this order (the
parent, ``rewards/sandbox.py``, adds the wall clock, the output cap, killing the process group
and removing the temporary directory):

1. ``setrlimit``: address space (``memory_mb``), CPU seconds (``cpu_s`` a call, within the
   child's ``lifetime_cpu_s``), file size (``file_bytes``), no core files, open files; for non-root users also ``RLIMIT_NPROC`` = 0 (no new process). The kernel
   enforces these whatever the code does, native code included.
2. ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` where the kernel allows it: a network namespace
   with no interfaces, so nothing is reachable even from native code. Where it is refused the
   audit hook below still blocks every socket.
3. Landlock where the kernel has it (Linux 5.13+): no file is written, created, truncated,
   renamed or removed outside the working directory, whatever the code does (special files
   and ``dir_fd`` paths included; the parent directory's empty directories may be removed, so
   that a child whose parent died removes its own).
4. A ``sys.addaudithook`` hook (it cannot be removed once added) that refuses sockets, process
   creation (fork, exec, spawn, ``subprocess``, ``os.system``), signals to other processes,
   ``ctypes`` and the modules that bypass the hook (``_posixsubprocess``, ``_ctypes``), changing
   the working directory, setting another process's limits (``prlimit``), and any
   file-system access outside the working directory (the per-call temporary directory) except
   reads of the Python installation (imports); no directory outside it is opened (its
   descriptor would let ``dir_fd`` paths past the check), and a write through a descriptor is
   checked against the file it names.

The audit hook stops Python code; it is not a boundary against native code a tool could load,
which is why loading native code (``ctypes``) is refused and the rlimits come first. Some
calls raise no audit event (``os.mkfifo``, ``os.mknod``): without Landlock they are not
confined.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import resource
import struct
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
# ``os.chdir`` (``fchdir`` too): the path check resolves relative paths against the working
# directory, and a ``dir_fd`` path against a directory above a changed one would get past it.
_BLOCKED_EVENTS = ("socket.", "subprocess.", "ctypes.", "os.fork", "os.forkpty", "os.exec",
                   "os.posix_spawn", "os.spawn", "os.system", "os.kill", "os.killpg",
                   "os.startfile", "signal.pthread_kill", "pty.", "webbrowser.", "urllib.",
                   "http.", "ftplib.", "smtplib.", "winreg.", "os.chdir", "os.chroot")
_BLOCKED_MODULES = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket",
                              "mmap", "_multiprocessing", "multiprocessing", "resource"})
_PATH_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "os.remove", "os.rename",
                          "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "os.chdir", "os.chroot",
                          "shutil.rmtree", "shutil.copyfile", "shutil.move", "glob.glob",
                          "os.setxattr", "os.removexattr", "os.getxattr", "os.listxattr",
                          "os.chflags"})
_READ_ONLY_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "glob.glob", "os.getxattr",
                               "os.listxattr"})
# Landlock (include/uapi/linux/landlock.h): syscall numbers (the same on every architecture),
# and the file-system rights it handles: writing, truncating, making and removing entries.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_REMOVE_DIR = 1 << 4
_LL_WRITE = (1 << 1) | _LL_REMOVE_DIR | sum(1 << b for b in range(5, 13))
_LL_REFER, _LL_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_PR_SET_NO_NEW_PRIVS = 38


def set_limits(limits: dict) -> None:
    """Soft and hard limits alike, but CPU: the soft limit is one call's ``cpu_s``, the hard one
    the child's lifetime budget ``lifetime_cpu_s`` (a shared child serves many calls; a child
    of one call has ``lifetime_cpu_s = cpu_s``)."""
    mib = 1 << 20
    caps = {resource.RLIMIT_CORE: 0, resource.RLIMIT_FSIZE: int(limits["file_bytes"]),
            resource.RLIMIT_NOFILE: 64}
    if limits["memory_mb"] > 0:
        caps[resource.RLIMIT_AS] = int(limits["memory_mb"]) * mib
    if os.getuid() != 0:  # the kernel does not apply RLIMIT_NPROC to root
        caps[resource.RLIMIT_NPROC] = 0
    for what, value in caps.items():
        resource.setrlimit(what, (value, value))
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, max(cpu, int(limits.get("lifetime_cpu_s", cpu)))))


def cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def next_call_budget(cpu_s: int) -> bool:
    """Give the next call ``cpu_s`` CPU seconds from now (the soft limit); False when the
    lifetime budget (the hard limit) has less than that left: the child should retire."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(cpu_used()) + cpu_s
    if soft > hard:
        return False
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    return True


def isolate_network() -> bool:
    """True when this process now has a network namespace of its own (no interfaces)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


def confine_writes(workdir: str) -> bool:
    """Landlock: from now on this process writes, creates, truncates, renames and removes only
    beneath ``workdir`` (and removes empty directories beside it). True when the kernel
    enforces it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(ctypes.c_long(_LL_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return False
    handled = _LL_WRITE | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    attr = ctypes.c_uint64(handled)  # handled_access_fs: the first field of every ABI's struct
    ruleset = libc.syscall(ctypes.c_long(_LL_CREATE), ctypes.byref(attr), ctypes.c_size_t(8),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        for path, allowed in ((workdir, handled), (os.path.dirname(workdir), _LL_REMOVE_DIR)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                if libc.syscall(ctypes.c_long(_LL_ADD_RULE), ctypes.c_long(ruleset),
                                ctypes.c_long(1), rule, ctypes.c_uint32(0)) != 0:
                    return False
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return False
        return libc.syscall(ctypes.c_long(_LL_RESTRICT), ctypes.c_long(ruleset),
                            ctypes.c_uint32(0)) == 0
    finally:
        os.close(ruleset)


def _inside(path: object, roots: tuple[str, ...], writing: bool) -> bool:
    if isinstance(path, int):
        if not writing:  # reading through an open descriptor: its open was checked
            return True
        try:  # a write through a descriptor (chmod, truncate, ...): the file it names
            path = os.readlink(f"/proc/self/fd/{path}")
        except OSError:
            return False
    try:
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def make_hook(workdir: str):
    """The audit hook for a process confined to ``workdir``."""
    work = (os.path.realpath(workdir),)
    python = tuple({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix,
                                                   os.path.dirname(os.__file__))})

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "resource.prlimit" and args and args[0] not in (0, os.getpid()):
            raise PermissionError("sandbox: limits of another process are not the tool's")
        if event == "import" and args and args[0].split(".")[0] in _BLOCKED_MODULES:
            raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
        if event in _PATH_EVENTS and args:
            writing = event not in _READ_ONLY_EVENTS or (event == "open" and _writes(args))
            roots = work if writing else work + python
            for path in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if not _inside(path, roots, writing):
                    raise PermissionError(f"sandbox: {event} outside the tool's directory: "
                                          f"{path!r}")
            if event == "open" and not _inside(args[0], work, True) and _is_dir(args[0]):
                raise PermissionError(f"sandbox: open of a directory outside the tool's "
                                      f"directory: {args[0]!r}")
    return hook


def _is_dir(path: object) -> bool:
    try:
        return not isinstance(path, int) and os.path.isdir(os.fsdecode(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _writes(args: tuple) -> bool:
    mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    return any(c in mode for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _load_calculator():
    """``rewards/safe_arith.py`` (stdlib only), loaded from its file: this process has no
    site-packages (``-S``), so ``meshrl`` is not importable here."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safe_arith.py")
    spec = importlib.util.spec_from_file_location("safe_arith", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def calculator(arguments: dict, arith) -> str:
    value, _ = arith.evaluate(str(arguments["expression"]), allow_pow=True)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def python_tool(arguments: dict) -> str:
    """Run ``code``; what it prints goes to stdout/stderr, pipes the parent reads up to its
    output cap (a tool printing gigabytes is stopped there, not buffered here)."""
    try:
        # Running the model's code is this tool's purpose; it runs here only after the child
        # has locked itself down (rlimits, network namespace, audit hook, temp-dir cwd).
        exec(compile(str(arguments["code"]), "<tool>", "exec"), {"__name__": "__tool__"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return ""


def serve(result: io.TextIOBase) -> None:
    arith = _load_calculator()  # before the hook: it reads from the repository
    limits = json.loads(sys.stdin.readline())
    set_limits(limits)
    netns = isolate_network() if limits.get("netns", True) else False
    landlock = confine_writes(os.getcwd())
    for name in ("ctypes", "_ctypes", "resource"):  # a tool's import must pass the hook
        sys.modules.pop(name, None)
    sys.addaudithook(make_hook(os.getcwd()))
    result.write(json.dumps({"ready": True, "netns": netns, "landlock": landlock}) + "\n")
    result.flush()
    for line in sys.stdin:
        request = json.loads(line)
        next_call_budget(int(limits["cpu_s"]))
        try:
            if request["tool"] == "calculator":
                answer = {"ok": True, "output": calculator(request["arguments"], arith)}
            elif request["tool"] == "python":
                answer = {"ok": True, "output": python_tool(request["arguments"])}
            else:
                answer = {"ok": False, "output": f"unknown tool {request['tool']!r}"}
        except BaseException as e:  # noqa: BLE001  (every failure is the tool's answer)
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            answer = {"ok": False, "output": tail}
        # The parent starts another child before a call this one could not give cpu_s.
        answer["retire"] = math.ceil(cpu_used()) + int(limits["cpu_s"]) > resource.getrlimit(
            resource.RLIMIT_CPU)[1]
        # Written in pieces by the parent's reader, which stops at its output cap.
        result.write(json.dumps(answer) + "\n")
        result.flush()
    # stdin closed: the call is done, or the parent died without cleaning up (killed): remove
    # this call's directory either way (the parent ignores one already gone).
    import shutil

    shutil.rmtree(os.getcwd(), ignore_errors=True)


if __name__ == "__main__":
    serve(os.fdopen(int(sys.argv[1]), "w", encoding="utf-8"))
