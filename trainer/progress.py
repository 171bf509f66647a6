"""Progress of a training run: step, loss, tokens/s, ETA.

On a terminal: a tqdm bar on the stream (stderr); the meshrl log records of the run are routed
through tqdm meanwhile, so they print above the bar instead of breaking it. Otherwise (log
files, CI): a log line every 10% of the run and at the last step, so files stay readable; a job
that logs its own step lines turns those off (``log_lines=False``). Callers pass only host
floats they already have; nothing here reads the device.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TextIO

from tqdm import tqdm

from meshrl.utils.log import get_logger

_log = get_logger("trainer.progress")


class Progress:
    """``update(step, loss, tokens_per_s)`` after each step, ``close()`` at the end; a no-op when
    ``enabled`` is false or no step is left to run."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True,
                 stream: TextIO | None = None, log_lines: bool = True) -> None:
        self.total, self.start = total, start
        self.enabled = enabled and total > start
        self.log_lines = log_lines
        self._stream = stream or sys.stderr
        tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
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

    def eta(self, step: int) -> str:
        """Time left after ``step`` at the mean pace so far, as ``H:MM:SS`` / ``MM:SS``."""
        done = step - self.start
        elapsed = time.perf_counter() - self._t0
        return tqdm.format_interval(elapsed / done * (self.total - step) if done > 0 else 0.0)

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The log line of ``step``: ``step 25/100 loss 1.2346 12,346 tok/s ETA 00:42``."""
        return (f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"ETA {self.eta(step)}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s",
                                      refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.log_lines and (step >= self._next_log or step == self.total):
            _log.info(self.line(step, loss, tokens_per_s))
            self._next_log = step + max((self.total - self.start) // 10, 1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
