"""Progress of a training run: step, loss, tokens/s, ETA.

On a terminal: a tqdm bar on the stream (stderr); the meshrl log records of the run are routed
through tqdm meanwhile, so they print above the bar instead of breaking it. Otherwise (log
files, CI): a log line every 10% of the run, at least every ``every_s`` seconds and at the last
step, so files stay readable and a slow run still shows it is alive; a job that logs its own step
lines turns those off (``log_lines=False``). Step/s and the ETA come from the steps of the last
``window_s`` seconds, never from the first step alone (it holds the compilation), so the ETA
converges as the run settles. Callers pass only host floats they already have; nothing here
reads the device.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from meshrl.utils.log import get_logger

_log = get_logger("trainer.progress")


class Progress:
    """``update(step, loss, tokens_per_s)`` after each step, ``close()`` at the end; a no-op when
    ``enabled`` is false or no step is left to run."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True,
                 stream: TextIO | None = None, log_lines: bool = True, every_s: float = 30.0,
                 window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.start = total, start
        self.enabled = enabled and total > start
        self.log_lines = log_lines
        self.every_s, self.window_s, self._clock = every_s, window_s, clock
        self._stream = stream or sys.stderr
        tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = self._last_line = clock()
        # (time, step) of the steps done in the last window_s seconds (at least two kept).
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        self._next_log = start
        self._bar: tqdm | None = None
        self._redirect = contextlib.ExitStack()
        if self.enabled and tty:
            self._bar = tqdm(total=total, initial=start, file=self._stream, unit="step",
                             dynamic_ncols=True, leave=True)
            meshrl_log = logging.getLogger("meshrl")
            if any(getattr(h, "stream", None) in (sys.stdout, sys.stderr)
                   for h in meshrl_log.handlers):
                # Imported here: tqdm.contrib pulls in tqdm's notebook module, which warns in a
                # notebook kernel without ipywidgets even when no bar is drawn.
                from tqdm.contrib.logging import logging_redirect_tqdm

                self._redirect.enter_context(logging_redirect_tqdm(loggers=[meshrl_log]))

    def steps_per_s(self, step: int | None = None) -> float:
        """The recent pace: over the last ``window_s`` seconds of steps once two are done (the
        first step, with its compilation, drops out), else since the start. ``step``: a step
        done now that ``update`` has not seen yet."""
        marks = list(self._marks)
        if step is not None and (not marks or step > marks[-1][1]):
            marks.append((self._clock(), step))
        if len(marks) >= 2:
            (t0, s0), (t1, s1) = marks[0], marks[-1]
            return (s1 - s0) / max(t1 - t0, 1e-9)
        if marks:
            t1, s1 = marks[-1]
            return (s1 - self.start) / max(t1 - self._t0, 1e-9)
        return 0.0

    def eta(self, step: int) -> str:
        """Time left after ``step`` at the recent pace, as ``H:MM:SS`` / ``MM:SS``."""
        rate = self.steps_per_s(step)
        return tqdm.format_interval((self.total - step) / rate if rate > 0 else 0.0)

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The log line of ``step``: ``step 25/100 loss 1.2346 12,346 tok/s 2.5 step/s ETA
        00:42``."""
        return (f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"{self.steps_per_s():.3g} step/s ETA {self.eta(step)}")

    def _mark(self, step: int) -> float:
        now = self._clock()
        self._marks.append((now, step))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()
        return now

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        now = self._mark(step)  # the pace is kept even when disabled: jobs read eta()
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s",
                                      refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.log_lines and (step >= self._next_log or step == self.total
                                 or now - self._last_line >= self.every_s):
            _log.info(self.line(step, loss, tokens_per_s))
            self._last_line = now
            if step >= self._next_log:
                self._next_log = step + max((self.total - self.start) // 10, 1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
