"""File and synthetic sources: layouts, chat data, bad input, determinism."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from meshrl.configs.schema import DataConfig
from meshrl.datasets import DatasetError, eval_examples, make_prompt_iterator, make_sft_iterator
from meshrl.datasets.synthetic import generate
from meshrl.models.tokenizer import CharTokenizer

TOK = CharTokenizer()
GSM8K_ROWS = [{"question": f"Q{i}: what is {i}+{i}?", "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>"
                            f"{2 * i}\n#### {2 * i}"} for i in range(6)]
MATH_ROWS = [{"problem": f"Compute ${i}/2$.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$.",
              "level": "Level 1"} for i in range(4)]


def _jsonl(path: pathlib.Path, rows: list, extra_lines: tuple[str, ...] = ()) -> str:
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _all_prompts(data: DataConfig, n: int, tokenizer=TOK) -> list[dict]:
    return next(make_prompt_iterator(data, tokenizer, batch_size=n, seed=0))


def test_jsonl_gsm8k_layout_yields_prompt_answer_and_extra_fields(tmp_path):
    path = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    batch = _all_prompts(DataConfig(source="jsonl", path=path), 6)
    assert sorted(ex["prompt"] for ex in batch) == sorted(r["question"] for r in GSM8K_ROWS)
    assert all(ex["answer"].endswith(f"#### {int(ex['prompt'][1]) * 2}") for ex in batch)


def test_parquet_math_layout_with_configured_field_names(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH_ROWS), path)
    data = DataConfig(source="parquet", path=str(path), prompt_field="problem",
                      answer_field="solution")
    batch = _all_prompts(data, 4)
    assert {ex["prompt"] for ex in batch} == {r["problem"] for r in MATH_ROWS}
    assert all("\\boxed" in ex["answer"] and ex["level"] == "Level 1" for ex in batch)


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", GSM8K_ROWS[:2], extra_lines=('{"question": "x", ',))
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: malformed JSON"):
        make_prompt_iterator(DataConfig(source="jsonl", path=path), TOK, batch_size=1, seed=0)


@pytest.mark.parametrize("answer, error", [
    (None, r"rows\.jsonl:2: 'messages' ends with a 'user' turn and the row has no 'answer' "
           r"field: end the messages with the assistant turn to train on"),
    ([1, 2], r"rows\.jsonl:2: field 'answer' = \[1, 2\]: must be a string or number"),
])
def test_a_chat_row_without_an_assistant_turn_checks_its_answer_as_a_plain_row(tmp_path, answer,
                                                                               error):
    row = {"messages": [{"role": "user", "content": "hi"}]}
    if answer is not None:
        row["answer"] = answer
    path = _jsonl(tmp_path / "rows.jsonl", [GSM8K_ROWS[0], row])
    with pytest.raises(DatasetError, match=error):
        make_prompt_iterator(DataConfig(source="jsonl", path=path), TOK, batch_size=1, seed=0)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GSM8K_ROWS[0]).encode() + b'\n{"question": "caf\xe9", '
                     b'"answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9"):
        make_prompt_iterator(DataConfig(source="jsonl", path=str(path)), TOK, batch_size=1,
                             seed=0)


def test_a_carriage_return_inside_a_json_string_stays_in_its_row(tmp_path):
    rows = [{"question": "a\rb=", "answer": "1"}, {"question": "c=", "answer": "2"}]
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows))
    batch = _all_prompts(DataConfig(source="jsonl", path=str(path)), 2)
    assert {ex["prompt"] for ex in batch} == {"a\rb=", "c="}


def test_some_examples_too_long_on_few_a_row_never_read_as_all_dropped(tmp_path):
    # Each of 2 rows reads every other example of a stream reshuffled each epoch: long runs of
    # the one over-long prompt are chance, not a dataset with nothing to train on.
    path = _jsonl(tmp_path / "x.jsonl", [{"question": "short=", "answer": "1"},
                                         {"question": "L" * 50 + "=", "answer": "1"}])
    data = DataConfig(source="jsonl", path=path, max_prompt_len=20)
    for seed in range(8):
        it = make_prompt_iterator(data, TOK, batch_size=2, seed=seed)
        for _ in range(100):
            assert {ex["prompt"] for ex in next(it)} == {"short="}


def test_row_missing_a_field_names_file_line_and_field(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [GSM8K_ROWS[0], {"question": "no answer"}])
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: missing field\(s\) \['answer'\]"):
        make_prompt_iterator(DataConfig(source="jsonl", path=path), TOK, batch_size=1, seed=0)


@pytest.mark.parametrize("row", [[1, 2], {"question": 5, "answer": "1"},
                                 {"messages": [{"role": "user"}]}, {"messages": []}])
def test_rows_of_the_wrong_shape_are_errors_naming_the_line(tmp_path, row):
    path = _jsonl(tmp_path / "rows.jsonl", [GSM8K_ROWS[0], row])
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: "):
        make_prompt_iterator(DataConfig(source="jsonl", path=path), TOK, batch_size=1, seed=0)


def test_blank_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n\n  \n" + json.dumps(GSM8K_ROWS[1]) + "\n")
    it = make_prompt_iterator(DataConfig(source="jsonl", path=str(path)), TOK, batch_size=2,
                              seed=0)
    assert len(next(it)) == 2 and it.stats["blank_lines"] == 2


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_missing_file_is_a_clear_error(tmp_path, source: str):
    with pytest.raises(DatasetError, match=r"data.path = .*nope.*: file not found"):
        make_sft_iterator(DataConfig(source=source, path=str(tmp_path / "nope")), TOK,
                          batch_size=1, seq_len=16, seed=0)


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="holds no examples"):
        make_prompt_iterator(DataConfig(source="jsonl", path=str(path)), TOK, batch_size=1,
                             seed=0)


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        make_prompt_iterator(DataConfig(source="parquet", path=str(path)), TOK, batch_size=1,
                             seed=0)


def test_sft_chat_messages_train_only_on_the_last_assistant_turn(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"say {w}"},
                          {"role": "assistant", "content": w}]} for w in ("hi", "yo", "ok")]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    batch = next(make_sft_iterator(DataConfig(source="jsonl", path=path), TOK, batch_size=3,
                                   seq_len=64, seed=0, pack=False))
    for row in range(3):
        trained = batch["targets"][row][batch["loss_mask"][row] == 1]
        first = int(np.argmax(batch["loss_mask"][row]))  # its input is the last prompt token
        prompt = TOK.decode(batch["input_ids"][row][:first + 1])
        # The template renders "<|assistant|>\nhi\n"; the trailing newline is not trained on.
        assert trained[-1] == TOK.eos_id and TOK.decode(trained) in ("hi", "yo", "ok")
        assert "<|user|>\nsay " in prompt and prompt.endswith("<|assistant|>\n")


def test_chat_template_is_applied_to_plain_prompts_when_the_tokenizer_has_one(tmp_path):
    tok = CharTokenizer(use_chat_template=True)
    path = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS[:1])
    (ex,) = _all_prompts(DataConfig(source="jsonl", path=path), 1, tok)
    assert tok.decode(ex["prompt_ids"]) == f"<|user|>\n{GSM8K_ROWS[0]['question']}\n<|assistant|>\n"
    assert ex["prompt"] == GSM8K_ROWS[0]["question"]


def test_eval_path_gives_held_out_rows_and_no_path_gives_none(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:4])
    held = _jsonl(tmp_path / "eval.jsonl", GSM8K_ROWS[4:])
    assert len(eval_examples(DataConfig(source="jsonl", path=train, eval_path=held), TOK)) == 2
    assert eval_examples(DataConfig(source="jsonl", path=train), TOK) == []


def test_synthetic_generation_is_deterministic_and_correct():
    first = generate("arithmetic", 3, 0, 20, 3, ("+", "-", "*"))
    assert first == generate("arithmetic", 3, 0, 20, 3, ("+", "-", "*"))
    assert first != generate("arithmetic", 4, 0, 20, 3, ("+", "-", "*"))
    for ex in first:
        a, op, b = next(ex["prompt"][:-1].partition(o) for o in "+-*" if o in ex["prompt"])
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert int(ex["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                     "*": int(a) * int(b)}[op]
    countdown = generate("countdown", 0, 0, 10, 3)
    assert all(len(ex["numbers"]) == 4 and ex["target"] > 0 for ex in countdown)


def test_sft_iterator_over_countdown_masks_the_prompt(tmp_path):
    data = DataConfig(source="countdown", num_examples=10, max_prompt_len=300)
    batch = next(make_sft_iterator(data, TOK, batch_size=2, seq_len=300, seed=0))
    mask = batch["loss_mask"]
    assert mask.sum() > 0 and np.all(mask[batch["segment_ids"] == 0] == 0)


def test_over_long_training_examples_are_said_once_and_counted(tmp_path):
    from meshrl.tests.logs import captured

    rows = [{"question": "1+1=", "answer": "2"}, {"question": "x" * 80, "answer": "y"},
            {"question": "2+2=", "answer": "4"}, {"question": "z" * 80, "answer": "w"}]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with captured("meshrl.datasets") as messages:
        it = make_sft_iterator(DataConfig(source="jsonl", path=path, max_prompt_len=200), TOK,
                               batch_size=1, seq_len=32, seed=0, pack=False)
        for _ in range(6):
            next(it)

    drops = [m for m in messages if "dropped (dropped_overlong_sequence" in m]
    assert len(drops) == 1 and "rows.jsonl:" in drops[0], messages
    assert it.stats["dropped_overlong_sequence"] >= 2 and it.stats["examples"] == 6
