"""A tiny Qwen2 tokenizer with Qwen2.5's tool-response chat template (built in process), and a
scripted sampler that answers each turn with given token ids, for the agent episode tests."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import Callable, Sequence

from meshrl.inference.sampler import Completion, Request
from meshrl.models.tokenizer import HFTokenizer
from meshrl.tests.jobs import real_model

# Qwen2.5-Instruct's message loop: consecutive tool results share one user turn, each in
# <tool_response> tags (its system/tools preamble is left out: the tests pass no tools).
QWEN_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3's assistant turns: the last one carries an (empty) <think> block, dropped once another
# message follows; tool results as in Qwen2.5 (one per user turn here).
QWEN3_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + "
    "'<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

# Rewrites every assistant turn but the last (as Qwen3 drops earlier <think> parts).
DRIFTING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen_tokenizer(directory: pathlib.Path, template: str = QWEN_TOOL_TEMPLATE,
                   **special: str) -> HFTokenizer:
    """A ChatML tokenizer; ``special`` sets tokens of tokenizer_config.json (``eos_token``,
    ``bos_token``)."""
    directory.mkdir(parents=True, exist_ok=True)
    real_model.train_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **special}))
    return HFTokenizer(str(directory))


class ScriptedSampler:
    """Turn t of every episode answers ``turns[t]`` (ids); each token's version is the
    sampler's version when it is produced; ``after_turn(t)`` runs after turn t (a weight
    handoff between turns). Stops with reason 'stop' when the ids end with the stop id."""

    def __init__(self, turns: Sequence[Sequence[int]],
                 after_turn: Callable[[int], None] | None = None) -> None:
        self.turns, self.after_turn = [list(t) for t in turns], after_turn
        self.version = 0
        self.requests: list[Request] = []
        self.completions: list[Completion] = []

    async def agenerate(self, request: Request) -> Completion:
        await asyncio.sleep(0)
        self.requests.append(request)
        turn = request.id[2]
        ids = self.turns[turn][:request.max_new_tokens or None]
        stop = bool(ids) and ids[-1] in request.stop_ids
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        out = Completion(request, ids, lps, lps, [self.version] * len(ids),
                         "stop" if stop else "length")
        self.completions.append(out)
        if self.after_turn is not None:
            self.after_turn(turn)
        return out


class ConstRewards:
    """Scores every completion ``value`` and records the texts."""

    def __init__(self, value: float = 1.0) -> None:
        self.value, self.seen = value, []

    async def ascore(self, prompts, completions, **fields):
        self.seen += list(completions)
        return [self.value] * len(completions)
