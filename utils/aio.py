"""Running a job's coroutine to completion from synchronous code, inside a notebook too."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``. In a thread that already runs an event loop (a Jupyter or Colab
    cell, where ``asyncio.run`` refuses to nest) the same ``asyncio.run`` runs in a helper
    thread while the caller waits; an interrupt of the waiting caller (``KeyboardInterrupt``)
    cancels ``coro``, waits for its clean-up, then propagates."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    started, done = threading.Event(), threading.Event()
    state: dict[str, Any] = {}

    async def main() -> T:
        state["loop"], state["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await coro

    def target() -> None:
        try:
            state["result"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            state["error"] = e
        finally:
            started.set()  # asyncio.run failed before main() ran
            done.set()

    thread = threading.Thread(target=target, name="meshrl-run-sync")
    thread.start()
    # Timed waits on an Event, not Thread.join: an interrupt is seen however it arrives, and a
    # join that an interrupt cut short can return early from the next join (CPython).
    try:
        while not done.wait(0.25):
            pass
    except KeyboardInterrupt:
        started.wait()
        if "task" in state:
            try:
                state["loop"].call_soon_threadsafe(state["task"].cancel)
            except RuntimeError:  # the loop already closed: nothing left to cancel
                pass
        done.wait()
        raise
    thread.join()
    if "error" in state:
        raise state["error"]
    return state["result"]


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` of ``aws``, except that when one raises, the others are cancelled and
    awaited before the exception propagates (plain ``gather`` leaves them running, unowned:
    episodes of a failed group would go on generating). Not asyncio.TaskGroup: it raises an
    ExceptionGroup, and callers branch on the error's own type (a UserError ends a run)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
