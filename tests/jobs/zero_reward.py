"""A reward that scores every completion 0 (a reward whose answer format the data never meets)."""

from __future__ import annotations

from typing import Any


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [0.0] * len(completions)


reward.answer_format = "the word 'never' (no completion has it)"  # type: ignore[attr-defined]
