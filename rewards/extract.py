"""Shared answer extraction from model text: tags, ``\\boxed{}`` with nested braces, numbers.

Every function here runs in time linear in its input, whatever the text (an unclosed tag or box
repeated a million times included): model text is hostile input to the reward workers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Final-answer rewards read only the last MAX_ANSWER_CHARS characters of a completion: the answer
# is at its end, and the cut bounds every later parser's work (normalising, sympy) whatever the
# model wrote before it. A box or tag that opens before the cut is not seen.
MAX_ANSWER_CHARS = 4096

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"
# A box opening or a single brace; the box's own "{" is part of its match.
_BRACE_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# A number: optional sign, digits with optional thousands separators, optional decimals, or a
# leading-dot decimal; an optional "/denominator" keeps "3/4" whole.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def answer_tail(completion: str) -> str:
    """The part of ``completion`` a final-answer reward parses (see ``MAX_ANSWER_CHARS``), with
    the typographic minus (U+2212, which models trained on typeset text write) read as "-":
    dropped, it would turn "-18" into "18"."""
    return completion[-MAX_ANSWER_CHARS:].replace("\u2212", "-")


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``: each tag closes at the first closing tag
    after it, scanning left to right (what a lazy regex finds, without its rescans)."""
    last, pos = None, 0
    while (start := text.find(_OPEN_TAG, pos)) >= 0:
        end = text.find(_CLOSE_TAG, start + len(_OPEN_TAG))
        if end < 0:  # no later tag can close either
            break
        last, pos = text[start + len(_OPEN_TAG):end], end + len(_CLOSE_TAG)
    return last.strip() if last is not None else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) that closes, nested braces
    included; None when absent or unbalanced. One pass with a stack of open braces: a box closes
    at the brace that matches its own."""
    stack: list[int] = []  # per open brace: where its box's content starts, or -1 (plain brace)
    best_start, best_end = -1, -1
    for m in _BRACE_TOKEN.finditer(text):
        token = m.group()
        if token == "}":
            if stack and (start := stack.pop()) > best_start:
                best_start, best_end = start, m.start()
        else:
            stack.append(m.end() if token != "{" else -1)
    return text[best_start:best_end].strip() if best_start >= 0 else None


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
