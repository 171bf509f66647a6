"""A reward whose module, imported by a reward worker while ``MARKER`` exists, removes the
marker and exits: the next worker started dies before it is ready, the one after it lives.
While ``ALWAYS`` exists every worker started dies so."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from typing import Any

MARKER = os.path.join(tempfile.gettempdir(), f"meshrl-test-dies-at-start-{os.getuid()}")
ALWAYS = MARKER + "-always"

if multiprocessing.parent_process() is not None:
    if os.path.exists(MARKER):
        os.remove(MARKER)
        os._exit(1)
    if os.path.exists(ALWAYS):
        os._exit(1)


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Each completion's length; ``KILL`` kills the worker instead."""
    if "KILL" in completions:
        os._exit(3)
    return [float(len(c)) for c in completions]
