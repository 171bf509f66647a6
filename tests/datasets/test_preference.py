"""Preference data: JSONL rows checked with one clear error each, pairs tokenized as SFT does
(chat template, end of turn, EOS) into adjacent (chosen, rejected) rows with the loss mask on the
completion, the synthetic task, and the iterator's resumable state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.configs.dpo_schema import DPOConfig
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import DataConfig
from meshrl.datasets import PreferenceIterator, eval_pair_batches, load_pairs, tokenize_pairs
from meshrl.datasets.preference import pair_arrays, read_pairs
from meshrl.datasets.sources import DatasetError
from meshrl.models.tokenizer import CharTokenizer

TOK = CharTokenizer()
CHAT = CharTokenizer(use_chat_template=True)
GOOD = {"messages": [{"role": "user", "content": "2+2="}], "chosen": "4",
        "rejected": {"role": "assistant", "content": "5"}}


def _write(tmp_path, rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_read_pairs_accepts_strings_and_assistant_messages(tmp_path):
    pairs = read_pairs(_write(tmp_path, [GOOD, "", GOOD]))
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("4", "5"), ("4", "5")]
    assert pairs[1]["origin"].endswith("pairs.jsonl:3")  # blank lines keep line numbers


@pytest.mark.parametrize("row, rule", [
    ({"messages": GOOD["messages"], "rejected": "5"}, r"'chosen' = None: every row needs"),
    ({**GOOD, "rejected": "  "}, r"'rejected' = '  ': every row needs a non-empty"),
    ({**GOOD, "chosen": {"role": "user", "content": "4"}}, r"'chosen' = .*assistant message"),
    ({"chosen": "4", "rejected": "5"}, r"no 'messages'"),
    ({**GOOD, "messages": []}, r"'messages' = \[\]: must be a non-empty list"),
    ({**GOOD, "rejected": "4"}, r"'chosen' equals 'rejected'"),
    ("[1, 2]", r"row \[1, 2\] \(list\): every row must be a JSON object"),
    ("{oops", r"malformed JSON"),
])
def test_bad_row_raises_one_error_naming_file_line_and_rule(tmp_path, row, rule):
    path = _write(tmp_path, [GOOD, row])
    with pytest.raises(DatasetError, match=rf"pairs\.jsonl:2: {rule}"):
        read_pairs(path)


def test_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match=r"dpo.path = '.*nope.jsonl': no such file"):
        read_pairs(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match=r"no preference rows"):
        read_pairs(_write(tmp_path, [""]))


def test_pair_whose_completions_tokenize_alike_is_a_clear_error(tmp_path):
    # "4" and "4\n" differ as strings; the rendered turn's trailing newline is not trained.
    path = _write(tmp_path, [GOOD, {**GOOD, "rejected": "4\n"}])
    with pytest.raises(DatasetError, match=r"pairs\.jsonl:2: 'chosen' \('4'\) and 'rejected' "
                                           r"\('4\\n'\) give the same tokens"):
        tokenize_pairs(read_pairs(path), CHAT, 64, "drop")


def test_dpo_eval_path_without_dpo_path_is_refused():
    with pytest.raises(ConfigError, match=r"dpo.eval_path = 'held.jsonl' needs dpo.path"):
        DPOConfig(eval_path="held.jsonl")


def test_pair_is_two_adjacent_rows_with_mask_on_the_templated_completion(tmp_path):
    pairs = tokenize_pairs(read_pairs(_write(tmp_path, [GOOD])), CHAT, 64, "drop")
    arrays = pair_arrays(pairs, 64, CHAT.pad_id)
    prompt = [CHAT.bos_id, *CHAT.encode("<|user|>\n2+2=\n<|assistant|>\n")]
    for row, answer in ((0, "4"), (1, "5")):
        # The char template renders the turn as "answer\n": trailing newlines are not trained.
        completion = [*CHAT.encode(answer), CHAT.eos_id]
        full = prompt + completion
        n = len(full) - 1
        np.testing.assert_array_equal(arrays["input_ids"][row, :n], full[:-1])
        np.testing.assert_array_equal(arrays["targets"][row, :n], full[1:])
        trained = arrays["targets"][row][arrays["loss_mask"][row] > 0]
        assert CHAT.decode(trained) == answer and trained[-1] == CHAT.eos_id
        assert arrays["segment_ids"][row, :n].tolist() == [1] * n
        assert arrays["loss_mask"][row, n:].sum() == 0


def test_synthetic_pairs_through_a_chat_template_train_the_templated_answer():
    # Synthetic pairs carry a prompt and no messages: the completion is the assistant turn the
    # template renders after that prompt, as for the SFT rows of the same task.
    pair = load_pairs(DPOConfig(), DataConfig(num_examples=4, eval_examples=2),
                      held_out=False)[0]

    arrays = pair_arrays(tokenize_pairs([pair], CHAT, 64, "drop"), 64, CHAT.pad_id)

    for row, key in ((0, "chosen"), (1, "rejected")):
        trained = arrays["targets"][row][arrays["loss_mask"][row] > 0]
        assert CHAT.decode(trained) == pair[key] and trained[-1] == CHAT.eos_id


def test_overlong_pair_is_dropped_or_raised():
    short = {**GOOD, "rejected": "5", "origin": "f:2"}
    pair = {**short, "origin": "f:1", "chosen": "4" * 40}
    assert len(tokenize_pairs([pair, short], TOK, 40, "drop")) == 1
    with pytest.raises(DatasetError, match=r"f:1: prompt \+ chosen has \d+ positions > "
                                           r"trainer.seq_len = 40"):
        tokenize_pairs([pair, short], TOK, 40, "raise")
    with pytest.raises(DatasetError, match=r"every pair is over-long \(f:1: .*trainer.seq_len "
                                           r"= 40\): raise the limit it names"):
        tokenize_pairs([pair], TOK, 40, "drop")


def test_a_pair_whose_prompt_passes_data_max_prompt_len_is_dropped_or_raised():
    short = {**GOOD, "rejected": "5", "origin": "f:2"}
    long_prompt = {**short, "messages": [{"role": "user", "content": "1+" * 20 + "1="}],
                   "origin": "f:1"}
    assert len(tokenize_pairs([long_prompt, short], TOK, 200, "drop", max_prompt_len=40)) == 1
    with pytest.raises(DatasetError, match=r"f:1: prompt has \d+ tokens > data.max_prompt_len "
                                           r"= 40"):
        tokenize_pairs([long_prompt, short], TOK, 200, "raise", max_prompt_len=40)


def test_synthetic_pairs_prefer_the_correct_sum_over_a_wrong_number_of_as_many_digits():
    data = DataConfig(num_examples=50, eval_examples=20)
    train = load_pairs(DPOConfig(), data, held_out=False)
    held = load_pairs(DPOConfig(), data, held_out=True)
    assert len(train) == 50 and len(held) == 20
    for p in train:
        a, b = map(int, p["prompt"].rstrip("=").split("+"))
        assert p["chosen"] == str(a + b) and p["rejected"] != p["chosen"]
        assert len(p["rejected"]) == len(p["chosen"])
    assert {p["prompt"] for p in held} != {p["prompt"] for p in train[:20]}


def test_synthetic_held_out_pairs_share_no_prompt_with_training_and_repeat_none():
    data = DataConfig(source="arithmetic", difficulty=2)  # configs/dpo.py's task: 8,100 sums
    train = {p["prompt"] for p in load_pairs(DPOConfig(), data, held_out=False)}
    held = [p["prompt"] for p in load_pairs(DPOConfig(), data, held_out=True)]
    assert len(held) == data.eval_examples == len(set(held))
    assert not set(held) & train


def test_synthetic_task_needs_arithmetic():
    with pytest.raises(ConfigError, match=r"data.source = 'countdown': the synthetic "
                                           r"preference task needs 'arithmetic'"):
        load_pairs(DPOConfig(), DataConfig(source="countdown"), held_out=False)


def _iterator(pairs, **kw) -> PreferenceIterator:
    return PreferenceIterator(pairs, pairs_per_step=4, seq_len=16, pad_id=0, seed=3, **kw)


def test_iterator_resumes_exactly_and_processes_split_the_pairs():
    pairs = tokenize_pairs(load_pairs(DPOConfig(), DataConfig(num_examples=10), False), TOK,
                           16, "drop")
    it = _iterator(pairs)
    next(it), next(it)
    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(3)]
    again = _iterator(pairs)
    again.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(again)["input_ids"], want)
    halves = [_iterator(pairs, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        h.set_state(state)
    np.testing.assert_array_equal(
        np.concatenate([next(h)["input_ids"] for h in halves]), expected[0])
    with pytest.raises(DatasetError, match=r"state pairs = 10: this run's data has 9"):
        _iterator(pairs[:9]).set_state(state)


def test_eval_batches_pad_with_all_masked_pairs():
    pairs = tokenize_pairs(load_pairs(DPOConfig(), DataConfig(num_examples=3), False), TOK,
                           16, "drop")
    batches = eval_pair_batches(pairs, 4, 16, 0)
    assert len(batches) == 2 and batches[1]["input_ids"].shape == (4, 16)
    assert batches[1]["loss_mask"][2:].sum() == 0 and batches[1]["loss_mask"][:2].sum() > 0
