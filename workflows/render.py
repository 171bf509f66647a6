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
        self.suffix, self.suffix_has_eos = "", False
        if self.chat:
            base = tokenizer.apply_chat_template(_BASE, add_generation_prompt=False)
            self.suffix = self._after_sentinel(base, [])  # the end of an assistant turn
            # A special token is encoded atomically, so the suffix starts with the EOS id
            # exactly when the template closes a turn with the token the model stops on.
            self.suffix_has_eos = tokenizer.encode(self.suffix)[:1] == [tokenizer.eos_id]
            self.observation_ids("probe", stopped_on_eos=True)  # a drifting template fails now

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
        if self.chat:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text)
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return bos + self.tokenizer.encode(plain_text(messages))

    def observation_ids(self, observation: Observation, stopped_on_eos: bool) -> list[int]:
        """Ids that close the model's turn, show ``observation`` and open the next turn."""
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
        ids = self.tokenizer.encode(after)
        if stopped_on_eos and self.suffix_has_eos:
            ids = ids[1:]  # the model's own EOS token already closed the turn
        return ids
