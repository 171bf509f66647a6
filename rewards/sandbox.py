"""Run tool calls outside the trainer process, under limits, and turn every failure into text.

Each call runs in a child process (``rewards/sandbox_child.py``, started as ``python -I -S``:
no site-packages, no environment variables but a minimal set) in its own process group (setsid), with its
working directory a fresh temporary directory. The child locks itself down before it reads a
request (rlimits, a network namespace where the kernel allows one, an audit hook; see its
docstring). This side enforces what the child cannot enforce on itself:

* wall clock: ``wall_s`` per call; then the whole process group is killed (``SIGKILL``);
* output: stdout and stderr together are read up to ``output_bytes``; one byte more and the
  group is killed, so a tool printing gigabytes costs a pipe buffer, not memory;
* cleanup: after every call the process group is killed (a forked grandchild, were one to get
  through, dies with it) and the temporary directory is removed.

A fresh process per call (``fresh=True``, the python tool) keeps calls from seeing each other's
state; pure tools (the calculator) share one long-lived child, replaced when a call kills it or
runs out of time. Nothing here raises on a tool's behaviour: the caller gets a ``ToolOutput``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import weakref
from typing import Any

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
CLOSE_S = 5.0  # how long a killed child's pipes may take to close before they are dropped


# The shared child's lifetime CPU budget in calls' worth of cpu_s: RLIMIT_CPU counts a
# process's whole life, so each call gets cpu_s more and the child retires (answering
# "retire") before a call could find less left.
SHARED_CHILD_CALLS = 100


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of a tool's child process."""

    wall_s: float = 5.0  # wall clock per call; the process group is killed after it
    cpu_s: int = 5  # RLIMIT_CPU of the child (SIGXCPU, then SIGKILL)
    memory_mb: int = 512  # RLIMIT_AS of the child (an allocation beyond it fails)
    output_bytes: int = 16_384  # stdout + stderr kept; more kills the call
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file the tool may write
    netns: bool = True  # also unshare a network namespace where the kernel allows it

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")

    def child_json(self, shared: bool = False) -> str:
        """The child's limits; a ``shared`` child (many calls) may spend ``cpu_s`` on each of
        ``SHARED_CHILD_CALLS`` calls before it retires, a fresh one ``cpu_s`` on its one."""
        lifetime = self.cpu_s * (SHARED_CHILD_CALLS if shared else 1)
        return json.dumps({"cpu_s": self.cpu_s, "lifetime_cpu_s": lifetime,
                           "memory_mb": self.memory_mb, "file_bytes": self.file_bytes,
                           "netns": self.netns})


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """A tool call's result: ``ok`` and its text, or the error the model is shown.
    ``error``: '' | 'invalid' | 'tool_error' | 'timeout' | 'output_limit' | 'crashed'."""

    ok: bool
    text: str
    error: str = ""


class _Child:
    """One started child: its process, the pipe of its answers, its temporary directory."""

    def __init__(self, proc: asyncio.subprocess.Process, answers: asyncio.StreamReader,
                 workdir: str) -> None:
        self.proc, self.answers, self.workdir = proc, answers, workdir
        self.netns = False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def close(self) -> None:
        """Kill the group, then reap it. ``wait()`` returns only once the output pipe reports
        EOF, and a pipe whose reader stopped at the output cap is paused and never does: drain
        it. A holder of the pipe outside the group cannot stall this past ``CLOSE_S``."""
        self.kill()
        try:
            await asyncio.wait_for(self._drain_and_wait(), CLOSE_S)
        except asyncio.TimeoutError:
            self.proc._transport.close()  # noqa: SLF001 -- asyncio has no public way to drop the pipes
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def _drain_and_wait(self) -> None:
        if self.proc.stdout is not None:
            while await self.proc.stdout.read(65536):
                pass
        await self.proc.wait()


async def _start(limits: SandboxLimits, shared: bool = False) -> _Child:
    workdir = tempfile.mkdtemp(prefix="meshrl-tool-")
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", CHILD, str(write_fd), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                 "PYTHONDONTWRITEBYTECODE": "1"},
            pass_fds=(write_fd,), start_new_session=True)
    except BaseException:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        os.close(write_fd)
    loop = asyncio.get_running_loop()
    answers = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(answers),
                                 os.fdopen(read_fd, "rb"))
    child = _Child(proc, answers, workdir)
    assert proc.stdin is not None
    proc.stdin.write((limits.child_json(shared) + "\n").encode())
    return child


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes | None:
    """Everything ``stream`` yields until EOF, or None as soon as it passes ``cap`` bytes."""
    out = bytearray()
    while chunk := await stream.read(65536):
        out += chunk
        if len(out) > cap:
            return None
    return bytes(out)


def _death(proc: asyncio.subprocess.Process) -> str:
    code = proc.returncode
    if code in (-signal.SIGKILL, -signal.SIGXCPU):  # the kernel's answer to RLIMIT_CPU
        return f"was killed by {signal.Signals(-code).name} (its CPU or memory limit)"
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _kill_all(children: list[_Child]) -> None:
    for child in children:
        child.kill()
        shutil.rmtree(child.workdir, ignore_errors=True)
    children.clear()


class ToolSandbox:
    """``await sandbox.arun(tool, arguments)`` -> ``ToolOutput``; ``await sandbox.aclose()``.

    ``counters`` count calls and each kind of error."""

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits
        self.counters: dict[str, int] = {"calls": 0, "errors": 0, "timeouts": 0,
                                         "output_limits": 0, "crashes": 0}
        self._shared: _Child | None = None
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The shared child, for the finalizer: it dies with the sandbox or at exit.
        self._live: list[_Child] = []
        weakref.finalize(self, _kill_all, self._live)

    async def arun(self, tool: str, arguments: dict[str, Any], *, fresh: bool) -> ToolOutput:
        self.counters["calls"] += 1
        out = await (self._fresh(tool, arguments) if fresh else self._on_shared(tool, arguments))
        if not out.ok:
            self.counters["errors"] += 1
            key = {"timeout": "timeouts", "output_limit": "output_limits",
                   "crashed": "crashes"}.get(out.error)
            if key:
                self.counters[key] += 1
        return out

    def metrics(self) -> dict[str, float]:
        return {f"tools/{k}": float(v) for k, v in self.counters.items()}

    async def _fresh(self, tool: str, arguments: dict[str, Any]) -> ToolOutput:
        child = await _start(self.limits)
        try:
            assert child.proc.stdin is not None and child.proc.stdout is not None
            child.proc.stdin.write((json.dumps({"tool": tool, "arguments": arguments})
                                    + "\n").encode())
            child.proc.stdin.close()
            return await self._finish(child, _read_capped(child.proc.stdout,
                                                          self.limits.output_bytes))
        finally:
            await child.close()

    async def _finish(self, child: _Child, printed: Any) -> ToolOutput:
        """The call's answer and what it printed, within the wall clock and the output cap."""
        async def both() -> tuple[bytes | None, list[dict]]:
            text = await printed
            if text is None:
                return None, []
            # The answer line is the tool's to write too (its result descriptor): capped as
            # its output is, with room for JSON escapes (at most 6 bytes a character).
            answers = await _read_capped(child.answers, 6 * self.limits.output_bytes + 4096)
            if answers is None:
                return None, []
            lines = [a for x in answers.splitlines() if (a := _answer_line(x)) is not None]
            await child.proc.wait()
            return text, lines
        try:
            text, lines = await asyncio.wait_for(both(), self.limits.wall_s)
        except asyncio.TimeoutError:
            return ToolOutput(False, f"error: the tool ran past its {self.limits.wall_s:g} s "
                                     f"limit and was stopped", "timeout")
        if text is None:
            return ToolOutput(False, f"error: the tool printed more than "
                                     f"{self.limits.output_bytes} bytes and was stopped",
                              "output_limit")
        # The child writes its answer after the tool's code has run: the last one is the child's
        # (a line the tool wrote itself before is only more of its own output).
        answer = lines[-1] if lines else None
        printed_text = text.decode("utf-8", errors="replace")
        if answer is None:
            return ToolOutput(False, f"error: the tool process {_death(child.proc)}"
                                     f"{': ' + printed_text[-500:] if printed_text else ''}",
                              "crashed")
        body = (printed_text + answer["output"])[:self.limits.output_bytes]
        return ToolOutput(bool(answer["ok"]), body if answer["ok"] else f"error: {body}",
                          "" if answer["ok"] else "tool_error")

    def _bind(self) -> None:
        """The shared child's pipes belong to the event loop that started it: on another loop
        (a later ``asyncio.run``) it is killed and replaced."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._shared is not None:
                self._shared.kill()
                shutil.rmtree(self._shared.workdir, ignore_errors=True)
                self._shared = None
                self._live.clear()
            self._loop, self._lock = loop, asyncio.Lock()

    async def _on_shared(self, tool: str, arguments: dict[str, Any]) -> ToolOutput:
        self._bind()
        async with self._lock:  # one call at a time on the shared child
            if self._shared is None or self._shared.proc.returncode is not None:
                if self._shared is not None:
                    await self._shared.close()
                self._shared = await _start(self.limits, shared=True)
                self._live[:] = [self._shared]
            child = self._shared
            assert child.proc.stdin is not None
            child.proc.stdin.write((json.dumps({"tool": tool, "arguments": arguments})
                                    + "\n").encode())
            try:
                line = await asyncio.wait_for(self._answer(child), self.limits.wall_s)
            except asyncio.TimeoutError:
                await self._drop_shared()
                return ToolOutput(False, f"error: the tool ran past its {self.limits.wall_s:g} "
                                         f"s limit and was stopped", "timeout")
            except BaseException:
                # Cancelled (a sibling episode failed): this call's answer would stay in the
                # pipe and reach the next call as its own. The child goes before the lock does.
                self._shared = None
                child.kill()
                await asyncio.shield(child.close())
                raise
            if line is None:
                await self._drop_shared()
                return ToolOutput(False, "error: the tool process died", "crashed")
            if line.get("retire"):
                await self._drop_shared()
            text = line["output"][:self.limits.output_bytes]
            return ToolOutput(bool(line["ok"]), text if line["ok"] else f"error: {text}",
                              "" if line["ok"] else "tool_error")

    async def _answer(self, child: _Child) -> dict | None:
        while raw := await child.answers.readline():
            if (line := _answer_line(raw)) is not None:
                return line
        return None

    async def _drop_shared(self) -> None:
        if self._shared is not None:
            await self._shared.close()
            self._shared = None
            self._live.clear()

    async def aclose(self) -> None:
        self._bind()
        async with self._lock:
            await self._drop_shared()


def _answer_line(raw: bytes | str) -> dict | None:
    """A line of the result pipe as the child's answer (``ok``: bool, ``output``: str), or None
    for anything else: the pipe is the tool's to write too, and what it writes must not raise
    into the episode."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    if isinstance(line, dict) and isinstance(line.get("ok"), bool) and isinstance(
            line.get("output"), str):
        return line
    return None
