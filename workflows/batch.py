"""What a rollout produces (``Trajectory``, host side) and the one struct that reaches the trainer
(``RolloutBatch``), with the builder that pads groups of trajectories into it.

Token-aligned layout: row b holds ``prompt + completion`` right-padded to a bucketed length L;
``loss_mask`` is 1 exactly on model-generated tokens, ``versions`` holds the weight version that
generated each token (-1 on prompt, environment feedback and padding). ``to_train_batch`` shifts
it into the trainer's target-aligned convention (position t predicts token t + 1), optionally
packing several sequences into each row (``pack_rows``): the padded batch trains on every
position of ``B x L``, most of them padding when completion lengths are long-tailed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import numpy as np

from meshrl.algorithms import advantages as adv_lib
from meshrl.algorithms.batch import RLTrainBatch


@dataclasses.dataclass
class Trajectory:
    """One sampled episode. Completion-side lists are aligned with ``completion_ids``, which holds
    model tokens and (multi-turn) environment feedback tokens; feedback has ``loss_mask`` 0,
    ``logprobs`` 0.0 and ``versions`` -1."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float = 0.0
    group_id: int = 0
    finish_reason: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ValueError(f"trajectory lists disagree: {n} completion ids, "
                             f"{len(self.logprobs)} logprobs, {len(self.versions)} versions, "
                             f"{len(self.loss_mask)} mask entries")

    @property
    def num_generated(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def oldest_version(self) -> int:
        """Oldest weight version among the generated tokens (-1 if none were generated)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else -1

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@flax.struct.dataclass
class RolloutBatch:
    """One typed pytree per optimizer step: ``B = num_groups * group_size`` rows, contiguous
    groups (rows g*N .. g*N+N-1 are group g)."""

    tokens_BxL: np.ndarray  # noqa: N815 -- int32, prompt + completion, right-padded with pad_id
    loss_mask_BxL: np.ndarray  # noqa: N815 -- float32, 1 only on model-generated tokens
    behaviour_logprobs_BxL: np.ndarray  # noqa: N815 -- float32, 0 where loss_mask is 0
    versions_BxL: np.ndarray  # noqa: N815 -- int32, -1 on non-model tokens
    positions_BxL: np.ndarray  # noqa: N815 -- int32, 0..len-1 on real tokens, 0 on padding
    segment_ids_BxL: np.ndarray  # noqa: N815 -- int32, 1 on real tokens, 0 on padding
    rewards_B: np.ndarray  # noqa: N815 -- float32, after reward shaping
    advantages_B: np.ndarray  # noqa: N815 -- float32
    group_ids_B: np.ndarray  # noqa: N815 -- int32
    num_groups: int = flax.struct.field(pytree_node=False, default=0)
    group_size: int = flax.struct.field(pytree_node=False, default=0)
    pad_id: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens_BxL.shape

    def to_train_batch(self, rows: int | Sequence[int] | None = None) -> RLTrainBatch:
        """The trainer's step batch (see ``make_rl_loss_fn``): an ``RLTrainBatch`` of
        target-aligned ``[rows, L]`` numpy arrays (no ``ref_logprobs``). Per-token fields describe the *target* token of each position;
        ``sample_ids`` is the row of this batch the token comes from (-1 on padding).

        ``rows=None``: one sequence per row (rows = B). Otherwise the sequences are packed into
        ``rows`` rows (at least ``packed_rows()``), or into the smallest of the row counts
        ``rows`` that holds them, as ``pack_rows`` places them: each keeps its
        positions 0..n-1 and gets a segment id of its own within its row, so attention and the
        per-sequence terms of the loss never mix two sequences."""
        B, L = self.shape

        def shift(x_BxL: np.ndarray, fill: Any) -> np.ndarray:
            return np.concatenate([x_BxL[:, 1:], np.full((B, 1), fill, x_BxL.dtype)], axis=1)

        loss_mask_BxL = shift(self.loss_mask_BxL, 0)
        advantages_BxL = self.advantages_B[:, None].astype(np.float32) * loss_mask_BxL
        sample_ids_BxL = np.where(self.segment_ids_BxL > 0, np.arange(B, dtype=np.int32)[:, None],
                                  -1).astype(np.int32)
        out = RLTrainBatch(
            input_ids=self.tokens_BxL, targets=shift(self.tokens_BxL, self.pad_id),
            loss_mask=loss_mask_BxL, positions=self.positions_BxL,
            segment_ids=self.segment_ids_BxL,
            behaviour_logprobs=shift(self.behaviour_logprobs_BxL, 0.0),
            advantages=advantages_BxL, versions=shift(self.versions_BxL, -1),
            sample_ids=sample_ids_BxL)
        if rows is None:
            return out
        return _pack(out, self.lengths(), rows, self.pad_id)

    def lengths(self) -> list[int]:
        """Tokens (prompt + completion) of each row."""
        return (self.segment_ids_BxL > 0).sum(axis=1).tolist()

    def packed_rows(self) -> int:
        """Rows of length L that ``pack_rows`` fills with this batch's sequences."""
        return 1 + max(pack_rows(self.lengths(), self.shape[1]), default=-1)


def pack_rows(lengths: Sequence[int], row_len: int) -> list[int]:
    """Row of each sequence under first-fit decreasing (longest first, each into the first row
    with room): at most 11/9 of the optimal row count plus one. Deterministic: ties keep order."""
    if any(not 0 < n <= row_len for n in lengths):
        raise ValueError(f"sequence lengths {list(lengths)} must be in [1, {row_len}] to pack "
                         f"into rows of {row_len}")
    free: list[int] = []
    row_of = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(row_len)
        free[row] -= lengths[i]
        row_of[i] = row
    return row_of


def _pack(padded: RLTrainBatch, lengths: list[int], rows: int | Sequence[int],
          pad_id: int) -> RLTrainBatch:
    """Copy each sequence's first n positions of every padded field to its packed place."""
    B, L = padded.input_ids.shape
    row_of = pack_rows(lengths, L)
    need = 1 + max(row_of, default=-1)
    fits = [r for r in ([rows] if isinstance(rows, int) else rows) if r >= need]
    if not fits:
        raise ValueError(f"{B} sequences need {need} rows of {L} tokens; got rows = {rows}")
    rows = min(fits)
    fill = {"input_ids": pad_id, "targets": pad_id, "versions": -1, "sample_ids": -1}
    out = padded.map(lambda k, v: np.full((rows, L), fill.get(k, 0), v.dtype))
    pairs = [(getattr(padded, f.name), getattr(out, f.name)) for f in dataclasses.fields(out)
             if getattr(padded, f.name) is not None]
    used, count = [0] * rows, [0] * rows
    for b in range(B):  # sample order: segment ids follow it within each row
        r, n = row_of[b], lengths[b]
        o = used[r]
        for v, packed in pairs:
            packed[r, o:o + n] = v[b, :n]
        count[r] += 1
        out.segment_ids[r, o:o + n] = count[r]
        used[r] += n
    return out


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"a trajectory of {n} tokens exceeds the largest length bucket "
                     f"{max(buckets)}; raise the bucket or cap sampler.max_new_tokens")


def build_rollout_batch(groups: Sequence[Sequence[Trajectory]], *, length_buckets: Sequence[int],
                        pad_id: int = 0, advantage: str = "grpo", adv_eps: float = 1e-6,
                        overlong_buffer: int = 0, overlong_max_len: int = 0,
                        overlong_penalty: float = 1.0) -> RolloutBatch:
    """Right-pad full groups into a ``RolloutBatch`` of the smallest bucket length that fits;
    shape rewards with the DAPO overlong penalty (if ``overlong_buffer > 0``, on the number of
    generated tokens) and compute advantages with the registered estimator ``advantage``.

    Multi-process runs must pass a single bucket (``length_buckets=(trainer.seq_len,)``): each
    process builds its own rows, and a per-process bucket choice would make processes compile
    and run different train steps (a collective hang)."""
    if not groups:
        raise ValueError("build_rollout_batch needs at least one group")
    n = len(groups[0])
    if n == 0 or any(len(g) != n for g in groups):
        raise ValueError(f"every group needs the same non-zero size; got "
                         f"{[len(g) for g in groups]}")
    trajs = [t for g in groups for t in g]
    B, L = len(trajs), bucket_length(max(len(t) for t in trajs), length_buckets)
    tokens_BxL = np.full((B, L), pad_id, np.int32)
    loss_mask_BxL = np.zeros((B, L), np.float32)
    logprobs_BxL = np.zeros((B, L), np.float32)
    versions_BxL = np.full((B, L), -1, np.int32)
    positions_BxL = np.zeros((B, L), np.int32)
    segment_ids_BxL = np.zeros((B, L), np.int32)
    for b, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        tokens_BxL[b, :p + c] = list(t.prompt_ids) + list(t.completion_ids)
        mask = np.asarray(t.loss_mask, np.float32)
        loss_mask_BxL[b, p:p + c] = mask
        logprobs_BxL[b, p:p + c] = np.asarray(t.logprobs, np.float32) * mask
        versions_BxL[b, p:p + c] = np.where(mask > 0, np.asarray(t.versions, np.int32), -1)
        positions_BxL[b, :p + c] = np.arange(p + c)
        segment_ids_BxL[b, :p + c] = 1
    rewards_B = np.asarray([t.reward for t in trajs], np.float32)
    if overlong_buffer > 0:
        lengths_B = np.asarray([t.num_generated for t in trajs], np.float32)
        rewards_B = rewards_B + adv_lib.overlong_penalty(
            lengths_B, max_len=overlong_max_len, buffer=overlong_buffer,
            penalty=overlong_penalty)
    # numpy in, numpy out: no device dispatch, which would queue behind the sampler's decode and
    # the train step and stall the event loop that runs this.
    advantages_B = np.asarray(adv_lib.compute(advantage, rewards_B, n, eps=adv_eps))
    group_ids_B = np.asarray([t.group_id for t in trajs], np.int32)
    batch = RolloutBatch(tokens_BxL, loss_mask_BxL, logprobs_BxL, versions_BxL, positions_BxL,
                         segment_ids_BxL, rewards_B, advantages_B.astype(np.float32), group_ids_B,
                         num_groups=len(groups), group_size=n, pad_id=pad_id)
    for name in ("loss_mask_BxL", "behaviour_logprobs_BxL", "versions_BxL", "positions_BxL",
                 "segment_ids_BxL"):
        assert getattr(batch, name).shape == (B, L), (name, getattr(batch, name).shape)
    for name in ("rewards_B", "advantages_B", "group_ids_B"):
        assert getattr(batch, name).shape == (B,), (name, getattr(batch, name).shape)
    return batch
