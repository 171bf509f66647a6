"""``run_sync`` runs a coroutine from synchronous code, inside a running event loop too (a
notebook cell), and an interrupt of the waiting caller cancels it cleanly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from meshrl.utils.aio import run_sync


async def _thread_name() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


async def _fail() -> None:
    await asyncio.sleep(0)
    raise ValueError("from the coroutine")


def test_run_sync_without_a_running_loop_runs_in_the_callers_thread():
    assert run_sync(_thread_name()) == threading.current_thread().name


def test_run_sync_inside_a_running_loop_returns_the_result_from_a_helper_thread():
    async def cell() -> str:  # synchronous code called from a running loop, as in Jupyter
        return run_sync(_thread_name())

    assert asyncio.run(cell()) == "meshrl-run-sync"


def test_run_sync_inside_a_running_loop_raises_the_coroutines_error():
    async def cell() -> None:
        run_sync(_fail())

    with pytest.raises(ValueError, match="from the coroutine"):
        asyncio.run(cell())


# A process of its own: a stray KeyboardInterrupt must never reach the pytest process.
_INTERRUPT = r"""
import asyncio, json, os, signal, threading, time
from meshrl.utils.aio import run_sync

started, events = threading.Event(), []

async def job():
    started.set()
    try:
        await asyncio.sleep(30)
        events.append("finished")
    except asyncio.CancelledError:
        events.append("cancelled")
        raise
    finally:
        events.append("cleaned up")

async def cell():
    run_sync(job())

def interrupt():
    started.wait()
    time.sleep(0.2)  # the caller is waiting in run_sync by now
    os.kill(os.getpid(), signal.SIGINT)  # as a notebook's interrupt button does

# A shell that starts this in the background (``cmd &``) ignores SIGINT, and Python then
# keeps it ignored; a kernel raises KeyboardInterrupt on it, so install that explicitly.
signal.signal(signal.SIGINT, signal.default_int_handler)
threading.Thread(target=interrupt, daemon=True).start()
loop = asyncio.new_event_loop()  # a kernel's loop: SIGINT raises KeyboardInterrupt (no Runner)
t0 = time.perf_counter()
try:
    loop.run_until_complete(cell())
except KeyboardInterrupt:
    events.append("interrupted")
print(json.dumps({"events": events, "seconds": time.perf_counter() - t0}))
"""


def test_interrupt_while_waiting_cancels_the_coroutine_and_waits_for_its_clean_up():
    out = subprocess.run([sys.executable, "-c", _INTERRUPT], capture_output=True, text=True,
                         timeout=60, check=True)

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["events"] == ["cancelled", "cleaned up", "interrupted"]
    assert report["seconds"] < 10
