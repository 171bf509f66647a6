"""grain pipelines: shuffled, sharded, multi-epoch, checkpointable prompt and SFT iterators.

The example stream is ``grain.MapDataset.range(n).map(tokenize example i)`` read in a fresh
permutation every epoch (one numpy permutation per epoch, see ``_StreamIterator._order``). Each
global batch row ``j`` of ``batch_size`` rows reads its own sub-stream, positions ``j, j +
batch_size, ...``, and each process owns a contiguous block of rows, so processes read disjoint
elements (no overlap, no loss) and a global batch, packed or not, is the same for every process
count. The state is one cursor and a few counters per row: ``get_state()`` gathers every row's
(a collective with several processes) into a small JSON-able dict, and ``set_state`` resumes
the exact continuation on any process count that divides the batch, without replaying data.
Design notes: docs/data.md.
"""

from __future__ import annotations

import sys
from typing import Any

import grain
import numpy as np

from meshrl.configs.schema import DataConfig
from meshrl.datasets import sources
from meshrl.datasets.render import encode_prompt, prompt_text, response_ids
from meshrl.datasets.sources import DatasetError, row_errors
from meshrl.models.tokenizer import Tokenizer
from meshrl.utils import multihost
from meshrl.utils.log import get_logger

log = get_logger("datasets")

STATE_VERSION = 3
_ROW_COUNTS = ("examples", "dropped_overlong_prompt", "dropped_overlong_sequence")
# Epoch permutations kept (rows' cursors can be in different epochs; see _StreamIterator._order).
_CACHED_EPOCHS = 4
# Input tokens an SFT iterator keeps tokenized examples for (see SFTIterator._example): at
# most ~60 MB of Python id lists; every example of a set up to that size is tokenized once.
SFT_CACHE_TOKENS = 1 << 20
# Keys that are pipeline plumbing, not reward fields handed to workflows.
_INTERNAL = ("messages", "origin", "_drop", "_input", "_target", "_mask", "_answer_message")


class _Tokenize:
    """grain map: example -> example with token ids, or marked ``_drop`` with the reason."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, seq_len: int | None,
                 prompt_room: int | None = None) -> None:
        self.data, self.tokenizer, self.seq_len = data, tokenizer, seq_len
        self.prompt_room = prompt_room  # RL: the longest prompt that leaves a completion room

    def _overlong(self, ex: dict, reason: str, detail: str) -> dict:
        if self.data.on_overlong == "raise":
            raise DatasetError(f"{ex.get('origin', '?')}: {detail}: shorten it, raise the limit, "
                               f"or set data.on_overlong = 'drop'")
        return {"_drop": reason, "origin": ex.get("origin")}

    def __call__(self, ex: dict) -> dict:
        with row_errors(ex):
            return self._tokenize(ex)

    def _tokenize(self, ex: dict) -> dict:
        text = prompt_text(ex, self.tokenizer)
        ids = encode_prompt(text, self.tokenizer)
        if len(ids) > self.data.max_prompt_len:
            return self._overlong(ex, "dropped_overlong_prompt",
                                  f"prompt has {len(ids)} tokens > data.max_prompt_len = "
                                  f"{self.data.max_prompt_len}")
        if self.prompt_room is not None and len(ids) > self.prompt_room:
            return self._overlong(ex, "dropped_overlong_prompt",
                                  f"prompt has {len(ids)} tokens, leaving no room for a "
                                  f"completion in min(trainer.seq_len, sampler.max_len) = "
                                  f"{self.prompt_room + 1}")
        out = {k: v for k, v in ex.items() if k not in _INTERNAL}
        out.update(prompt=ex["prompt"], prompt_text=text, prompt_ids=ids)
        if self.seq_len is None:
            return out
        full = ids + response_ids(ex, text, self.tokenizer)
        if len(full) - 1 > self.seq_len:
            return self._overlong(ex, "dropped_overlong_sequence",
                                  f"prompt + response has {len(full) - 1} positions > "
                                  f"trainer.seq_len = {self.seq_len}")
        # Position t predicts token t+1; only response tokens are trained on.
        out["_input"], out["_target"] = full[:-1], full[1:]
        out["_mask"] = [0.0] * (len(ids) - 1) + [1.0] * (len(full) - len(ids))
        return out


class _TokenizeAt:
    """grain map: example index -> ``_Tokenize`` of that example."""

    def __init__(self, examples: list[dict], tokenize: _Tokenize) -> None:
        self.examples, self.tokenize = examples, tokenize

    def __call__(self, index: int) -> dict:
        return self.tokenize(self.examples[index])


def mix_seed(seed: int, shuffle_seed: int) -> int:
    """The shuffle's seed: ``trainer.seed`` mixed with ``data.shuffle_seed``."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, shuffle_seed & 0xFFFFFFFF])
               .generate_state(1)[0])


def merge_row_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from per-process states of adjacent row blocks (``get_state``'s parts)."""
    parts = sorted(parts, key=lambda s: s["row_start"])
    for a, b in zip(parts, parts[1:]):
        if a["row_start"] + len(a["cursor"]) != b["row_start"]:
            raise DatasetError(f"data iterator states do not tile the batch rows: one starts at "
                               f"row {b['row_start']}, after rows [{a['row_start']}, "
                               f"{a['row_start'] + len(a['cursor'])})")
    merged = {k: [x for s in parts for x in s[k]] for k in ("cursor", *_ROW_COUNTS)}
    return {**parts[0], **merged}


class _StreamIterator:
    """Forward-only cursors over the shuffled, repeated example stream: one cursor per global
    batch row. Row ``j`` of ``rows`` reads positions ``j, j + rows, j + 2 * rows, ...`` (its own
    sub-stream), and process ``p`` of ``N`` owns rows ``[p * rows / N, (p + 1) * rows / N)``.
    A global batch is therefore the same for any process count that divides ``rows``, and so is
    the saved state, which lists every row's cursor (see ``get_state``)."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, *, seq_len: int | None,
                 batch_size: int, seed: int, process_index: int, process_count: int,
                 prompt_room: int | None = None) -> None:
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index = {process_index}, process_count = {process_count}: "
                             f"need 0 <= process_index < process_count")
        if batch_size % process_count:
            raise ValueError(f"batch_size = {batch_size}: must be divisible by process_count = "
                             f"{process_count} (each process reads batch_size // process_count)")
        self._source_stats: dict[str, int] = {}
        examples = sources.load_train(data, self._source_stats)
        self._num_examples = len(examples)
        self._seed = mix_seed(seed, data.shuffle_seed)
        self.rows = batch_size
        self.local_batch_size = batch_size // process_count
        self.process_index, self.process_count = process_index, process_count
        lo = process_index * self.local_batch_size
        self._my_rows = range(lo, lo + self.local_batch_size)
        # grain.MapDataset.source would record per-element read metrics: 2x the cost per
        # element of this index -> example map.
        self._ds = grain.MapDataset.range(len(examples)).map(
            _TokenizeAt(examples, _Tokenize(data, tokenizer, seq_len, prompt_room)))
        self._orders: dict[int, np.ndarray] = {}
        n = self.local_batch_size
        # Per owned row: next position in its sub-stream, examples taken, drops by reason.
        self._cursor = np.zeros(n, np.int64)
        self._counts = {k: np.zeros(n, np.int64) for k in _ROW_COUNTS}
        self._batches = 0
        self._peeked: dict[int, tuple[int, dict]] = {}
        self._usable: bool | None = None  # some example is kept (``_any_usable``)

    def _peek(self, r: int) -> dict:
        """Owned row ``r``'s next usable example (not consumed); drops are counted once."""
        streak = 0
        while True:
            pos = int(self._cursor[r]) * self.rows + self._my_rows[r]
            cached = self._peeked.get(r)
            if cached is None or cached[0] != pos:  # tokenize each stream position once
                epoch, i = divmod(pos, self._num_examples)
                self._peeked[r] = cached = (pos, self._example(int(self._order(epoch)[i])))
            ex = cached[1]
            if "_drop" not in ex:
                return ex
            if not self._counts[ex["_drop"]].any():  # said once per reason; counted always
                log.warning("data: %s dropped (%s; data.on_overlong = 'drop'); every such "
                            "example is skipped, counted in summary.json's 'data'",
                            ex.get("origin", "?"), ex["_drop"])
            self._counts[ex["_drop"]][r] += 1
            self._cursor[r] += 1
            streak += 1
            # A row reads every ``rows``-th example of a stream reshuffled each epoch, so a long
            # run of drops may be chance: only a dataset with no usable example ends the run.
            if streak > self._num_examples + 1:
                if not self._any_usable():
                    raise DatasetError(f"data: every example is dropped (last: "
                                       f"{ex['origin']}, stats {self.stats}): raise "
                                       f"data.max_prompt_len or trainer.seq_len")
                streak = 0

    def _any_usable(self) -> bool:
        """Whether any example of the dataset is kept (scanned once, when a row has dropped
        more examples in a row than the dataset holds)."""
        if self._usable is None:
            self._usable = any("_drop" not in self._example(i)
                               for i in range(self._num_examples))
        return self._usable

    def _example(self, index: int) -> dict:
        """Example ``index`` tokenized (the element of the grain dataset)."""
        return self._ds[index]

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of the example indices, from (seed, epoch) alone.

        One O(n) numpy permutation per epoch instead of grain's ``MapDataset.shuffle``, whose
        per-element ``index_shuffle`` call releases the GIL, so inside a train loop each element
        waited to take it back (docs/data.md). The cost is ``4 n`` bytes per cached epoch; rows'
        cursors drift apart by a few epochs at most, and an evicted epoch is recomputed."""
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) >= _CACHED_EPOCHS:
                del self._orders[min(self._orders)]
            rng = np.random.default_rng([self._seed, epoch])
            order = rng.permutation(self._num_examples)
            if self._num_examples < 2 ** 31:
                order = order.astype(np.int32)  # half the memory of the cached orders
            self._orders[epoch] = order
        return order

    def _take(self, r: int) -> dict:
        ex = self._peek(r)
        self._cursor[r] += 1
        self._counts["examples"][r] += 1
        return ex

    def __iter__(self) -> _StreamIterator:
        return self

    @property
    def stats(self) -> dict[str, int]:
        """This process's counters: examples taken, drops by reason, batches, and the epoch
        the slowest owned row is in."""
        positions = self._cursor * self.rows + np.asarray(self._my_rows)
        return {**self._source_stats, **{k: int(v.sum()) for k, v in self._counts.items()},
                "batches": self._batches,
                "epoch": int(positions.min()) // max(self._num_examples, 1)}

    def _identity(self) -> dict[str, int]:
        return {"version": STATE_VERSION, "seed": self._seed, "num_examples": self._num_examples,
                "rows": self.rows}

    def get_state(self) -> dict[str, Any]:
        """JSON-able state of every row, the same on every process: with several processes
        this is a collective (each process contributes its rows), so every process calls it at
        the same step. ``set_state`` on any process count that divides ``rows`` resumes the
        exact continuation."""
        local = {**self._identity(), "row_start": self._my_rows.start,
                 "cursor": self._cursor.tolist(), "batches": self._batches,
                 **{k: v.tolist() for k, v in self._counts.items()}}
        return merge_row_states(multihost.allgather_json(local))

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from ``get_state()``'s dict, written by this or any other process count."""
        if state.get("version") != STATE_VERSION:
            raise DatasetError(f"checkpointed data iterator state version = "
                               f"{state.get('version')!r}: this build reads version "
                               f"{STATE_VERSION} (per-row cursors over one permutation per "
                               f"epoch; version 2 read grain's shuffle order); use a new "
                               f"--workdir, or the meshrl version that wrote it")
        # A changed dataset, seed or batch size would silently change the continuation.
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise DatasetError(f"checkpointed data iterator state {key} = "
                                   f"{state.get(key)!r}: this run's pipeline has {mine!r}, so it "
                                   f"cannot resume exactly: use a new --workdir, or the data "
                                   f"config (and trainer batch size) that wrote it")
        lo, n = int(state.get("row_start", 0)), len(state["cursor"])
        if not lo <= self._my_rows.start <= self._my_rows.stop <= lo + n:
            raise DatasetError(f"checkpointed data iterator state covers rows [{lo}, {lo + n}) "
                               f"of {self.rows}; process {self.process_index} of "
                               f"{self.process_count} reads rows [{self._my_rows.start}, "
                               f"{self._my_rows.stop}): restore the state get_state() returned "
                               f"on every process, not one process's rows")
        mine = slice(self._my_rows.start - lo, self._my_rows.stop - lo)
        self._cursor = np.asarray(state["cursor"][mine], np.int64)
        self._counts = {k: np.asarray(state[k][mine], np.int64) for k in _ROW_COUNTS}
        self._batches = int(state["batches"])
        self._peeked = {}


class PromptIterator(_StreamIterator):
    """Yields lists of ``batch_size // process_count`` example dicts: ``prompt_ids``, ``prompt``,
    ``prompt_text`` (as fed to the model), ``answer`` and the reward fields."""

    def __next__(self) -> list[dict]:
        batch = [self._take_with_id(r) for r in range(self.local_batch_size)]
        self._batches += 1
        return batch

    def _take_with_id(self, r: int) -> dict:
        """Row ``r``'s next example with its stable id: ``prompt_index`` (the dataset index)
        and ``epoch``, which the RL loop records per trained prompt (``trained_prompts.jsonl``)."""
        self._peek(r)  # past any drops, so the cursor is at the example taken
        epoch, i = divmod(int(self._cursor[r]) * self.rows + self._my_rows[r], self._num_examples)
        return {**self._take(r), "prompt_index": int(self._order(epoch)[i]), "epoch": epoch}


class SFTIterator(_StreamIterator):
    """Yields dicts of numpy arrays, each ``[batch_size // process_count, seq_len]``."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, *, seq_len: int, pack: bool,
                 cache_tokens: int = SFT_CACHE_TOKENS, **kwargs: Any) -> None:
        super().__init__(data, tokenizer, seq_len=seq_len, **kwargs)
        self.seq_len, self.pack, self._pad = seq_len, pack, tokenizer.pad_id
        self._tokenized: dict[int, dict] = {}
        self._cache_room = cache_tokens

    def _example(self, index: int) -> dict:
        """Example ``index`` tokenized, kept while the cache has room: every epoch reads every
        example again, and a small SFT set is read for many epochs (the default job's warm
        start: 24), so tokenizing it each time was most of the iterator's time. Batches only
        read the examples' ids, so sharing one dict between epochs is safe."""
        ex = self._tokenized.get(index)
        if ex is None:
            ex = super()._example(index)
            cost = max(len(ex.get("_input", ())), 1)  # a dropped example counts one
            if cost <= self._cache_room:
                self._tokenized[index] = ex
                self._cache_room -= cost
        return ex

    def __next__(self) -> dict[str, np.ndarray]:
        B, L = self.local_batch_size, self.seq_len
        input_ids_BxL = np.full((B, L), self._pad, np.int32)
        targets_BxL = np.full((B, L), self._pad, np.int32)
        loss_mask_BxL = np.zeros((B, L), np.float32)
        positions_BxL = np.zeros((B, L), np.int32)
        segment_ids_BxL = np.zeros((B, L), np.int32)
        for row in range(B):
            fill, segment = 0, 0
            # Greedy in the row's sub-stream order: a row closes when its next example does not
            # fit, and that example opens the row next step, so no example is split or skipped.
            while True:
                n = len(self._peek(row)["_input"])
                if fill + n > L:
                    break
                ex = self._take(row)
                segment += 1
                span = slice(fill, fill + n)
                input_ids_BxL[row, span] = ex["_input"]
                targets_BxL[row, span] = ex["_target"]
                loss_mask_BxL[row, span] = ex["_mask"]
                positions_BxL[row, span] = np.arange(n)
                segment_ids_BxL[row, span] = segment
                fill += n
                if not self.pack:
                    break
        self._batches += 1
        return {"input_ids": input_ids_BxL, "targets": targets_BxL, "loss_mask": loss_mask_BxL,
                "positions": positions_BxL, "segment_ids": segment_ids_BxL}


def make_sft_iterator(data: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seq_len: int,
                      seed: int, process_index: int = 0, process_count: int = 1,
                      pack: bool = True, cache_tokens: int = SFT_CACHE_TOKENS) -> SFTIterator:
    """Checkpointable SFT batches for this process (see ``SFTIterator``); tokenized examples
    are kept up to ``cache_tokens`` input tokens (0: tokenize at every read)."""
    return SFTIterator(data, tokenizer, seq_len=seq_len, pack=pack, batch_size=batch_size,
                       seed=seed, process_index=process_index, process_count=process_count,
                       cache_tokens=cache_tokens)


def make_prompt_iterator(data: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seed: int,
                         process_index: int = 0, process_count: int = 1,
                         prompt_room: int | None = None) -> PromptIterator:
    """Checkpointable prompt batches for RL rollouts on this process (see ``PromptIterator``);
    prompts over ``prompt_room`` tokens (the episode's length less one) are over-long too."""
    return PromptIterator(data, tokenizer, seq_len=None, batch_size=batch_size, seed=seed,
                          process_index=process_index, process_count=process_count,
                          prompt_room=prompt_room)


def eval_examples(data: DataConfig, tokenizer: Tokenizer, teacher_forced: bool = False,
                  prompt_room: int | None = None) -> list[dict]:
    """Tokenized held-out examples (over-long prompts follow data.on_overlong; drops logged).
    ``teacher_forced``: with the SFT rows ``_input``, ``_target`` and ``_mask`` built exactly as
    training builds them (the whole conversation rendered; no length limit here).
    ``prompt_room``: as ``make_prompt_iterator``'s."""
    tokenize = _Tokenize(data, tokenizer, seq_len=sys.maxsize if teacher_forced else None,
                         prompt_room=prompt_room)
    out = [tokenize(ex) for ex in sources.load_eval(data)]
    kept = [ex for ex in out if "_drop" not in ex]
    if len(kept) < len(out):
        log.warning("eval_examples: dropped %d over-long prompts of %d", len(out) - len(kept),
                    len(out))
    return kept
