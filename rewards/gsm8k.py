"""GSM8K reward: the completion's final number equals the number after ``####`` in ``answer``.

Range {0.0, 1.0}. The completion's final answer (in its last ``extract.MAX_ANSWER_CHARS``
characters) is its last ``#### N`` (hashes then a number: a markdown heading such as
``#### Step 2`` is no marker), else its last ``\\boxed{}``, else its last number;
equivalence is ``math_answer.is_equiv`` (so ``1,000``, ``$1000`` and ``1000.00`` all match
``1000``).
"""

from __future__ import annotations

import re
from typing import Any

from meshrl.rewards.extract import (
    NUMBER,
    answer_tail,
    last_boxed,
    last_number,
    score_final_answers,
)
from meshrl.rewards.math_answer import is_equiv
from meshrl.rewards.registry import register

# A "#### N" marker is hashes then the number (a "$" may come between); instruct models write
# markdown headings ("#### Step 2: ...", "#### Final Answer"), which mark no answer.
_MARKED = re.compile(r"####[ \t]*\$?[ \t]*(" + NUMBER.pattern + ")")


def gold_number(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def final_answer(completion: str) -> str | None:
    completion = answer_tail(completion)
    marked = _MARKED.findall(completion)
    if marked:
        return marked[-1]
    boxed = last_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


@register("gsm8k", answer_format="'#### N' (else \\boxed{N}, else the last number), N equal to "
                                 "the number after '####' in the answer field")
def gsm8k_reward(prompts: list[str], completions: list[str], *, answer: list[str],
                 **_: Any) -> list[float]:
    return score_final_answers(completions, answer, final_answer, gold_number, is_equiv)
