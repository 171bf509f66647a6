"""The project logger: every record carries its component and the JAX process index."""

from __future__ import annotations

import logging
import sys

_ROOT = "meshrl"
_process_index = 0
_FORMAT = "%(asctime)s %(levelname).1s [p%(process_index)d %(component)s] %(message)s"


class _Tags(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.process_index = _process_index
        name = record.name
        record.component = name[len(_ROOT) + 1:] if name.startswith(_ROOT + ".") else name
        return True


def set_process_index(index: int) -> None:
    """Record this process's index; called once JAX's backend is up (asking earlier would
    initialise the backend before ``jax.distributed.initialize``)."""
    global _process_index
    _process_index = int(index)


def get_logger(component: str) -> logging.Logger:
    """Logger for ``component`` (e.g. ``"trainer"``); records are tagged with it."""
    return logging.getLogger(f"{_ROOT}.{component}")


# Libraries that log routine progress at INFO through absl (Orbax: hundreds of records per
# run, grain): shown only at DEBUG, so a run's console is meshrl's own records.
_CHATTY = ("absl", "orbax", "grain")


def setup(level: str = "INFO", stream=None) -> None:
    """Attach one tagged handler to the meshrl root logger (idempotent). Third-party records
    below WARNING are hidden unless ``level`` is DEBUG."""
    # DEBUG shows their INFO records (absl's own default), not their DEBUG chatter.
    quiet = logging.INFO if level == "DEBUG" else logging.WARNING
    for name in _CHATTY:
        logging.getLogger(name).setLevel(quiet)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.INFO if level == "DEBUG" else absl_logging.WARNING)
    except ImportError:  # absl is a dependency; guard only for trimmed environments
        pass
    root = logging.getLogger(_ROOT)
    root.setLevel(level)
    root.propagate = False
    for h in list(root.handlers):
        if getattr(h, "_meshrl", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_Tags())
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler._meshrl = True  # type: ignore[attr-defined]
    root.addHandler(handler)

