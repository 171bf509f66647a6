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


def hangs_on_marker(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Hangs only on completions containing HANG; others score their length."""
    if any("HANG" in c for c in completions):
        sleep_forever(prompts, completions)
    return [float(len(c)) for c in completions]
