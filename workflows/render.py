"""Turn an agent episode's observations into token ids, one turn at a time, from the
tokenizer's own chat template: the ids of the model's turns are never re-tokenized.

The context of an episode is ``prompt ids + turn 1 (the sampler's ids) + observation 1 ids +
turn 2 ...``. Only the observation ids are made here: render a fixed two-turn conversation whose
assistant content is a sentinel ``S``, with the new messages after it, and encode what follows
``S``:

    delta = template([user "U", assistant S] + new messages, add_generation_prompt=True)
            [after S]

that is what the template writes after an assistant's content (Qwen2's ``<|im_end|>\\n``), the
new messages and the next turn's opening, less the end-of-turn token the model already sampled
when it stopped on it. Rendering turn by turn then gives the same text as rendering the whole
conversation wherever the template renders a message independently of the messages before it
(ChatML, Qwen2.5 with tool responses grouped, Llama 3). It does not where the template rewrites
earlier turns: Qwen3 writes an empty ``<think>`` block into the last assistant turn and drops
it once another message follows, so the whole-conversation rendering differs from what the
model saw; the episode keeps what the model saw, which is what the trainer must score, and the
rewritten part comes before ``S``. ``TemplateDriftError`` says so when the template does not
render the assistant's content as given, or closes the assistant turn differently once another
message follows (the template cannot be rendered incrementally at all).

A tokenizer without a chat template (the byte tokenizer of the tiny default models) renders
plainly: a tool message as ``<tool_response>…</tool_response>\\n``, a user message as its text
and a newline; its end-of-turn token (EOS) stays in the context between turns.
"""

from __future__ import annotations

from typing import Any

from meshrl.datasets.render import encode_prompt
from meshrl.models.tokenizer import Tokenizer
from meshrl.utils.errors import UserError
from meshrl.workflows.environment import Observation

_SENTINEL = "meshrl_assistant_turn"  # letters only: templates strip whitespace, not words
_BASE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _SENTINEL}]


class TemplateDriftError(UserError, ValueError):
    """The chat template renders earlier turns differently once later ones are added."""


def as_messages(observation: Observation) -> list[dict[str, Any]]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def plain_text(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<tool_response>{m['content']}</tool_response>\n" if m["role"] == "tool"
                   else f"{m['content']}\n" for m in messages)


class TurnRenderer:
    """Observation ids for ``tokenizer`` (chat template or plain), checked once for drift."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(tokenizer.has_chat_template)
        self.suffix = ""
        if self.chat:
            base = tokenizer.apply_chat_template(_BASE, add_generation_prompt=False)
            self.suffix = self._after_sentinel(base, [])  # the end of an assistant turn
            self.observation_ids("probe", last_token=tokenizer.eos_id)  # drift fails now

    @staticmethod
    def _after_sentinel(text: str, messages: list[dict[str, Any]]) -> str:
        """What the template wrote after the assistant's content ``_SENTINEL``."""
        if text.count(_SENTINEL) != 1:
            raise TemplateDriftError(
                f"the chat template renders earlier turns differently once a "
                f"{[m['role'] for m in messages]} turn follows (the assistant's content "
                f"appears {text.count(_SENTINEL)} times, not once, in {text[:200]!r}; a template "
                f"that drops or rewrites an earlier turn's content, e.g. its case, does this): "
                f"multi-turn episodes need a template that renders each message on its own")
        return text[text.index(_SENTINEL) + len(_SENTINEL):]

    def prompt_ids(self, example: dict, first: Observation) -> list[int]:
        """The episode's first context: the example's ``prompt_ids`` when ``reset`` said
        nothing, else its messages plus the first observation, rendered once."""
        if first is None:
            return list(example["prompt_ids"])
        messages = list(example.get("messages") or
                        [{"role": "user", "content": example.get("prompt", "")}])
        messages += as_messages(first)
        # As the data pipeline encodes a prompt (BOS once): an episode's ids must not depend
        # on whether its environment spoke first.
        text = (self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                if self.chat else plain_text(messages))
        return encode_prompt(text, self.tokenizer)

    def observation_ids(self, observation: Observation, last_token: int | None) -> list[int]:
        """Ids that close the model's turn, show ``observation`` and open the next turn.
        ``last_token``: the turn's last sampled id; when it is one of the tokenizer's stop ids
        (EOS, or one only generation_config.json lists) and the template closes a turn with
        it, the model's own token already closed the turn."""
        messages = as_messages(observation)
        if not self.chat:
            return self.tokenizer.encode(plain_text(messages))
        full = self.tokenizer.apply_chat_template(_BASE + messages, add_generation_prompt=True)
        after = self._after_sentinel(full, messages)
        if not after.startswith(self.suffix):
            raise TemplateDriftError(
                f"the chat template renders earlier turns differently once a "
                f"{[m['role'] for m in messages]} turn follows (it closes the assistant's turn "
                f"with {after[:len(self.suffix) + 20]!r}, {self.suffix!r} when the turn is "
                f"last): multi-turn episodes need a template that renders each message on its "
                f"own")
        # A special token is encoded atomically: the suffix's first id is the template's
        # end-of-turn token when it has one.
        ids = self.tokenizer.encode(after)
        if last_token in self.tokenizer.stop_ids and ids[:1] == [last_token]:
            ids = ids[1:]
        return ids
