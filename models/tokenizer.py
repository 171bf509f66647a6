"""Tokenizers: a built-in byte-level ``CharTokenizer`` and ``HFTokenizer`` over local files.

Both satisfy the ``Tokenizer`` protocol the data pipeline, sampler and workflows code against.
``encode`` never adds special tokens: the data pipeline decides where BOS/EOS go, so the same
prompt ids reach the trainer and the sampler.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.utils.errors import MissingFileError, UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer spec or directory that cannot be used; names the spec or file and the fix."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    # Every id that ends generation: ``eos_id`` first, then the others the checkpoint's
    # generation_config.json lists (Qwen's <|endoftext|>, Llama 3's <|eot_id|>, ...).
    stop_ids: tuple[int, ...]
    pad_id: int
    # False when the tokenizer only has a fallback chat format; the data pipeline then feeds plain
    # prompts raw (a tiny char model learns "12+34=" faster without chat scaffolding).
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        ...


class CharTokenizer:
    """Byte-level tokenizer: id = UTF-8 byte value; ids 0/1/2 are reserved for pad/bos/eos.

    The bytes 0x00-0x02 (NUL, SOH, STX) therefore cannot appear in text; ``encode`` maps them to
    ``?`` so that model input never contains a spurious special token.
    """

    PAD, BOS, EOS = 0, 1, 2
    _REPLACEMENT = ord("?")

    def __init__(self, vocab_size: int = 256, use_chat_template: bool = False) -> None:
        if vocab_size < 256:
            raise ValueError(f"CharTokenizer vocab_size = {vocab_size}: must be >= 256 (bytes)")
        self.vocab_size = vocab_size
        self.bos_id: int | None = self.BOS
        self.eos_id = self.EOS
        self.stop_ids = (self.EOS,)
        self.pad_id = self.PAD
        self.has_chat_template = use_chat_template

    def encode(self, text: str) -> list[int]:
        return [b if b > self.EOS else self._REPLACEMENT for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if self.EOS < int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        # A fixed, short format: a role tag line, then the content line, per turn.
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """Which token each id names, as a short digest: two tokenizers with one digest give every
    id the same token (a byte tokenizer: the byte values up to its size)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.vocabulary_digest()
    return f"bytes:{tokenizer.vocab_size}"


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` plus its ``tokenizer_config.json`` (chat template and
    special tokens), read from a local directory. Never runs remote code: the chat template is
    rendered in jinja2's immutable sandbox with bounded arithmetic and output
    (``models/chat_template.py``)."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise MissingFileError(f"{directory!r}: no tokenizer.json there: point model.tokenizer "
                                   f"at a local directory holding tokenizer.json, or use "
                                   f"'auto' or 'char'")
        try:
            self._tok = _RustTokenizer.from_file(path)
        except Exception as e:  # the Rust library raises a bare Exception for a bad file
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e}): copy the file "
                                 f"from the model's original release") from None
        self._directory = directory
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        # As transformers: chat_template.jinja, when there is one, wins over the config's copy.
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        self._template_source: str | None = template
        self.has_chat_template = template is not None
        self._special = {k: _token_content(config.get(k))
                         for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._id_of(self._special["bos_token"])
        eos_id = self._id_of(self._special["eos_token"])
        if eos_id is None:
            raise TokenizerError(f"{config_path}: eos_token {self._special['eos_token']!r} is "
                                 f"missing or not in the vocabulary: set eos_token to a token of "
                                 f"tokenizer.json (generation stops at EOS)")
        self.eos_id = eos_id
        self.stop_ids = (eos_id, *checkpoint_eos_ids(directory, self.vocab_size, eos_id))
        pad_id = self._id_of(self._special["pad_token"])
        # Models without a pad token (Llama) pad with EOS; padded positions are masked anyway.
        self.pad_id = eos_id if pad_id is None else pad_id
        self._compiled: Any = None

    def vocabulary_digest(self) -> str:
        """``vocabulary_digest``: a hash of the (id, token) pairs, added tokens included."""
        pairs = sorted((i, t) for t, i in self._tok.get_vocab(with_added_tokens=True).items())
        return hashlib.sha1(json.dumps(pairs).encode()).hexdigest()

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template_source is None:
            raise TokenizerError(f"{self._directory!r}: no chat_template in "
                                 f"tokenizer_config.json or chat_template.jinja: add the model's "
                                 f"chat template, or give prompts instead of 'messages'")
        from jinja2.sandbox import SecurityError

        from meshrl.models import chat_template

        if self._compiled is None:
            self._compiled = chat_template.compile_template(self._template_source)
        specials = {k: v for k, v in self._special.items() if v is not None}
        try:
            return chat_template.render(self._compiled, messages=messages,
                                        add_generation_prompt=add_generation_prompt, **specials)
        except SecurityError as e:
            raise TokenizerError(f"{self._directory!r}: its chat template was stopped: {e}: "
                                 f"use the model's original template") from e


def checkpoint_eos_ids(directory: str, vocab_size: int, eos_id: int) -> list[int]:
    """The ids other than ``eos_id`` that end generation for the checkpoint in ``directory``,
    in order, where transformers' ``generate`` finds them: ``eos_token_id`` (an int or a list)
    of ``generation_config.json``, else of ``config.json`` (``GenerationConfig.
    from_model_config``); none when neither file names any."""
    value, path = None, ""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise TokenizerError(f"{path}: not a readable JSON object ({e}): copy the file "
                                 f"from the model's original release") from None
        if value is not None:
            break
    ids = [] if value is None else value if isinstance(value, list) else [value]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"{path}: eos_token_id {value!r}: every id must be an integer in "
                             f"[0, {vocab_size}) (the tokenizer's vocabulary); generation stops "
                             f"at these ids")
    return list(dict.fromkeys(i for i in ids if i != eos_id))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"char"`` for the built-in byte tokenizer, else a local directory with tokenizer.json."""
    if spec == "char":
        return CharTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise TokenizerError(f"tokenizer spec {spec!r}: not a local directory: must be 'char' or a "
                         f"local directory containing tokenizer.json (downloads are not "
                         f"supported)")


def resolve_tokenizer_spec(model: ModelConfig) -> str:
    """The tokenizer every job uses for ``model`` (a ``load_tokenizer`` spec).

    ``model.tokenizer`` says it, with no fallback between its three values: ``'auto'`` is the
    checkpoint's own ``<model.hf_path>/tokenizer.json`` (a ``ConfigError`` when it has none,
    whatever the vocabulary), or ``'char'`` without ``model.hf_path``; ``'char'`` is the
    built-in byte tokenizer, asked for on purpose (with ``model.hf_path`` only for a checkpoint
    that ships no tokenizer.json, such as an export of a char-tokenizer run); anything else is a
    local directory holding tokenizer.json.
    """
    spec = model.tokenizer
    if spec == "char":
        if model.hf_path and os.path.isfile(os.path.join(model.hf_path, "tokenizer.json")):
            raise ConfigError(f"model.tokenizer = 'char': model.hf_path = {model.hf_path!r} ships "
                              f"its own tokenizer.json: set model.tokenizer = 'auto' to use it "
                              f"(runs saved before 'auto' existed meant that)")
        return "char"
    if spec == "auto":
        if not model.hf_path:
            return "char"
        if not os.path.isfile(os.path.join(model.hf_path, "tokenizer.json")):
            raise ConfigError(f"model.hf_path = {model.hf_path!r}: has no tokenizer.json "
                              f"(model.tokenizer = 'auto' reads the checkpoint's own): copy the "
                              f"model's tokenizer.json and tokenizer_config.json into it, point "
                              f"model.tokenizer at a directory holding them, or set "
                              f"model.tokenizer = 'char' if it is a byte-vocabulary model")
        return model.hf_path
    if not os.path.isfile(os.path.join(spec, "tokenizer.json")):
        raise ConfigError(f"model.tokenizer = {spec!r}: no tokenizer.json there: point it at a "
                          f"local directory holding tokenizer.json (and tokenizer_config.json), "
                          f"or use 'auto' or 'char'; downloads are not supported")
    return spec


def tokenizer_for(model: ModelConfig, vocab_size: int | None = None) -> Tokenizer:
    """``load_tokenizer(resolve_tokenizer_spec(model))``, checked to fit the model:
    ``ConfigError`` when the tokenizer has more ids than the model's ``vocab_size``."""
    vocab = model.vocab_size if vocab_size is None else vocab_size
    spec = resolve_tokenizer_spec(model)
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"model.vocab_size = {vocab}: smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids ({spec!r}): use the model the tokenizer "
                          f"belongs to, or a vocab_size of at least {tokenizer.vocab_size}")
    if (model.hf_path and isinstance(tokenizer, HFTokenizer)
            and os.path.realpath(model.hf_path) != os.path.realpath(tokenizer._directory)):
        # A tokenizer from another directory: the checkpoint's own stop ids end generation too.
        extra = checkpoint_eos_ids(model.hf_path, tokenizer.vocab_size, tokenizer.eos_id)
        tokenizer.stop_ids = tuple(dict.fromkeys((*tokenizer.stop_ids, *extra)))
    return tokenizer
