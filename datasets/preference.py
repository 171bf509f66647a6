"""Preference data: (prompt, chosen, rejected) pairs as ``PreferenceBatch`` rows.

A JSONL row holds the chat ``messages`` of the prompt and the ``chosen`` and ``rejected``
completions, each a string or one assistant message ``{"role": "assistant", "content": ...}``.
The synthetic preference task (no file) takes the SFT task of ``data.source``: the chosen
completion is the correct answer, the rejected one a wrong answer of the same form.

Both completions are tokenized as the SFT pipeline tokenizes its response (the model's chat
template, end of turn and EOS included), after the prompt as the SFT pipeline renders it. A pair
becomes two adjacent rows, chosen then rejected, each ``prompt + completion`` with the loss mask
on the completion's tokens. The pairs are read in a fresh permutation each epoch (grain map over
the pair indices); the state is the count of pairs consumed, equal on every process.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from meshrl.configs.cross_section import check_preference_source
from meshrl.configs.dpo_schema import DPOConfig
from meshrl.configs.paths import preference_file_problem
from meshrl.configs.schema import DataConfig
from meshrl.datasets import synthetic
from meshrl.datasets.render import encode_prompt, prompt_text, response_ids
from meshrl.datasets.sources import (
    DatasetError,
    _check_messages,
    disjoint_examples,
    jsonl_rows,
    row_errors,
)
from meshrl.models.tokenizer import Tokenizer
from meshrl.utils.log import get_logger

log = get_logger("datasets")
STATE_VERSION = 1


def _completion(row: dict, key: str, origin: str) -> str:
    value = row.get(key)
    if isinstance(value, dict) and value.get("role") == "assistant":
        value = value.get("content")
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{origin}: {key!r} = {row.get(key)!r:.80}: every row needs a "
                           f"non-empty '{key}' completion (a string or an assistant message "
                           f"{{'role': 'assistant', 'content': ...}})")
    return value


def row_to_pair(row: Any, origin: str) -> dict:
    """One JSONL row -> ``{"messages", "chosen", "rejected", "origin"}``; a row that cannot be
    used raises ``DatasetError`` naming ``origin`` (file:line) and the rule."""
    if not isinstance(row, dict):
        raise DatasetError(f"{origin}: row {row!r:.60} ({type(row).__name__}): every row must be "
                           f"a JSON object with 'messages', 'chosen' and 'rejected'")
    if "messages" not in row:
        raise DatasetError(f"{origin}: no 'messages' (row has {sorted(row)}): every row needs "
                           f"the prompt as chat 'messages'")
    messages = _check_messages(row["messages"], origin)
    chosen, rejected = _completion(row, "chosen", origin), _completion(row, "rejected", origin)
    if chosen == rejected:
        raise DatasetError(f"{origin}: 'chosen' equals 'rejected' ({chosen!r:.60}): a pair "
                           f"must prefer one completion over a different one")
    return {"messages": messages, "chosen": chosen, "rejected": rejected, "origin": origin}


def read_pairs(path: str, field: str = "dpo.path") -> list[dict]:
    """The pairs of the JSONL file ``path`` (the config field ``field``), every row checked."""
    problem = preference_file_problem(field, path)  # the dry run's check of dpo.* paths too
    if problem:
        raise DatasetError(problem)
    pairs = [row_to_pair(row, f"{path}:{lineno}") for lineno, row in jsonl_rows(path)
             if row is not None]
    if not pairs:
        raise DatasetError(f"{path}: no preference rows: the file needs at least one row")
    return pairs


def synthetic_pairs(data: DataConfig, stream: int, count: int, start: int = 0) -> list[dict]:
    """``count`` pairs of the arithmetic task from index ``start``: chosen the correct answer,
    rejected a different number with as many digits (drawn from the example's own seed, so
    reproducible)."""
    check_preference_source("", data.source)  # a Config has passed it; a bare DataConfig not
    pairs = []
    for i in range(start, start + count):
        ex = synthetic.arithmetic_example(data.shuffle_seed, stream, i, data.difficulty,
                                          data.ops)
        rng = np.random.default_rng([data.shuffle_seed & 0xFFFFFFFF, stream, i, 1])
        value, width = int(ex["answer"]), len(ex["answer"].lstrip("-"))
        lo, hi = (0 if width == 1 else 10 ** (width - 1)), 10 ** width
        wrong = value
        while wrong == value:
            wrong = int(rng.integers(lo, hi)) * (-1 if value < 0 else 1)
        # A plain prompt, rendered as the SFT task renders it (templated only when the
        # tokenizer has a chat template).
        pairs.append({"prompt": ex["prompt"], "messages": None,
                      "chosen": ex["answer"], "rejected": str(wrong),
                      "origin": f"synthetic:{stream}:{i}"})
    return pairs


class TokenizePair:
    """grain map: pair -> ``{"rows": [(input, target, mask) chosen, rejected]}``, or
    ``{"_drop": reason}`` when its prompt is longer than ``max_prompt_len`` or a row longer
    than ``seq_len``."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, max_prompt_len: int | None = None
                 ) -> None:
        self.tokenizer, self.seq_len, self.max_prompt_len = tokenizer, seq_len, max_prompt_len

    def __call__(self, pair: dict) -> dict:
        with row_errors(pair):
            return self._tokenize(pair)

    def _tokenize(self, pair: dict) -> dict:
        text = prompt_text(pair, self.tokenizer)
        ids = encode_prompt(text, self.tokenizer)
        if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
            return {"_drop": f"{pair['origin']}: prompt has {len(ids)} tokens > "
                             f"data.max_prompt_len = {self.max_prompt_len}"}
        rows = []
        for key in ("chosen", "rejected"):
            # The whole pair: a synthetic one has a ``prompt`` and no ``messages``.
            full = ids + response_ids({**pair, "answer": pair[key]}, text, self.tokenizer)
            if len(full) - 1 > self.seq_len:
                return {"_drop": f"{pair['origin']}: prompt + {key} has {len(full) - 1} "
                                 f"positions > trainer.seq_len = {self.seq_len}"}
            rows.append((full[:-1], full[1:], [0.0] * (len(ids) - 1) + [1.0] *
                         (len(full) - len(ids))))
        if rows[0] == rows[1]:  # e.g. completions that differ only in trailing whitespace
            raise DatasetError(f"{pair['origin']}: 'chosen' ({pair['chosen']!r:.40}) and "
                               f"'rejected' ({pair['rejected']!r:.40}) give the same tokens: a "
                               f"pair must prefer one completion over a different one")
        return {"rows": rows}


def tokenize_pairs(pairs: list[dict], tokenizer: Tokenizer, seq_len: int, on_overlong: str,
                   max_prompt_len: int | None = None) -> list[dict]:
    """Every pair tokenized through a grain map; pairs over ``max_prompt_len`` prompt tokens or
    ``seq_len`` positions dropped and counted (or raised with ``data.on_overlong = "raise"``)."""
    ds = grain.MapDataset.source(pairs).map(TokenizePair(tokenizer, seq_len, max_prompt_len))
    out = [ds[i] for i in range(len(pairs))]
    drops = [ex["_drop"] for ex in out if "_drop" in ex]
    if drops and on_overlong == "raise":
        raise DatasetError(f"{drops[0]}: shorten it, raise the limit, or set data.on_overlong = "
                           f"'drop'")
    if drops:
        log.warning("preference data: dropped %d over-long pairs of %d (first: %s)",
                    len(drops), len(out), drops[0])
    kept = [ex for ex in out if "_drop" not in ex]
    if not kept:
        raise DatasetError(f"preference data: every pair is over-long ({drops[0]}): raise "
                           f"the limit it names")
    return kept


def pair_arrays(pairs: list[dict], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """``[2 * len(pairs), seq_len]`` arrays, pair ``i`` in rows ``2 i`` (chosen) and ``2 i + 1``
    (rejected), one sequence per row (segment 1), padding after it (segment 0)."""
    R, L = 2 * len(pairs), seq_len
    out = {"input_ids": np.full((R, L), pad_id, np.int32),
           "targets": np.full((R, L), pad_id, np.int32),
           "loss_mask": np.zeros((R, L), np.float32), "positions": np.zeros((R, L), np.int32),
           "segment_ids": np.zeros((R, L), np.int32)}
    for r, (inp, tgt, mask) in enumerate(row for p in pairs for row in p["rows"]):
        n = len(inp)
        out["input_ids"][r, :n], out["targets"][r, :n], out["loss_mask"][r, :n] = inp, tgt, mask
        out["positions"][r, :n], out["segment_ids"][r, :n] = np.arange(n), 1
    return out


def load_pairs(dpo: DPOConfig, data: DataConfig, held_out: bool) -> list[dict]:
    """The training pairs, or the held-out ones (``[]`` when a file run has no eval file)."""
    path = dpo.eval_path if held_out else dpo.path
    if dpo.path:
        if not held_out:
            return read_pairs(path)
        return read_pairs(path, "dpo.eval_path")[:data.eval_examples] if path else []
    train = synthetic_pairs(data, synthetic.TRAIN_STREAM, data.num_examples)
    if not held_out:
        return train
    if data.eval_examples == 0:
        return []
    return disjoint_examples(
        lambda start: synthetic_pairs(data, synthetic.EVAL_STREAM, data.eval_examples, start),
        {p["prompt"] for p in train}, data)


class PreferenceIterator:
    """Yields dicts of ``[2 * pairs_per_step // process_count, seq_len]`` arrays (this
    process's pairs); global step ``k`` reads pairs ``k * pairs_per_step ...`` of the stream of
    epoch permutations, process ``p`` its ``p``-th contiguous block of them."""

    def __init__(self, pairs: list[dict], *, pairs_per_step: int, seq_len: int, pad_id: int,
                 seed: int, process_index: int = 0, process_count: int = 1) -> None:
        if pairs_per_step % process_count:
            raise ValueError(f"pairs per step = {pairs_per_step}: must be divisible by "
                             f"process_count = {process_count}")
        self._pairs, self._seed = pairs, seed
        self.pairs_per_step, self.seq_len, self._pad = pairs_per_step, seq_len, pad_id
        n = pairs_per_step // process_count
        self._mine = range(process_index * n, (process_index + 1) * n)
        self._cursor = 0  # pairs of the global stream consumed
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    def _pair(self, pos: int) -> dict:
        epoch, i = divmod(pos, len(self._pairs))
        if self._order[0] != epoch:  # one permutation per epoch, from (seed, epoch) alone
            self._order = (epoch, np.random.default_rng(
                [self._seed & 0xFFFFFFFF, epoch]).permutation(len(self._pairs)))
        return self._pairs[int(self._order[1][i])]

    def __iter__(self) -> PreferenceIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = [self._pair(self._cursor + j) for j in self._mine]
        self._cursor += self.pairs_per_step
        return pair_arrays(batch, self.seq_len, self._pad)

    def get_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "cursor": self._cursor, "pairs": len(self._pairs),
                "seed": self._seed}

    def set_state(self, state: dict[str, Any]) -> None:
        mine = self.get_state()
        for key in ("version", "pairs", "seed"):
            if state.get(key) != mine[key]:
                raise DatasetError(f"checkpointed preference iterator state {key} = "
                                   f"{state.get(key)!r}: this run's data has {mine[key]!r}, so "
                                   f"it cannot resume exactly: use a new --workdir or the data "
                                   f"config that wrote it")
        self._cursor = int(state["cursor"])


def eval_pair_batches(pairs: list[dict], rows: int, seq_len: int, pad_id: int
                      ) -> list[dict[str, np.ndarray]]:
    """Tokenized held-out ``pairs`` in batches of ``rows`` rows (``rows / 2`` pairs), the last
    one padded with all-masked pairs."""
    out = []
    for i in range(0, len(pairs), rows // 2):
        batch = pair_arrays(pairs[i:i + rows // 2], seq_len, pad_id)
        short = rows - batch["input_ids"].shape[0]
        pad = {"input_ids": pad_id, "targets": pad_id}
        out.append({k: np.pad(v, ((0, short), (0, 0)), constant_values=pad.get(k, 0))
                    for k, v in batch.items()})
    return out
