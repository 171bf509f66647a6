"""Chat templates render in a bounded sandbox: huge numbers, strings and outputs are refused in
milliseconds with one clear error, and ordinary templates render as before."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from jinja2.sandbox import SecurityError

from meshrl.models import chat_template
from meshrl.models.tokenizer import HFTokenizer, TokenizerError

MESSAGES = [{"role": "user", "content": "what is 2+2?"}]
NS = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"

HOSTILE = {
    "huge power": "{{ 7**(10**6) }}",
    "huge repetition": "{{ 'a'*10**7 }}",
    "huge list": "{{ [1]*10**8 }}",
    "doubling with ~": NS + "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling with +": NS + "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}"
                "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "huge filter width": "{{ ''|center(10**9) }}",
    "huge method width": "{{ ''.ljust(10**9) }}",
    "huge format width": "{{ '%999999999d'|format(1) }}",
    "huge %-width": "{{ '%999999999d' % 1 }}",
    "huge str.format width": "{{ '{:>999999999}'.format(1) }}",
    "huge output": "{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_template_building_huge_values_is_refused_quickly(source: str):
    start = time.monotonic()
    with pytest.raises(SecurityError, match="MAX_"):
        chat_template.render(chat_template.compile_template(source), messages=MESSAGES)
    assert time.monotonic() - start < 2.0


def test_ordinary_template_features_render_unchanged():
    source = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] ~ '!' }}{% endfor %}"
              "{{ 2**10 }} {{ '-' * 3 }} {{ '%3d'|format(7) }} {{ '{:>3}'.format(1) }} "
              "{{ 'x'|center(5) }} {{ messages|tojson }}")
    out = chat_template.render(chat_template.compile_template(source), messages=MESSAGES)
    assert out == ("<|user|>what is 2+2?!1024 ---   7   1   x   "
                   + json.dumps(MESSAGES, ensure_ascii=False))


def test_hf_tokenizer_reports_a_runaway_chat_template_as_one_tokenizer_error(
        tmp_path: pathlib.Path):
    _word_tokenizer(tmp_path, "{{ 'a' * 10**7 }}")
    with pytest.raises(TokenizerError, match="chat template was stopped.*MAX_TEMPLATE_CHARS"):
        HFTokenizer(str(tmp_path)).apply_chat_template(MESSAGES)


def test_transformers_template_features_render_as_transformers_renders_them():
    # The generation tag (assistant masks), strftime_now (Llama 3.x's date), tools/documents
    # passed as None, and tojson's options: each a template transformers renders.
    import datetime

    source = ("{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
              "{% endfor %}{{ strftime_now('%Y') }} {{ tools is none }} {{ documents is none }} "
              "{{ {'b': 1, 'a': 2}|tojson(sort_keys=True, separators=(',', ':')) }}")

    out = chat_template.render(chat_template.compile_template(source), messages=MESSAGES)

    year = datetime.datetime.now().strftime("%Y")
    assert out == f'[what is 2+2?]{year} True True {{"a":2,"b":1}}'


def test_chat_template_jinja_wins_over_the_configs_copy_as_in_transformers(
        tmp_path: pathlib.Path):
    _word_tokenizer(tmp_path, "config")
    (tmp_path / "chat_template.jinja").write_text("jinja")

    assert HFTokenizer(str(tmp_path)).apply_chat_template(MESSAGES) == "jinja"


def _word_tokenizer(directory: pathlib.Path, template: str) -> None:
    """A two-word tokenizer.json and a tokenizer_config.json with ``template``."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    RustTokenizer(models.WordLevel({"</s>": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "chat_template": template}))
