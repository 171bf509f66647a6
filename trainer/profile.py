"""A ``jax.profiler`` trace of a window of training steps (``logging.profile_steps``).

``ProfileWindow.before(step)`` starts the trace at the window's first step (or the first step
a resumed run reaches inside it); ``after(step, outputs)`` waits for that step's outputs and
stops it at the window's last step, so the trace holds whole steps; ``close()`` stops a trace
the run left open by ending early. Every process traces into its own
``<workdir>/profile/process_<i>`` (processes on one host would share a file name), readable by
TensorBoard's profile plugin or Perfetto. Works on any backend.
"""

from __future__ import annotations

from typing import Any

import jax

from meshrl.utils import log, paths

_log = log.get_logger("trainer")


class ProfileWindow:
    def __init__(self, steps: tuple[int, ...], workdir: paths.PathLike, process_index: int
                 ) -> None:
        self.first, self.last = steps if steps else (0, -1)
        self.dir = paths.as_path(workdir) / "profile" / f"process_{process_index}"
        self.active = False
        self.done = not steps

    def before(self, step: int) -> None:
        if self.done or self.active or not self.first <= step <= self.last:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.dir))
        self.active = True
        _log.info("profiling steps %d-%d into %s", step, self.last, self.dir)

    def after(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)
            self._stop(f"profile of steps up to {step} written: {self.dir}")

    def close(self) -> None:
        if self.active:
            self._stop(f"profile written (the run ended inside the window): {self.dir}")

    def _stop(self, message: str) -> None:
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        _log.info("%s", message)
