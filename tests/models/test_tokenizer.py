"""Tokenizers: the byte-level CharTokenizer and HFTokenizer over files built in the test."""

from __future__ import annotations

import json
import pathlib

import pytest

from meshrl.models.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SENTENCES = ["the quick brown fox jumps over the lazy dog", "what is 12 plus 34 ?",
             "the answer is 46", "hello world , hello tokenizer", "numbers like 1234 and 5678"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    out = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_char_tokenizer_roundtrips_utf8_and_reserves_special_ids():
    tok = CharTokenizer()
    ids = tok.encode("12+34=46 héllo")
    assert tok.decode(ids) == "12+34=46 héllo"
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 256)
    assert min(ids) > 2 and max(ids) < 256
    assert isinstance(tok, Tokenizer)


def test_char_tokenizer_maps_reserved_bytes_away_and_decode_skips_specials():
    tok = CharTokenizer()
    assert tok.encode("a\x00\x01\x02b") == [ord("a"), 63, 63, 63, ord("b")]
    assert tok.decode([1, ord("h"), ord("i"), 2, 0, 0]) == "hi"


def test_char_chat_template_is_fixed_and_ends_with_generation_prompt():
    tok = CharTokenizer()
    text = tok.apply_chat_template(MESSAGES)
    assert text == "<|system|>\nbe brief\n<|user|>\nwhat is 2+2?\n<|assistant|>\n"
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "<|assistant|>\n")
    assert tok.has_chat_template is False


def test_hf_tokenizer_reads_special_tokens_and_chat_template(hf_dir: pathlib.Path):
    tok = HFTokenizer(str(hf_dir))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.has_chat_template and isinstance(tok, Tokenizer)
    text = tok.apply_chat_template(MESSAGES)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is 2+2?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 3 and 4 in ids  # special tokens inside the text map to their ids
    assert tok.decode(tok.encode("the answer is 46")) == "the answer is 46"


def test_hf_tokenizer_matches_transformers_on_encode_and_chat_template(hf_dir: pathlib.Path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    tok = HFTokenizer(str(hf_dir))
    for text in [*SENTENCES, "unseen wörds 999", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == \
            ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (ref.eos_token_id, ref.pad_token_id,
                                                    ref.bos_token_id)


def test_load_tokenizer_resolves_char_and_directories_and_rejects_the_rest(hf_dir, tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)
    with pytest.raises(ValueError, match="must be 'char' or a local directory"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_hf_tokenizer_without_eos_in_vocab_is_a_clear_error(hf_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer(str(tmp_path))


def _copy_of(hf_dir: pathlib.Path, d: pathlib.Path) -> pathlib.Path:
    """``d`` holding a copy of the fixture's tokenizer files."""
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((hf_dir / name).read_bytes())
    return d


@pytest.mark.parametrize("listed, stops", [(None, [2]), (4, [2, 4]), ([4, 2, 4], [2, 4])])
def test_generation_stops_at_every_eos_the_checkpoints_generation_config_lists(
        hf_dir, tmp_path, listed, stops):
    # </s> (2) is tokenizer_config's eos_token; an instruct model also ends its turn at
    # <|im_end|> (4), which only generation_config.json names.
    d = _copy_of(hf_dir, tmp_path / "tok")
    if listed is not None:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))

    tok = HFTokenizer(str(d))

    assert tok.eos_id == 2 and list(tok.stop_ids) == stops
    assert CharTokenizer().stop_ids == (CharTokenizer.EOS,)


@pytest.mark.parametrize("files, stops", [
    ({"config.json": {"eos_token_id": [2, 4]}}, [2, 4]),  # no generation_config.json
    ({"generation_config.json": {"eos_token_id": 5}, "config.json": {"eos_token_id": 4}},
     [2, 5]),  # generation_config.json first, as transformers
    ({"generation_config.json": {"do_sample": True}, "config.json": {"eos_token_id": 4}},
     [2, 4])])
def test_stop_ids_come_from_the_checkpoints_files_as_transformers_reads_them(
        hf_dir, tmp_path, files, stops):
    d = _copy_of(hf_dir, tmp_path / "tok")
    for name, content in files.items():
        (d / name).write_text(json.dumps(content))

    assert list(HFTokenizer(str(d)).stop_ids) == stops


def test_a_tokenizer_from_another_directory_stops_at_the_checkpoints_ids_too(hf_dir, tmp_path):
    from meshrl.configs.schema import ModelConfig
    from meshrl.models.tokenizer import tokenizer_for

    tok_dir, ckpt = _copy_of(hf_dir, tmp_path / "tok"), tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4, 5]}))

    tok = tokenizer_for(ModelConfig(hf_path=str(ckpt), tokenizer=str(tok_dir),
                                    vocab_size=HFTokenizer(str(tok_dir)).vocab_size))

    assert list(tok.stop_ids) == [2, 4, 5]


@pytest.mark.parametrize("listed", [[2, 10_000], ["</s>"], [True]])
def test_a_generation_config_eos_outside_the_vocabulary_is_a_clear_error(hf_dir, tmp_path,
                                                                        listed):
    d = _copy_of(hf_dir, tmp_path / "tok")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))

    with pytest.raises(TokenizerError, match=r"generation_config.json: eos_token_id .*every id "
                                             r"must be an integer in \[0, "):
        HFTokenizer(str(d))


def test_rollouts_and_evaluations_stop_at_the_tokenizers_stop_ids():
    from meshrl.configs.loader import base_config, from_config_dict
    from meshrl.workflows.setup import episode_settings

    class TwoStops(CharTokenizer):
        def __init__(self):
            super().__init__()
            self.stop_ids = (self.EOS, ord("|"))

    config = from_config_dict(base_config("rl"))
    assert episode_settings(config, TwoStops()).stop_ids == (CharTokenizer.EOS, ord("|"))
