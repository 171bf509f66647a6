"""A reward whose module kills any reward worker that imports it: a worker dead at start-up.

The process that builds the pool (not a multiprocessing child) imports it safely, as the pool
checks every reward name there first."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

if multiprocessing.parent_process() is not None:
    os._exit(3)


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [1.0] * len(completions)
