"""A hang watchdog: when no step completes within ``timeout_s`` (``first_timeout_s`` before the
first one, which compiles), report and exit.

A process stuck in a collective that another process never joins cannot be interrupted from
Python, so the report is the only way out: the watchdog thread logs the last completed step and
the last program this process launched, dumps every thread's stack with ``faulthandler`` to
stderr, and ends the process with ``EXIT_HANG`` (``os._exit``: no cleanup that could hang too).
A launcher or scheduler then sees a failed process instead of a silent hang. One watchdog per
process; each process times out on its own, so every process of a hung job writes its report.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

from meshrl.utils.log import get_logger

EXIT_HANG = 124  # the exit code of timeout(1), which schedulers already read as "timed out"
_log = get_logger("watchdog")


def _exit_now() -> None:
    sys.stderr.flush()
    os._exit(EXIT_HANG)


class Watchdog:
    """Arm with ``start()``; ``launched(program)`` before each program, ``completed(step)``
    after each step; ``stop()`` disarms. ``timeout_s = 0`` never fires; ``first_timeout_s = 0``
sets no limit before the first completed step."""

    def __init__(self, timeout_s: float, first_timeout_s: float | None = None, *,
                 on_timeout: Callable[[], None] = _exit_now, poll_s: float | None = None
                 ) -> None:
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(timeout_s if first_timeout_s is None else first_timeout_s)
        self._on_timeout = on_timeout
        self._poll_s = poll_s if poll_s is not None else min(max(self.timeout_s / 20, 0.05), 5.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self.last_step: int | None = None
        self.last_program = "nothing yet"
        self.fired = False

    def start(self) -> None:
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self._beat = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="meshrl-watchdog", daemon=True)
        self._thread.start()

    def launched(self, program: str) -> None:
        self.last_program = program

    def completed(self, step: int) -> None:
        self.last_step, self._beat = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _limit(self) -> tuple[str, float]:
        if self.last_step is None:
            return "distributed.first_step_timeout_s", self.first_timeout_s
        return "distributed.step_timeout_s", self.timeout_s

    def report(self) -> str:
        idle = time.monotonic() - self._beat
        name, limit = self._limit()
        return (f"watchdog: no step completed in {idle:.1f} s ({name} = {limit:g}); last "
                f"completed step: {self.last_step}; last program "
                f"launched: {self.last_program}; dumping all thread stacks and exiting with "
                f"code {EXIT_HANG}")

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            limit = self._limit()[1]
            if limit > 0 and time.monotonic() - self._beat > limit:
                self.fired = True
                _log.error("%s", self.report())
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self._on_timeout()
                return
