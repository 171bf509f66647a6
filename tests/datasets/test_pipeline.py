"""grain pipelines: batch layout, packing, determinism, sharding, resume, multi-epoch."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from meshrl.configs.schema import DataConfig
from meshrl.datasets import (
    DatasetError,
    eval_examples,
    make_prompt_iterator,
    make_sft_iterator,
    merge_row_states,
    pipeline,
)
from meshrl.models.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _prompts(batches: list[list[dict]]) -> list[str]:
    return [ex["prompt"] for batch in batches for ex in batch]


def test_sft_batch_has_documented_shapes_dtypes_and_next_token_targets():
    it = make_sft_iterator(DataConfig(num_examples=50), TOK, batch_size=8, seq_len=40, seed=0,
                           process_index=1, process_count=2)
    batch = next(it)
    dtypes = {"input_ids": np.int32, "targets": np.int32, "loss_mask": np.float32,
              "positions": np.int32, "segment_ids": np.int32}
    for name, dtype in dtypes.items():
        assert batch[name].shape == (4, 40) and batch[name].dtype == dtype, name
    seg = batch["segment_ids"]
    inside = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    # Within a segment, the target at t is the input at t+1.
    np.testing.assert_array_equal(batch["targets"][:, :-1][inside], batch["input_ids"][:, 1:][inside])


def test_packed_segments_restart_positions_and_mask_only_answer_tokens():
    batch = next(make_sft_iterator(DataConfig(num_examples=50), TOK, batch_size=2, seq_len=64,
                                   seed=3))
    for row in range(2):
        seg, pos = batch["segment_ids"][row], batch["positions"][row]
        assert seg.max() >= 2  # packing put several examples in the row
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            text = TOK.decode(batch["input_ids"][row, where])
            a, b = text[:-1].split("=")[0].split("+")
            trained = batch["targets"][row, where][batch["loss_mask"][row, where] == 1]
            # The trained targets are exactly the answer digits and EOS.
            assert trained[-1] == TOK.eos_id
            assert TOK.decode(trained) == str(int(a) + int(b))
        pad = seg == 0
        assert (batch["loss_mask"][row][pad] == 0).all()
        assert (batch["input_ids"][row][pad] == TOK.pad_id).all()


def test_unpacked_rows_hold_one_example_each():
    batch = next(make_sft_iterator(DataConfig(num_examples=10), TOK, batch_size=4, seq_len=64,
                                   seed=0, pack=False))
    assert (batch["segment_ids"].max(axis=1) == 1).all()


@pytest.mark.parametrize("kind", ["sft", "prompt"])
def test_resume_from_json_state_gives_same_continuation_across_epochs(kind: str):
    data = DataConfig(num_examples=13)

    def make():
        if kind == "sft":
            return make_sft_iterator(data, TOK, batch_size=4, seq_len=48, seed=5)
        return make_prompt_iterator(data, TOK, batch_size=4, seed=5)

    it = make()
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(6)]  # crosses several epoch boundaries
    resumed = make()
    resumed.set_state(state)
    got = [next(resumed) for _ in range(6)]
    if kind == "sft":
        for e, g in zip(expected, got, strict=True):
            for k in e:
                np.testing.assert_array_equal(e[k], g[k])
    else:
        assert got == expected
    assert resumed.stats == it.stats


def test_set_state_from_a_different_pipeline_is_rejected():
    a = make_prompt_iterator(DataConfig(num_examples=10), TOK, batch_size=2, seed=0)
    b = make_prompt_iterator(DataConfig(num_examples=10), TOK, batch_size=2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        b.set_state(a.get_state())


def test_two_process_sharding_splits_each_epoch_with_no_overlap_and_no_loss():
    data = DataConfig(num_examples=24, difficulty=4)  # 4 digits: no duplicate prompts
    shards = [make_prompt_iterator(data, TOK, batch_size=8, seed=7, process_index=p,
                                   process_count=2) for p in range(2)]
    per_process = [_prompts([next(it) for _ in range(3)]) for it in shards]  # 24 = one epoch
    assert set(per_process[0]).isdisjoint(per_process[1])
    single = make_prompt_iterator(data, TOK, batch_size=8, seed=7)
    everything = _prompts([next(single) for _ in range(3)])
    assert sorted(per_process[0] + per_process[1]) == sorted(everything)
    assert len(set(everything)) == len(everything)  # one epoch: each example exactly once


def test_shuffle_is_deterministic_per_seed_and_reshuffles_each_epoch():
    data = DataConfig(num_examples=16)

    def order(seed: int) -> list[str]:
        it = make_prompt_iterator(data, TOK, batch_size=16, seed=seed)
        return _prompts([next(it), next(it)])

    first, again, other = order(0), order(0), order(1)
    assert first == again and first != other
    epoch0, epoch1 = first[:16], first[16:]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_overlong_prompts_are_dropped_and_counted():
    data = DataConfig(source="countdown", num_examples=20, max_prompt_len=255)
    lengths = []
    it = make_prompt_iterator(data, TOK, batch_size=4, seed=0)
    for _ in range(10):
        lengths += [len(ex["prompt_ids"]) for ex in next(it)]
    assert max(lengths) <= 255
    assert it.stats["dropped_overlong_prompt"] > 0
    assert it.stats["examples"] == 40


def test_overlong_prompt_with_on_overlong_raise_names_the_example():
    data = DataConfig(source="countdown", num_examples=5, max_prompt_len=16, on_overlong="raise")
    with pytest.raises(DatasetError, match=r"countdown\[stream=0, index=\d\]: prompt has \d+ "
                                           r"tokens > data.max_prompt_len = 16"):
        next(make_prompt_iterator(data, TOK, batch_size=1, seed=0))


def test_sequences_over_seq_len_are_dropped_and_counted():
    # "123+456=" is 9 prompt ids with BOS; a 3-digit sum + EOS gives 12 positions, 4 digits 13.
    data = DataConfig(num_examples=40, difficulty=3)
    it = make_sft_iterator(data, TOK, batch_size=4, seq_len=12, seed=0)
    for _ in range(5):
        batch = next(it)
        trained = batch["targets"][batch["loss_mask"] == 1]
        assert len(TOK.decode(trained)) == 3 * int(batch["segment_ids"].astype(bool).any(1).sum())
    assert it.stats["dropped_overlong_sequence"] > 0


def test_when_every_example_is_overlong_the_iterator_raises_instead_of_spinning():
    data = DataConfig(num_examples=6, max_prompt_len=2)
    with pytest.raises(DatasetError, match="every example is dropped"):
        next(make_sft_iterator(data, TOK, batch_size=2, seq_len=32, seed=0))


def test_rl_prompts_that_fill_the_episode_are_overlong_prompts():
    # "123+456=" is 9 ids with BOS: an episode of 9 tokens leaves it no completion.
    data = DataConfig(num_examples=6, difficulty=3)
    with pytest.raises(DatasetError, match="every example is dropped"):
        next(make_prompt_iterator(data, TOK, batch_size=2, seed=0, prompt_room=8))
    assert eval_examples(data, TOK, prompt_room=8) == []
    assert len(eval_examples(data, TOK, prompt_room=9)) == data.eval_examples
    (ex,) = next(make_prompt_iterator(data, TOK, batch_size=1, seed=0, prompt_room=9))
    assert len(ex["prompt_ids"]) == 9
    strict = dataclasses.replace(data, on_overlong="raise")
    with pytest.raises(DatasetError, match=r"prompt has 9 tokens, leaving no room for a "
                                           r"completion in min\(trainer.seq_len, "
                                           r"sampler.max_len\) = 9"):
        next(make_prompt_iterator(strict, TOK, batch_size=1, seed=0, prompt_room=8))


def test_batch_size_not_divisible_by_process_count_is_rejected():
    with pytest.raises(ValueError, match="divisible by process_count"):
        make_prompt_iterator(DataConfig(), TOK, batch_size=3, seed=0, process_count=2)


def test_prompt_examples_carry_reward_fields_and_bos_prefixed_ids():
    data = DataConfig(source="countdown", num_examples=8, max_prompt_len=400)
    ex = next(make_prompt_iterator(data, TOK, batch_size=2, seed=0))[0]
    assert {"prompt", "prompt_ids", "answer", "numbers", "target"} <= set(ex)
    assert ex["prompt_ids"][0] == TOK.bos_id and TOK.decode(ex["prompt_ids"]) == ex["prompt"]
    assert "messages" not in ex and "origin" not in ex


@pytest.mark.parametrize("source", ["arithmetic", "countdown"])
def test_eval_examples_are_disjoint_from_the_training_set(source: str):
    data = DataConfig(source=source, num_examples=300, eval_examples=50, max_prompt_len=400)
    train = set(_prompts([next(make_prompt_iterator(data, TOK, batch_size=300, seed=0))]))
    held_out = eval_examples(data, TOK)
    assert len(held_out) == 50
    assert train.isdisjoint(ex["prompt"] for ex in held_out)
    assert all(ex["prompt_ids"] for ex in held_out)


def _sft(process_index: int = 0, process_count: int = 1, **kw) -> object:
    return make_sft_iterator(DataConfig(num_examples=37, difficulty=3), TOK, batch_size=4,
                             seq_len=40, seed=2, process_index=process_index,
                             process_count=process_count, **kw)


def _assert_batches_equal(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("pack", [True, False])
def test_global_sft_batch_is_the_same_for_one_two_and_four_processes(pack: bool):
    for count in (2, 4):
        single, shards = _sft(pack=pack), [_sft(p, count, pack=pack) for p in range(count)]
        for _ in range(6):  # several epochs of 37 examples
            local = [next(it) for it in shards]
            _assert_batches_equal(next(single),
                                  {k: np.concatenate([b[k] for b in local]) for k in local[0]})


def test_state_written_by_two_processes_resumes_on_one_and_on_four():
    shards = [_sft(p, 2) for p in range(2)]
    for _ in range(3):
        for it in shards:
            next(it)
    state = json.loads(json.dumps(merge_row_states([it.get_state() for it in shards])))
    expected = [{k: np.concatenate([b[k] for b in pair]) for k in pair[0]}
                for pair in ([next(it) for it in shards] for _ in range(4))]
    one = _sft()
    one.set_state(state)
    four = [_sft(p, 4) for p in range(4)]
    for it in four:
        it.set_state(state)
    for want in expected:
        _assert_batches_equal(want, next(one))
        quarter = [next(it) for it in four]
        _assert_batches_equal(want, {k: np.concatenate([b[k] for b in quarter]) for k in want})
    assert one.stats["examples"] == sum(it.stats["examples"] for it in four)


def test_state_of_one_process_rows_is_rejected_by_a_process_owning_other_rows():
    p0, p1 = _sft(0, 2), _sft(1, 2)
    next(p0)
    with pytest.raises(DatasetError, match=r"covers rows \[0, 2\) of 4; process 1 of 2 reads "
                                           r"rows \[2, 4\)"):
        p1.set_state(p0.get_state())


def test_state_of_a_different_batch_size_or_older_layout_is_rejected():
    state = _sft().get_state()
    other = make_sft_iterator(DataConfig(num_examples=37, difficulty=3), TOK, batch_size=8,
                              seq_len=40, seed=2)
    with pytest.raises(DatasetError, match="rows = 4: this run's pipeline has 8"):
        other.set_state(state)
    for older in (1, 2):  # per-process layout; grain's shuffle order
        with pytest.raises(DatasetError,
                           match=f"state version = {older}: this build reads version 3"):
            _sft().set_state({**state, "version": older})


def test_every_epoch_is_a_permutation_over_more_epochs_than_are_cached():
    data = DataConfig(num_examples=3, difficulty=4)  # 4 digits: no duplicate prompts
    it = make_prompt_iterator(data, TOK, batch_size=1, seed=4)
    prompts = _prompts([next(it) for _ in range(3 * 12)])
    epochs = [prompts[i:i + 3] for i in range(0, len(prompts), 3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled, not one order repeated


def test_an_evicted_epoch_order_is_recomputed_identically():
    it = make_prompt_iterator(DataConfig(num_examples=50), TOK, batch_size=2, seed=9)
    first = it._order(0).copy()
    for epoch in range(1, 8):  # pushes epoch 0 out of the cache
        it._order(epoch)
    assert 0 not in it._orders
    np.testing.assert_array_equal(it._order(0), first)
    np.testing.assert_array_equal(np.sort(first), np.arange(50))


def _count_tokenize_calls(monkeypatch) -> list[int]:
    calls = []
    tokenize = pipeline._Tokenize.__call__

    def counting(self, ex):
        calls.append(1)
        return tokenize(self, ex)
    monkeypatch.setattr(pipeline._Tokenize, "__call__", counting)
    return calls


def test_sft_iterator_tokenizes_each_example_once_over_many_epochs(monkeypatch):
    calls = _count_tokenize_calls(monkeypatch)
    it = _sft()
    batches = [next(it) for _ in range(40)]  # ~8 epochs of 37 examples

    assert it.stats["epoch"] >= 5
    assert len(calls) == 37
    fresh = _sft(cache_tokens=0)  # tokenizes every read: the batches must not change
    for b in batches:
        _assert_batches_equal(b, next(fresh))
    assert not fresh._tokenized


def test_sft_iterator_stops_caching_at_its_token_budget(monkeypatch):
    calls = _count_tokenize_calls(monkeypatch)
    it = _sft(cache_tokens=60)  # room for a few examples of ~10-14 tokens
    for _ in range(20):
        next(it)

    cached = sum(len(ex["_input"]) for ex in it._tokenized.values())
    assert 0 < len(it._tokenized) < 37 and cached <= 60
    assert len(calls) > 37  # the rest are tokenized at every read


def test_a_prompt_answer_row_ends_its_turn_as_the_chat_template_does(tmp_path):
    # ChatML closes a turn with <|im_end|>, which is not EOS here: a row given as
    # prompt/answer must be trained on the same end of turn as the same row as messages.
    from meshrl.datasets.render import prompt_text, response_ids
    from meshrl.models.tokenizer import HFTokenizer
    from meshrl.tests.jobs.real_model import train_tokenizer

    train_tokenizer(tmp_path)  # ChatML; a base model's EOS, as in Qwen2.5's base release
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "eos_token": "<|endoftext|>"}))
    tok = HFTokenizer(str(tmp_path))
    plain = {"prompt": "What is 2+3?", "answer": "5"}
    chat = {**plain, "messages": [{"role": "user", "content": "What is 2+3?"}]}

    targets = [response_ids(ex, prompt_text(ex, tok), tok) for ex in (plain, chat)]

    assert targets[0] == targets[1]
    assert tok.encode("<|im_end|>")[0] in targets[0]


def test_a_held_out_chat_row_is_evaluated_on_the_target_it_is_trained_on(tmp_path):
    # A system turn before the user's: the held-out target must be rendered from the whole
    # conversation, as training renders it (ChatML's <|im_end|> is not EOS here).
    from meshrl.datasets import eval_examples, make_sft_iterator
    from meshrl.models.tokenizer import HFTokenizer
    from meshrl.tests.jobs.real_model import train_tokenizer

    train_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "eos_token": "<|endoftext|>"}))
    tok = HFTokenizer(str(tmp_path))
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"}]}) + "\n")
    data = DataConfig(source="jsonl", path=str(rows), eval_path=str(rows), eval_examples=1)

    batch = next(make_sft_iterator(data, tok, batch_size=1, seq_len=96, seed=0, pack=False))
    held = eval_examples(data, tok, teacher_forced=True)[0]

    trained = batch["targets"][0][batch["loss_mask"][0] == 1].tolist()
    assert [t for t, m in zip(held["_target"], held["_mask"], strict=True) if m] == trained
    n = len(held["_input"])
    assert held["_input"] == batch["input_ids"][0][:n].tolist()
    assert tok.encode("<|im_end|>")[0] in trained
