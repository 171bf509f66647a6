"""The tool sandbox's child process (stdlib only: run as ``python -I -S sandbox_child.py``).

It reads one JSON request per line on stdin, ``{"tool": ..., "arguments": {...}}``, and answers
each with one JSON line ``{"ok": bool, "output": str}`` on its result pipe (the descriptor its
first argument names). Before it reads anything it locks itself down, in this order (the
parent, ``rewards/sandbox.py``, adds the wall clock, the output cap, killing the process group
and removing the temporary directory):

1. ``setrlimit``: address space (``memory_mb``), CPU seconds, file size (``file_bytes``), no core
   files, open files; for non-root users also ``RLIMIT_NPROC`` = 0 (no new process). The kernel
   enforces these whatever the code does, native code included.
2. ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` where the kernel allows it: a network namespace
   with no interfaces, so nothing is reachable even from native code. Where it is refused the
   audit hook below still blocks every socket.
3. A ``sys.addaudithook`` hook (it cannot be removed once added) that refuses sockets, process
   creation (fork, exec, spawn, ``subprocess``, ``os.system``), signals to other processes,
   ``ctypes`` and the modules that bypass the hook (``_posixsubprocess``, ``_ctypes``), and any
   file-system access outside the working directory (the per-call temporary directory) except
   reads of the Python installation (imports).

The audit hook stops Python code; it is not a boundary against native code a tool could load,
which is why loading native code (``ctypes``) is refused and the rlimits come first.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import resource
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_BLOCKED_EVENTS = ("socket.", "subprocess.", "ctypes.", "os.fork", "os.forkpty", "os.exec",
                   "os.posix_spawn", "os.spawn", "os.system", "os.kill", "os.killpg",
                   "os.startfile", "signal.pthread_kill", "pty.", "webbrowser.", "urllib.",
                   "http.", "ftplib.", "smtplib.", "winreg.")
_BLOCKED_MODULES = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket",
                              "mmap", "_multiprocessing", "multiprocessing", "resource"})
_PATH_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "os.remove", "os.rename",
                          "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "os.chdir", "os.chroot",
                          "shutil.rmtree", "shutil.copyfile", "shutil.move", "glob.glob"})
_READ_ONLY_EVENTS = frozenset({"open", "os.listdir", "os.scandir", "glob.glob"})


def set_limits(limits: dict) -> None:
    mib = 1 << 20
    caps = {resource.RLIMIT_CORE: 0, resource.RLIMIT_CPU: int(limits["cpu_s"]),
            resource.RLIMIT_FSIZE: int(limits["file_bytes"]), resource.RLIMIT_NOFILE: 64}
    if limits["memory_mb"] > 0:
        caps[resource.RLIMIT_AS] = int(limits["memory_mb"]) * mib
    if os.getuid() != 0:  # the kernel does not apply RLIMIT_NPROC to root
        caps[resource.RLIMIT_NPROC] = 0
    for what, value in caps.items():
        resource.setrlimit(what, (value, value))


def isolate_network() -> bool:
    """True when this process now has a network namespace of its own (no interfaces)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


def _inside(path: object, roots: tuple[str, ...]) -> bool:
    if isinstance(path, int):  # an already open descriptor: its open was checked
        return True
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
        if event == "import" and args and args[0].split(".")[0] in _BLOCKED_MODULES:
            raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
        if event in _PATH_EVENTS and args:
            writing = event != "open" or _writes(args)
            roots = work if writing or event not in _READ_ONLY_EVENTS else work + python
            for path in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if not _inside(path, roots):
                    raise PermissionError(f"sandbox: {event} outside the tool's directory: "
                                          f"{path!r}")
    return hook


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
    for name in ("ctypes", "_ctypes", "resource"):  # a tool's import must pass the hook
        sys.modules.pop(name, None)
    sys.addaudithook(make_hook(os.getcwd()))
    result.write(json.dumps({"ready": True, "netns": netns}) + "\n")
    result.flush()
    for line in sys.stdin:
        request = json.loads(line)
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
        # Written in pieces by the parent's reader, which stops at its output cap.
        result.write(json.dumps(answer) + "\n")
        result.flush()
    # stdin closed: the call is done, or the parent died without cleaning up (killed): remove
    # this call's directory either way (the parent ignores one already gone).
    import shutil

    shutil.rmtree(os.getcwd(), ignore_errors=True)


if __name__ == "__main__":
    serve(os.fdopen(int(sys.argv[1]), "w", encoding="utf-8"))
