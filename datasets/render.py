"""A row as the model reads it: the prompt text (the chat template when there is one), its ids
(BOS prepended unless present) and the SFT target's ids (the last assistant turn as the
template renders it, end of turn and EOS included). The SFT, RL, DPO and generate pipelines all
render rows here, so one row gives the same ids in every job (docs/data.md)."""

from __future__ import annotations

from meshrl.models.tokenizer import Tokenizer


def prompt_text(example: dict, tokenizer: Tokenizer) -> str:
    """Chat data is always templated; a plain prompt only if the tokenizer has a template."""
    if example.get("messages") is not None:
        return tokenizer.apply_chat_template(example["messages"], add_generation_prompt=True)
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]}],
                                             add_generation_prompt=True)
    return example["prompt"]


def encode_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(text)
    # Templates such as Llama 3's already start with BOS; never add a second one.
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    return ids


def response_ids(example: dict, prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The SFT target: the last assistant turn as the template renders it (a prompt/answer row
    too, when its prompt went through the template: the same end of turn), or the answer."""
    text = example["answer"]
    messages = example.get("messages")
    if messages is None and tokenizer.has_chat_template:
        messages = [{"role": "user", "content": example["prompt"]}]  # as ``prompt_text``
    if messages is not None:
        # The row's own assistant turn (its other keys too: Qwen3 renders reasoning_content).
        turn = {**example.get("_answer_message", {"role": "assistant"}),
                "content": example["answer"]}
        full = tokenizer.apply_chat_template([*messages, turn], add_generation_prompt=False)
        # Use the template's own rendering of the turn (end-of-turn tokens included) when the
        # prompt is a prefix of it; trailing newlines after the end-of-turn are not trained on.
        if full.startswith(prompt):
            text = full[len(prompt):].rstrip()
    ids = tokenizer.encode(text)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids.append(tokenizer.eos_id)
    return ids
