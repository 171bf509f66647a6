"""Test-only rewards, importable by reward workers as ``meshrl.tests.rewards.helpers:<name>``."""

from __future__ import annotations

import os
import time
from typing import Any


def sleep_forever(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    while True:
        time.sleep(1.0)


def always_raises(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    raise RuntimeError("reward bug")


def returns_nan(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [float("nan")] * len(completions)


def kills_worker(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    os._exit(3)


def sleeps_then_scores(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Scores each completion's length after 0.3 s."""
    time.sleep(0.3)
    return [float(len(c)) for c in completions]


def hangs_on_marker(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Hangs only on completions containing HANG; others score their length."""
    if any("HANG" in c for c in completions):
        sleep_forever(prompts, completions)
    return [float(len(c)) for c in completions]


def meets_the_others(prompts: list[str], completions: list[str], barrier_dir: list[str],
                     parties: list[int], **_: Any) -> list[float]:
    """A cross-process barrier: leave a marker, then 1.0 if ``parties`` markers appear within
    5 s (the calls ran side by side), else 0.0 (they ran one after another)."""
    os.makedirs(barrier_dir[0], exist_ok=True)
    with open(os.path.join(barrier_dir[0], f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if len(os.listdir(barrier_dir[0])) >= parties[0]:
            return [1.0] * len(completions)
        time.sleep(0.01)
    return [0.0] * len(completions)
