"""The pipeline with an HF tokenizer (built in the test) and its chat template."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.configs.schema import DataConfig
from meshrl.datasets import make_prompt_iterator, make_sft_iterator
from meshrl.models.tokenizer import HFTokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["12+34=46", "say hi", "user assistant"], trainer=trainer)
    out = tmp_path_factory.mktemp("qwen_like")
    raw.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return HFTokenizer(str(out))


def _with_template(tok: HFTokenizer, tmp_path, template: str):
    """A copy of ``tok``'s directory (its tokenizer.json) with ``template`` as chat template."""
    import shutil

    out = tmp_path / "tok"
    shutil.copytree(tok._directory, out)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}))
    return out


def test_prompts_are_chat_templated_without_bos(tok: HFTokenizer):
    (ex,) = next(make_prompt_iterator(DataConfig(num_examples=4), tok, batch_size=1, seed=0))
    assert tok.bos_id is None
    assert ex["prompt_text"] == f"<|im_start|>user\n{ex['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert ex["prompt_ids"] == tok.encode(ex["prompt_text"])


def test_sft_chat_response_ends_at_the_template_end_of_turn(tok: HFTokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "say hi"},
                                             {"role": "assistant", "content": "hi"}]}) + "\n")
    batch = next(make_sft_iterator(DataConfig(source="jsonl", path=str(path)), tok,
                                   batch_size=1, seq_len=32, seed=0, pack=False))
    trained = batch["targets"][0][batch["loss_mask"][0] == 1].tolist()
    # "hi<|im_end|>": the end-of-turn is EOS here, so it is not doubled.
    assert trained == tok.encode("hi") + [tok.eos_id]
    assert np.count_nonzero(batch["segment_ids"]) == len(tok.encode(
        "<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>")) - 1


def test_a_row_the_chat_template_refuses_is_one_error_naming_its_file_and_line(
        tok: HFTokenizer, tmp_path):
    from meshrl.datasets.sources import DatasetError

    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
              "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok_dir = _with_template(tok, tmp_path, strict)
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    rows = [{"messages": [turn("user", "say hi"), turn("assistant", "hi")]}] * 2 + [
        {"messages": [turn("user", "say"), turn("user", "hi"), turn("assistant", "hi")]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    with pytest.raises(DatasetError, match=r"chat.jsonl:3: the chat template refused this row "
                                           r"\(Conversation roles must alternate\)"):
        next(make_sft_iterator(DataConfig(source="jsonl", path=str(path)),
                               HFTokenizer(str(tok_dir)), batch_size=3, seq_len=32, seed=0,
                               pack=False))


def test_the_trained_assistant_turn_keeps_its_other_keys_for_the_template(tok: HFTokenizer,
                                                                          tmp_path):
    # Qwen3's template renders an assistant turn's reasoning_content inside <think>.
    thinking = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    thinker = HFTokenizer(str(_with_template(tok, tmp_path, thinking)))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hi", "reasoning_content": "say it"}]}) + "\n")

    batch = next(make_sft_iterator(DataConfig(source="jsonl", path=str(path)), thinker,
                                   batch_size=1, seq_len=64, seed=0, pack=False))

    trained = batch["targets"][0][batch["loss_mask"][0] == 1].tolist()
    assert trained == thinker.encode("<think>say it</think>hi") + [thinker.eos_id]
