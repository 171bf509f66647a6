"""A reward that varies with the text (a hash of prompt and completion in [0, 1)): batches of
different prompts get different mean rewards, so a step's reward names the step."""

from __future__ import annotations

import zlib
from typing import Any


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [zlib.crc32(f"{p}\x00{c}".encode()) / 2**32 for p, c in zip(prompts, completions,
                                                                       strict=True)]
