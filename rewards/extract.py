"""Shared answer extraction from model text: tags, ``\\boxed{}`` with nested braces, numbers."""

from __future__ import annotations

import re
from collections.abc import Callable

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number: optional sign, digits with optional thousands separators, optional decimals, or a
# leading-dot decimal; an optional "/denominator" keeps "3/4" whole.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included;
    None when absent or unbalanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def score_final_answers(completions: list[str], golds: list, pred_fn: Callable[[str], str | None],
                        gold_fn: Callable[[str], str],
                        equiv: Callable[[str, str], bool]) -> list[float]:
    """1.0 where the completion's final answer is equivalent to the gold answer, else 0.0."""
    out = []
    for completion, gold in zip(completions, golds):
        pred = pred_fn(completion)
        out.append(1.0 if pred is not None and equiv(pred, gold_fn(str(gold))) else 0.0)
    return out
