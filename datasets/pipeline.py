"""grain pipelines: shuffled, sharded, multi-epoch, checkpointable prompt and SFT iterators.

The example stream is ``grain.MapDataset.source(examples).shuffle(seed).repeat()`` (grain
reshuffles every epoch), sliced ``[process_index::process_count]`` so processes read disjoint
elements of one global order (no overlap, no loss). Iterators only ever move forward through
that random-access stream and build each batch from their current index, so the whole state is
an index plus counters: ``get_state()`` is a small JSON-able dict and ``set_state`` resumes the
exact continuation, on any host, without replaying data.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from meshrl.configs.schema import DataConfig
from meshrl.datasets import sources
from meshrl.datasets.sources import DatasetError
from meshrl.models.tokenizer import Tokenizer
from meshrl.utils.log import get_logger

log = get_logger("datasets")

STATE_VERSION = 1
# Keys that are pipeline plumbing, not reward fields handed to workflows.
_INTERNAL = ("messages", "origin", "_drop", "_input", "_target", "_mask")


def prompt_text(example: dict, tokenizer: Tokenizer) -> str:
    """Chat data is always templated; a plain prompt only if the tokenizer has a template."""
    if example.get("messages") is not None:
        return tokenizer.apply_chat_template(example["messages"], add_generation_prompt=True)
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]}],
                                             add_generation_prompt=True)
    return example["prompt"]


def encode_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(text)
    # Templates such as Llama 3's already start with BOS; never add a second one.
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    return ids


def response_ids(example: dict, prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The SFT target: the last assistant turn (as the template renders it) or the answer."""
    text = example["answer"]
    if example.get("messages") is not None:
        full = tokenizer.apply_chat_template(
            [*example["messages"], {"role": "assistant", "content": example["answer"]}],
            add_generation_prompt=False)
        # Use the template's own rendering of the turn (end-of-turn tokens included) when the
        # prompt is a prefix of it; trailing newlines after the end-of-turn are not trained on.
        if full.startswith(prompt):
            text = full[len(prompt):].rstrip()
    ids = tokenizer.encode(text)
    if not ids or ids[-1] != tokenizer.eos_id:
        ids.append(tokenizer.eos_id)
    return ids


class _Tokenize:
    """grain map: example -> example with token ids, or marked ``_drop`` with the reason."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, seq_len: int | None) -> None:
        self.data, self.tokenizer, self.seq_len = data, tokenizer, seq_len

    def _overlong(self, ex: dict, reason: str, detail: str) -> dict:
        if self.data.on_overlong == "raise":
            raise DatasetError(f"{ex.get('origin', '?')}: {detail}: shorten it, raise the limit, "
                               f"or set data.on_overlong = 'drop'")
        return {"_drop": reason, "origin": ex.get("origin")}

    def __call__(self, ex: dict) -> dict:
        text = prompt_text(ex, self.tokenizer)
        ids = encode_prompt(text, self.tokenizer)
        if len(ids) > self.data.max_prompt_len:
            return self._overlong(ex, "dropped_overlong_prompt",
                                  f"prompt has {len(ids)} tokens > data.max_prompt_len = "
                                  f"{self.data.max_prompt_len}")
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


def _mix_seed(seed: int, shuffle_seed: int) -> int:
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, shuffle_seed & 0xFFFFFFFF])
               .generate_state(1)[0])


class _StreamIterator:
    """Forward-only cursor over the sharded, shuffled, repeated example stream."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, *, seq_len: int | None,
                 batch_size: int, seed: int, process_index: int, process_count: int) -> None:
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index = {process_index}, process_count = {process_count}: "
                             f"need 0 <= process_index < process_count")
        if batch_size % process_count:
            raise ValueError(f"batch_size = {batch_size}: must be divisible by process_count = "
                             f"{process_count} (each process reads batch_size // process_count)")
        self.stats: dict[str, int] = {"examples": 0, "batches": 0, "epoch": 0,
                                      "dropped_overlong_prompt": 0,
                                      "dropped_overlong_sequence": 0}
        examples = sources.load_train(data, self.stats)
        self._num_examples = len(examples)
        self._seed = _mix_seed(seed, data.shuffle_seed)
        self.local_batch_size = batch_size // process_count
        self.process_index, self.process_count = process_index, process_count
        self._ds = (grain.MapDataset.source(examples).shuffle(seed=self._seed).repeat(None)
                    [process_index::process_count].map(_Tokenize(data, tokenizer, seq_len)))
        self._index = 0  # next position in this process's slice of the stream
        self._peeked: tuple[int, dict] = (-1, {})

    def _peek(self) -> dict:
        """The next usable example (not consumed); drops on the way are counted exactly once."""
        streak = 0
        while True:
            if self._peeked[0] != self._index:  # tokenize each stream position once
                self._peeked = (self._index, self._ds[self._index])
            ex = self._peeked[1]
            if "_drop" not in ex:
                return ex
            self.stats[ex["_drop"]] += 1
            self._advance()
            streak += 1
            # A whole epoch of drops means nothing will ever fit: fail instead of spinning.
            if streak > self._num_examples // self.process_count + 1:
                raise DatasetError(f"data: every example is dropped (last: {ex['origin']}, "
                                   f"stats {self.stats}): raise data.max_prompt_len or "
                                   f"trainer.seq_len")

    def _advance(self) -> None:
        self._index += 1
        global_pos = self._index * self.process_count + self.process_index
        self.stats["epoch"] = global_pos // self._num_examples

    def _take(self) -> dict:
        ex = self._peek()
        self._advance()
        self.stats["examples"] += 1
        return ex

    def __iter__(self) -> _StreamIterator:
        return self

    def _identity(self) -> dict[str, int]:
        return {"version": STATE_VERSION, "seed": self._seed, "num_examples": self._num_examples,
                "process_index": self.process_index, "process_count": self.process_count}

    def get_state(self) -> dict[str, Any]:
        """JSON-able; save it with the train state and hand it to ``set_state`` to resume."""
        return {**self._identity(), "index": self._index, "stats": dict(self.stats)}

    def set_state(self, state: dict[str, Any]) -> None:
        # A changed dataset, seed or process layout would silently change the continuation.
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise DatasetError(f"checkpointed data iterator state {key} = "
                                   f"{state.get(key)!r}: this run's pipeline has {mine!r}, so it "
                                   f"cannot resume exactly: use a new --workdir, or the data "
                                   f"config (and process count) that wrote it")
        self._index = int(state["index"])
        self.stats = {**self.stats, **{k: int(v) for k, v in state["stats"].items()}}


class PromptIterator(_StreamIterator):
    """Yields lists of ``batch_size // process_count`` example dicts: ``prompt_ids``, ``prompt``,
    ``prompt_text`` (as fed to the model), ``answer`` and the reward fields."""

    def __next__(self) -> list[dict]:
        batch = [self._take() for _ in range(self.local_batch_size)]
        self.stats["batches"] += 1
        return batch


class SFTIterator(_StreamIterator):
    """Yields dicts of numpy arrays, each ``[batch_size // process_count, seq_len]``."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, *, seq_len: int, pack: bool,
                 **kwargs: Any) -> None:
        super().__init__(data, tokenizer, seq_len=seq_len, **kwargs)
        self.seq_len, self.pack, self._pad = seq_len, pack, tokenizer.pad_id

    def __next__(self) -> dict[str, np.ndarray]:
        B, L = self.local_batch_size, self.seq_len
        input_ids_BxL = np.full((B, L), self._pad, np.int32)
        targets_BxL = np.full((B, L), self._pad, np.int32)
        loss_mask_BxL = np.zeros((B, L), np.float32)
        positions_BxL = np.zeros((B, L), np.int32)
        segment_ids_BxL = np.zeros((B, L), np.int32)
        for row in range(B):
            fill, segment = 0, 0
            # Greedy in stream order: a row closes when the next example does not fit, and that
            # example opens the next row, so no example is ever split or skipped.
            while True:
                n = len(self._peek()["_input"])
                if fill + n > L:
                    break
                ex = self._take()
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
        self.stats["batches"] += 1
        return {"input_ids": input_ids_BxL, "targets": targets_BxL, "loss_mask": loss_mask_BxL,
                "positions": positions_BxL, "segment_ids": segment_ids_BxL}


def make_sft_iterator(data: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seq_len: int,
                      seed: int, process_index: int = 0, process_count: int = 1,
                      pack: bool = True) -> SFTIterator:
    """Checkpointable SFT batches for this process (see ``SFTIterator``)."""
    return SFTIterator(data, tokenizer, seq_len=seq_len, pack=pack, batch_size=batch_size,
                       seed=seed, process_index=process_index, process_count=process_count)


def make_prompt_iterator(data: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seed: int,
                         process_index: int = 0, process_count: int = 1) -> PromptIterator:
    """Checkpointable prompt batches for RL rollouts on this process (see ``PromptIterator``)."""
    return PromptIterator(data, tokenizer, seq_len=None, batch_size=batch_size, seed=seed,
                          process_index=process_index, process_count=process_count)


def eval_examples(data: DataConfig, tokenizer: Tokenizer) -> list[dict]:
    """Tokenized held-out examples (over-long prompts follow data.on_overlong; drops logged)."""
    tokenize = _Tokenize(data, tokenizer, seq_len=None)
    out = [tokenize(ex) for ex in sources.load_eval(data)]
    kept = [ex for ex in out if "_drop" not in ex]
    if len(kept) < len(out):
        log.warning("eval_examples: dropped %d over-long prompts of %d", len(out) - len(kept),
                    len(out))
    return kept
