"""A stand-in for a real release, built in-process (nothing downloaded): a tiny Qwen2 saved by
transformers, a byte-level BPE tokenizer.json trained with the tokenizers library plus a
ChatML chat template in tokenizer_config.json (as Qwen2.5-Instruct ships), GSM8K-format and
chat-format JSONL files, and a reward such a random model can learn to earn."""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

QWEN2_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=True)

# Qwen2.5-Instruct's template without its tool-calling branches.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def gsm8k_rows(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-format rows: a word problem and a solution ending in ``#### N``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        name = rng.choice(["Tom", "Ana", "Li", "Sam"])
        rows.append({"question": f"{name} has {a} apples and buys {b} more. How many apples "
                                 f"does {name} have now?",
                     "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n"
                               f"#### {a + b}"})
    return rows


def chat_rows(n: int, seed: int) -> list[dict]:
    """Chat-format rows: ``messages`` ending in the assistant turn to learn."""
    return [{"messages": [{"role": "system", "content": "You are a careful math tutor."},
                          {"role": "user", "content": r["question"]},
                          {"role": "assistant", "content": r["answer"].split("\n####")[0]}]}
            for r in gsm8k_rows(n, seed)]


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_tokenizer(out: pathlib.Path) -> int:
    """tokenizer.json + tokenizer_config.json (ChatML template, EOS ``<|im_end|>``) in ``out``;
    returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    # Qwen2's own pre-tokenizer (digits one by one), as its tokenizer.json has it: transformers
    # rebuilds it for model_type qwen2 whatever the file says, so the two must agree.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows(400, seed=99)]
    tok.train_from_iterator(corpus + ["You are a careful math tutor.", "user", "assistant",
                                      "system"], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.get_vocab_size()


def save_qwen2(out: pathlib.Path, seed: int = 0) -> None:
    """A random tiny Qwen2ForCausalLM (tied embeddings, q/k/v biases) saved as float32
    safetensors by transformers, with its tokenizer files beside it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**QWEN2_TINY)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    assert train_tokenizer(out) <= QWEN2_TINY["vocab_size"]


def load_in_transformers(path: pathlib.Path):
    """(model, tokenizer) loaded from ``path`` by transformers' Auto classes."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer


def hf_chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """transformers' chat-template token ids (a list whatever the version's return type)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def letter_share(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Reward (``reward.names = ("meshrl.tests.jobs.real_model:letter_share",)``): the share of
    letters among a completion's characters. The random checkpoint earns about half of it and
    RL can raise it, where it earns nothing on GSM8K (every advantage 0, no update at all)."""
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]
