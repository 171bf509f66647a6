"""Countdown reward: the last ``<answer>...</answer>`` holds an equation reaching ``target``.

Range {0.0, 1.0} (only the last ``extract.MAX_ANSWER_CHARS`` characters are read): 1.0 when the
equation (an optional ``= target`` suffix is allowed) evaluates exactly to ``target`` using only
``+ - * /``, parentheses and integers from ``numbers``, each at most as often as given; 0.0
otherwise. The equation is parsed by ``safe_arith``; model text is
never executed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from meshrl.rewards import safe_arith
from meshrl.rewards.extract import answer_tail, last_answer_tag
from meshrl.rewards.registry import register


def score_one(completion: str, numbers: list[int], target: int) -> float:
    equation = last_answer_tag(answer_tail(completion))
    if not equation:
        return 0.0
    target = int(target)  # fields read from a file may hold the number as a string
    lhs, eq, rhs = equation.partition("=")
    if eq:
        try:
            if safe_arith.evaluate(rhs)[0] != target:
                return 0.0
        except safe_arith.UnsafeExpressionError:
            return 0.0
    try:
        value, used = safe_arith.evaluate(lhs)
    except safe_arith.UnsafeExpressionError:
        return 0.0
    if Counter(used) - Counter(int(n) for n in numbers):  # a number used more than given
        return 0.0
    return 1.0 if value == target else 0.0


@register("countdown",
          answer_format="<answer>EQUATION</answer> last, reaching the target with the given numbers")
def countdown(prompts: list[str], completions: list[str], *, numbers: list[list[int]],
              target: list[int], **_: Any) -> list[float]:
    return [score_one(c, n, t) for c, n, t in zip(completions, numbers, target)]
