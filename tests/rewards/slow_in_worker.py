"""A reward whose module takes a minute to import in a reward worker: a worker never ready.

The process that builds the pool (not a multiprocessing child) imports it at once."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

if multiprocessing.parent_process() is not None:
    time.sleep(60)


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [1.0] * len(completions)
