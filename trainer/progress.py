"""A tiny progress line for long runs: step, loss, tokens/s, ETA.

On a terminal it redraws one line on stderr; otherwise (logs, CI) it logs a line every 10% so
files stay readable. No dependency beyond the project logger.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from meshrl.utils.log import get_logger

_log = get_logger("trainer.progress")


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, *, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.total, self.start = total, start
        self.enabled = enabled and total > start
        self._stream = stream or sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._next_log = start

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        done = step - self.start
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        width = 20
        filled = int(width * step / max(self.total, 1))
        return (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} "
                f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s ETA {_hms(eta)}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._tty:
            self._stream.write("\r" + self.line(step, loss, tokens_per_s))
            self._stream.flush()
        elif step >= self._next_log or step == self.total:
            _log.info(self.line(step, loss, tokens_per_s))
            self._next_log = step + max((self.total - self.start) // 10, 1)

    def close(self) -> None:
        if self.enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()
