"""Hostile tool calls end as error outputs within their limits, leave nothing behind and never
touch the calling process."""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time

import pytest

from meshrl.rewards import sandbox as sandbox_lib
from meshrl.rewards.sandbox import SandboxLimits, ToolSandbox
from meshrl.rewards.tools import Tools, schema_errors

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256, output_bytes=2000)


@pytest.fixture
def tool_tmp(tmp_path, monkeypatch):
    """Every temporary directory the sandbox makes lands in ``tmp_path/tools``."""
    root = tmp_path / "tools"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def run_python(code: str, limits: SandboxLimits = LIMITS):
    async def go():
        async with Tools(["python"], limits) as tools:
            t0 = time.monotonic()
            out = await tools.acall("python", {"code": code})
            return out, time.monotonic() - t0, tools.metrics()
    return asyncio.run(go())


def assert_clean(root) -> None:
    assert list(root.iterdir()) == [], list(root.iterdir())


def test_python_tool_prints_its_answer_and_may_use_its_own_directory(tool_tmp):
    out, _, _ = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 6 * 7)")
    assert out.ok and out.text == "hi 42\n"
    assert_clean(tool_tmp)


@pytest.mark.parametrize("code,error,needle", [
    ("while True:\n    pass", "crashed", "CPU or memory limit"),
    ("import os\nos.fork()", "tool_error", "os.fork is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])", "tool_error", "not allowed"),
    ("x = bytearray(8 << 30)", "tool_error", "MemoryError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 22))", "tool_error", "not allowed"),
    ("print(open('/etc/hostname').read())", "tool_error", "outside the tool's directory"),
    ("open('../escape.txt', 'w').write('x')", "tool_error", "outside the tool's directory"),
    ("import os\nos.remove('/tmp')", "tool_error", "outside the tool's directory"),
    ("while True:\n    print('x' * 100000)", "output_limit", "more than 2000 bytes"),
    ("import ctypes", "tool_error", "not allowed"),
    # A directory's descriptor would let dir_fd paths past the hook's path check.
    ("import os, sys\nfd = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\n"
     "os.open('x.pth', os.O_WRONLY | os.O_CREAT, dir_fd=fd)", "tool_error",
     "open of a directory outside"),
    ("import os\nfd = os.open(os.__file__, os.O_RDONLY)\nos.chmod(fd, 0o777)", "tool_error",
     "os.chmod outside the tool's directory"),
    ("import os\nos.setxattr('..', 'user.x', b'1')", "tool_error",
     "os.setxattr outside the tool's directory"),
    # Relative paths are checked against the working directory: it never changes, so a
    # dir_fd above a deeper one cannot resolve a path the check read as inside.
    ("import os\nroot = os.open('.', os.O_RDONLY)\nos.makedirs('a/b')\nos.chdir('a/b')\n"
     "os.open('../../../escape.txt', os.O_RDONLY, dir_fd=root)", "tool_error",
     "os.chdir is not allowed"),
    ("import os, sys\nr = sys.modules['__main__'].resource\n"
     "r.prlimit(os.getppid(), r.RLIMIT_NOFILE, (16, 16))", "tool_error",
     "limits of another process"),
    ("raise ValueError('A' * 200_000)", "output_limit", "more than 2000 bytes"),
    ("import sys, os\nos.write(int(sys.argv[1]), b'{\"ok\": true, \"output\": \"' "
     "+ b'B' * 200_000 + b'\"}\\n')", "output_limit", "more than 2000 bytes"),
])
def test_hostile_python_ends_as_an_error_output_and_leaves_nothing(tool_tmp, code, error,
                                                                   needle):
    kinds = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NOFILE)
    before = [resource.getrlimit(k) for k in kinds]
    out, took, metrics = run_python(code)
    assert not out.ok and out.error == error, out
    assert needle in out.text and out.text.startswith("error: ")
    assert took < LIMITS.wall_s + 1.0
    assert metrics["tools/errors"] == 1.0
    assert_clean(tool_tmp)
    assert not (tool_tmp.parent / "escape.txt").exists()
    # the calling process keeps its own limits
    assert [resource.getrlimit(k) for k in kinds] == before


@pytest.mark.parametrize("written", [b"not json", b'{"ok": true}', b'["ok"]'])
def test_a_line_the_tool_writes_on_the_result_pipe_is_not_taken_for_the_answer(tool_tmp,
                                                                                 written):
    out, _, _ = run_python(f"import os, sys\nos.write(int(sys.argv[1]), {written!r} + b'\\n')\n"
                           f"print('the tool ran')")
    assert out.ok and out.text == "the tool ran\n", out
    assert_clean(tool_tmp)


def test_sleeping_tool_is_stopped_at_its_wall_clock_and_its_process_group_is_gone(
        tool_tmp, monkeypatch):
    started = []

    async def spy(limits):
        started.append(await real_start(limits))
        return started[-1]
    real_start = sandbox_lib._start
    monkeypatch.setattr(sandbox_lib, "_start", spy)

    async def go():
        sandbox = ToolSandbox(SandboxLimits(wall_s=0.5, cpu_s=5))
        return await sandbox.arun("python", {"code": "import time\ntime.sleep(30)"},
                                  fresh=True), sandbox
    t0 = time.monotonic()
    out, sandbox = asyncio.run(go())
    assert out.error == "timeout" and time.monotonic() - t0 < 3.0
    assert sandbox.counters["timeouts"] == 1
    with pytest.raises(ProcessLookupError):
        os.killpg(started[0].proc.pid, 0)
    assert_clean(tool_tmp)


def test_a_long_answer_under_the_escape_room_is_cut_to_the_output_cap(tool_tmp):
    out, _, _ = run_python("raise ValueError('A' * 5000)")
    assert not out.ok and out.error == "tool_error"
    assert out.text == "error: " + ("ValueError: " + "A" * 5000)[:LIMITS.output_bytes]


def _landlock() -> bool:
    """Whether a process here can confine itself with Landlock (asked of a throwaway one)."""
    import subprocess
    import sys

    probe = ("import tempfile\nfrom meshrl.rewards.sandbox_child import confine_writes\n"
             "with tempfile.TemporaryDirectory() as d:\n    print(confine_writes(d))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not _landlock(), reason="the kernel has no Landlock: special files made "
                                            "without an audit event are not confined")
@pytest.mark.parametrize("make", ["os.mkfifo(p)", "os.mknod(p)"])
def test_special_files_outside_the_directory_are_refused_by_the_kernel(tool_tmp, make):
    target = tool_tmp.parent / "fifo_outside"
    out, _, _ = run_python(f"import os\np = {str(target)!r}\n{make}")

    assert not out.ok and "Permission denied" in out.text, out
    assert not target.exists()
    assert_clean(tool_tmp)


def test_calculator_is_exact_and_bad_expressions_are_errors_not_crashes(tool_tmp):
    async def go():
        async with Tools(["calculator"], LIMITS) as tools:
            return [await tools.acall("calculator", {"expression": e})
                    for e in ("123456 * 789", "7 / 2", "__import__('os')", "9**9**9")]
    exact, frac, hostile, huge = asyncio.run(go())
    assert exact.ok and exact.text == str(123456 * 789)
    assert frac.ok and frac.text == "3.5"
    assert not hostile.ok and hostile.error == "tool_error"
    assert not huge.ok and huge.error == "tool_error"
    assert_clean(tool_tmp)


def test_calls_with_bad_arguments_or_unknown_tools_are_rejected_before_running(tool_tmp):
    async def go():
        async with Tools(["calculator"], LIMITS) as tools:
            return (await tools.acall("calculator", {"expr": "1+1"}),
                    await tools.acall("python", {"code": "print(1)"}),
                    await tools.acall("calculator", "1+1"), tools.sandbox.counters["calls"])
    missing, unknown, not_object, calls = asyncio.run(go())
    assert missing.error == "invalid" and "missing 'expression'" in missing.text
    assert "unknown field 'expr'" in missing.text
    assert unknown.error == "invalid" and "unknown tool 'python'" in unknown.text
    assert not_object.error == "invalid" and "type object" in not_object.text
    assert calls == 0


def test_schema_errors_check_types_enums_and_lengths():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0}, "mode": {"enum": ["a", "b"]},
        "s": {"type": "string", "maxLength": 3}}, "required": ["n"]}
    assert schema_errors(schema, {"n": 1, "mode": "a", "s": "abc"}) == []
    errors = schema_errors(schema, {"n": True, "mode": "c", "s": "abcd"})
    assert len(errors) == 3, errors
    assert schema_errors(schema, {"n": -1}) == ["arguments.n must be minimum 0, got -1"]


def test_unknown_tool_names_fail_at_construction():
    with pytest.raises(ValueError, match="unknown; built-in tools are"):
        Tools(["shell"])


def test_a_crashed_shared_calculator_is_replaced_on_the_next_call(tool_tmp):
    async def go():
        async with Tools(["calculator"], LIMITS) as tools:
            first = await tools.acall("calculator", {"expression": "1+1"})
            os.killpg(tools.sandbox._shared.proc.pid, 9)
            await tools.sandbox._shared.proc.wait()
            return first, await tools.acall("calculator", {"expression": "2+2"})
    first, second = asyncio.run(go())
    assert first.text == "2" and second.ok and second.text == "4"
    assert_clean(tool_tmp)


def test_a_call_cancelled_while_it_waits_leaves_no_answer_for_the_next_call(tool_tmp,
                                                                          monkeypatch):
    waiting = asyncio.Event()
    answer = ToolSandbox._answer

    async def signalling(self, child):
        waiting.set()  # the request is written; its answer is on its way
        return await answer(self, child)

    monkeypatch.setattr(ToolSandbox, "_answer", signalling)

    async def go():
        async with Tools(["calculator"], LIMITS) as tools:
            call = asyncio.create_task(tools.acall("calculator", {"expression": "2+2"}))
            await waiting.wait()
            call.cancel()  # as gather_or_cancel cancels a failed episode's siblings
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0.2)  # the cancelled call's answer would arrive by now
            return [(await tools.acall("calculator", {"expression": e})).text
                    for e in ("3*3", "5*5")]
    assert asyncio.run(go()) == ["9", "25"]
    assert_clean(tool_tmp)


def test_a_child_whose_parent_is_gone_removes_its_own_directory(tool_tmp):
    async def go():
        child = await sandbox_lib._start(LIMITS)
        child.proc.stdin.close()  # what the child sees when its parent dies
        await asyncio.wait_for(child.proc.wait(), 5)
        return child
    child = asyncio.run(go())
    assert child.proc.returncode == 0
    assert_clean(tool_tmp)


def test_a_flooding_tool_is_reaped_even_when_its_pipe_was_left_full(tool_tmp):
    """Stopping at the output cap leaves the pipe paused with unread bytes; closing must still
    reap the child rather than wait for an EOF nobody reads."""
    async def go():
        async with Tools(["python"], LIMITS) as tools:
            return [await tools.acall("python", {"code": "while True:\n    print('x' * 100000)"})
                    for _ in range(3)]
    t0 = time.monotonic()
    outs = asyncio.run(asyncio.wait_for(go(), 3 * (LIMITS.wall_s + 1.0)))
    assert [o.error for o in outs] == ["output_limit"] * 3
    assert time.monotonic() - t0 < 3 * (LIMITS.wall_s + 1.0)
    assert_clean(tool_tmp)


def test_a_child_whose_pipes_never_close_is_dropped_after_the_close_bound(tool_tmp, monkeypatch):
    async def never(self):
        await asyncio.sleep(3600)
    monkeypatch.setattr(sandbox_lib._Child, "_drain_and_wait", never)
    monkeypatch.setattr(sandbox_lib, "CLOSE_S", 0.2)

    async def go():
        child = await sandbox_lib._start(LIMITS)
        t0 = time.monotonic()
        await child.close()
        return child, time.monotonic() - t0
    child, took = asyncio.run(asyncio.wait_for(go(), 10))
    assert took < 2.0
    with pytest.raises(ProcessLookupError):
        os.killpg(child.proc.pid, 0)
    assert_clean(tool_tmp)


BURN_CPU = ("import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n"
            "    pass\n")


def _shared_calls(codes: list[str], limits: SandboxLimits) -> tuple[list, list[int]]:
    """Each code run on the sandbox's shared child; (the outputs, the child's pid per call)."""
    async def go():
        sandbox = ToolSandbox(limits)
        outs, pids = [], []
        try:
            for code in codes:
                outs.append(await sandbox.arun("python", {"code": code}, fresh=False))
                pids.append(sandbox._shared.proc.pid if sandbox._shared else -1)
        finally:
            await sandbox.aclose()
        return outs, pids
    return asyncio.run(go())


def test_the_shared_child_gives_every_call_its_own_cpu_budget(monkeypatch):
    # RLIMIT_CPU counts a process's whole life: calls that each stay under cpu_s must not be
    # killed because earlier ones on the same child used it up. With a lifetime of two calls'
    # worth the child retires before a call could find less than cpu_s left.
    monkeypatch.setattr(sandbox_lib, "SHARED_CHILD_CALLS", 2)
    limits = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=256)

    outs, pids = _shared_calls([BURN_CPU.format(s=0.7)] * 3, limits)

    assert [o.ok for o in outs] == [True] * 3, outs
    assert -1 in pids  # a child retired (after the first or second call, by startup CPU)


def test_a_call_past_cpu_s_on_the_shared_child_is_still_killed():
    limits = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=256)

    outs, _ = _shared_calls([BURN_CPU.format(s=0.2), BURN_CPU.format(s=3)], limits)

    assert outs[0].ok and (outs[1].ok, outs[1].error) == (False, "crashed")
