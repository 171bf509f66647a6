"""Ctrl-C as a request to stop at the next step boundary, after a checkpoint.

``main.py`` calls ``install()``: the first SIGINT sets a flag that the SFT and RL loops read
between steps (they save the step, then raise ``Stopped``); a second SIGINT, or any SIGINT in a
multi-process run (the processes would not agree on the step to stop at), raises
``KeyboardInterrupt`` at once, without a save. Without ``install()`` (a notebook, a test calling
a job directly) nothing changes: ``requested()`` stays false.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from meshrl.utils.log import get_logger

_log = get_logger("interrupt")
_state = {"requested": False}


class Stopped(Exception):  # noqa: N818  (a requested stop, not a failure)
    """A run stopped on request at ``step`` after saving ``path``."""

    def __init__(self, step: int, path: Any, what: str = "step") -> None:
        super().__init__(f"stopped at {what} {step}; checkpoint saved: {path}")
        self.step, self.path = step, path


def _multi_process() -> bool | None:
    """Whether the run spans several processes; None before JAX has a backend (asking would
    start a one-process backend, and a later ``jax.distributed.initialize`` would fail)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        return None
    return jax.process_count() > 1


def _handler(signum: int, frame: Any) -> None:
    # Before the backend exists no step has run: stop at once (nothing to save).
    if _state["requested"] or _multi_process() is not False:
        raise KeyboardInterrupt
    _state["requested"] = True
    _log.warning("interrupt: stopping after the current step with a checkpoint (Ctrl-C again "
                 "stops at once, without saving)")


def install() -> None:
    """Route SIGINT to the step-boundary stop (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        _state["requested"] = False
        signal.signal(signal.SIGINT, _handler)


def requested() -> bool:
    """True after the first Ctrl-C of an ``install``-ed run."""
    return _state["requested"]


def request() -> None:
    """Ask for a stop at the next step boundary, as a first Ctrl-C does."""
    _state["requested"] = True


def clear() -> None:
    _state["requested"] = False
