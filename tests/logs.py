"""The messages a project logger emits inside a ``with`` block, wherever ``log.setup`` left
its propagation in this worker."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured(name: str) -> Iterator[list[str]]:
    """``with captured("meshrl.datasets") as messages:`` -- the records' messages."""
    logger, handler = logging.getLogger(name), _Messages()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
