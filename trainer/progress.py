"""Progress of a training run: step, loss, tokens/s, ETA.

On a terminal: a tqdm bar on the stream (stderr). Otherwise (log files, CI): a log line every
10% of the run and at the last step, so files stay readable. Callers pass only host floats they
already have; nothing here reads the device.
"""

from __future__ import annotations

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
                 stream: TextIO | None = None) -> None:
        self.total, self.start = total, start
        self.enabled = enabled and total > start
        self._stream = stream or sys.stderr
        tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._next_log = start
        self._bar: tqdm | None = None
        if self.enabled and tty:
            self._bar = tqdm(total=total, initial=start, file=self._stream, unit="step",
                             dynamic_ncols=True, leave=True)

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The log line of ``step``: ``step 25/100 loss 1.2346 12,346 tok/s ETA 0:42``."""
        done = step - self.start
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        return (f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"ETA {tqdm.format_interval(eta)}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s",
                                      refresh=False)
            self._bar.update(step - self._bar.n)
        elif step >= self._next_log or step == self.total:
            _log.info(self.line(step, loss, tokens_per_s))
            self._next_log = step + max((self.total - self.start) // 10, 1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
