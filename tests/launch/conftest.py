"""Fixtures shared by the launcher and sweep tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def meshrl_logger():
    """main() attaches the project's handler to the (captured) stderr; put the logger back."""
    logger = logging.getLogger("meshrl")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
