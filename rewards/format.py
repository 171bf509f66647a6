"""Format reward: the completion follows a template such as
``<think>...</think><answer>...</answer>``, where ``...`` is any non-empty text.

Range {0.0, 1.0}. Whitespace around the completion and between adjacent tags is allowed. The
template comes from the ``format_template`` field (``RewardConfig.format_template`` through the
reward pool), defaulting to ``DEFAULT_TEMPLATE``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from meshrl.rewards.registry import register

DEFAULT_TEMPLATE = "<think>...</think><answer>...</answer>"


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> re.Pattern[str]:
    pieces = []
    for literal in template.split("..."):
        # Between two tags (">" then "<") any whitespace is fine: "</think>\n<answer>".
        parts = re.split(r"(?<=>)\s*(?=<)", literal.strip())
        pieces.append(r"\s*".join(re.escape(p) for p in parts if p))
    # A slot holds non-blank text that contains none of the template's own tags, so a second
    # <answer> block or an empty <think></think> does not pass.
    tags = sorted(set(re.findall(r"</?\w+>", template)))
    char = f"(?:(?!{'|'.join(map(re.escape, tags))}).)" if tags else "."
    # Greedy: a lazy slot followed by optional whitespace backtracked over every run of blanks
    # (quadratic: 7.5 s for 64k spaces, past the pool's timeout). Fullmatch accepts the same
    # strings either way.
    slot = rf"\s*(?=\S){char}+"
    return re.compile(r"\s*" + slot.join(pieces) + r"\s*", re.DOTALL)


def matches(completion: str, template: str = DEFAULT_TEMPLATE) -> bool:
    return compile_template(template).fullmatch(completion) is not None


@register("format", answer_format="reward.format_template, e.g. "
                                 "<think>...</think><answer>...</answer>")
def format_reward(prompts: list[str], completions: list[str], *,
                  format_template: list[str] | None = None, **_: Any) -> list[float]:
    templates = format_template or [DEFAULT_TEMPLATE] * len(completions)
    return [1.0 if matches(c, t) else 0.0 for c, t in zip(completions, templates)]
