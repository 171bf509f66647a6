"""What a rollout produces (``Trajectory``, host side) and the builder that turns groups of them
into the one batch the RL step trains on: an ``RLTrainBatch`` (``algorithms.batch``) of numpy
arrays, target-aligned (position t predicts token t + 1), with each token's behaviour logprob,
weight version (-1 where no model generated it), advantage, its sample's reward and its
sample's index in the batch.

One sequence per row, right-padded to the smallest bucket length that holds the longest, or
packed several to a row (``pack_rows``): the padded batch trains on every position of
``B x L``, most of them padding when completion lengths are long-tailed. Packed sequences keep
their positions 0..n-1 and get a segment id of their own within their row, so attention and
the per-sequence terms of the loss never mix two sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshrl.algorithms import advantages as adv_lib
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.utils.buckets import bucket_for


@dataclasses.dataclass
class Trajectory:
    """One sampled episode. Completion-side lists are aligned with ``completion_ids``, which holds
    model tokens and (multi-turn) environment feedback tokens; feedback has ``loss_mask`` 0,
    ``logprobs`` 0.0 and ``versions`` -1. ``kept`` (None: not recorded, sampling without
    top-k/top-p/min-p) is the sampler's ``Completion.kept`` per token, 0 on feedback.
    ``routing`` (None: not recorded) is the sampler's ``Completion.routing``: per token the
    ``[layers, k]`` experts of the forward it was sampled from, None on feedback."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float = 0.0
    group_id: int = 0
    finish_reason: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    kept: list[int] | None = None
    routing: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        n_kept = n if self.kept is None else len(self.kept)
        n_routed = n if self.routing is None else len(self.routing)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n_kept
                == n_routed == n):
            raise ValueError(f"trajectory lists disagree: {n} completion ids, "
                             f"{len(self.logprobs)} logprobs, {len(self.versions)} versions, "
                             f"{len(self.loss_mask)} mask entries, {n_kept} kept counts, "
                             f"{n_routed} routing entries")

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
    fill = {"input_ids": pad_id, "targets": pad_id, "versions": -1, "sample_ids": -1,
            "routing": -1}
    out = padded.map(lambda k, v: np.full((rows, L, *v.shape[2:]), fill.get(k, 0), v.dtype))
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


def rows_needed(groups: Sequence[Sequence[Trajectory]], row_len: int) -> int:
    """Rows of ``row_len`` tokens that ``pack_rows`` fills with the groups' sequences."""
    lengths = [len(t) for g in groups for t in g]
    return 1 + max(pack_rows(lengths, row_len), default=-1)


def _shaped_rewards(trajs: Sequence[Trajectory], overlong_buffer: int, overlong_max_len: int,
                    overlong_penalty: float) -> np.ndarray:
    """Each sample's reward after the DAPO overlong penalty (``overlong_buffer > 0``, on the
    number of generated tokens)."""
    rewards_B = np.asarray([t.reward for t in trajs], np.float32)
    if overlong_buffer > 0:
        lengths_B = np.asarray([t.num_generated for t in trajs], np.float32)
        rewards_B = rewards_B + adv_lib.overlong_penalty(
            lengths_B, max_len=overlong_max_len, buffer=overlong_buffer,
            penalty=overlong_penalty)
    return rewards_B.astype(np.float32)


def _routing(trajs: Sequence[Trajectory], L: int, shape: tuple[int, int]) -> np.ndarray:
    """``[B, L + 1, layers, k]`` int32: each generated token's recorded experts at its own
    position (shifted to its predicting position with the other fields), -1 elsewhere (the
    trainer's forward routes those positions itself)."""
    out = np.full((len(trajs), L + 1, *shape), -1, np.int32)
    for b, t in enumerate(trajs):
        p = len(t.prompt_ids)
        for j, (experts, m) in enumerate(zip(t.routing, t.loss_mask)):
            if m:
                out[b, p + j] = np.asarray(experts, np.int32).reshape(shape)
    return out


def _padded(trajs: Sequence[Trajectory], L: int, pad_id: int, rewards_B: np.ndarray,
            advantages_B: np.ndarray, kept: bool = False,
            routing: tuple[int, int] | None = None) -> RLTrainBatch:
    """One sequence per row, target-aligned, right-padded to ``L``; with ``kept`` the
    trajectories' kept counts (0: the whole vocabulary) in the batch's ``kept``; with
    ``routing`` (``(layers, k)``) their recorded experts in the batch's ``routing``."""
    B = len(trajs)
    tokens_BxL = np.full((B, L + 1), pad_id, np.int32)  # one more column: the last target
    loss_mask_BxL = np.zeros((B, L + 1), np.float32)
    logprobs_BxL = np.zeros((B, L + 1), np.float32)
    versions_BxL = np.full((B, L + 1), -1, np.int32)
    kept_BxL = np.zeros((B, L + 1), np.int32)
    lengths_B = np.asarray([len(t) for t in trajs], np.int32)
    for b, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        tokens_BxL[b, :p + c] = list(t.prompt_ids) + list(t.completion_ids)
        mask = np.asarray(t.loss_mask, np.float32)
        loss_mask_BxL[b, p:p + c] = mask
        logprobs_BxL[b, p:p + c] = np.asarray(t.logprobs, np.float32) * mask
        versions_BxL[b, p:p + c] = np.where(mask > 0, np.asarray(t.versions, np.int32), -1)
        if t.kept is not None:
            kept_BxL[b, p:p + c] = np.where(mask > 0, np.asarray(t.kept, np.int32), 0)
    real_BxL = np.arange(L)[None, :] < lengths_B[:, None]
    sample_ids_BxL = np.where(real_BxL, np.arange(B, dtype=np.int32)[:, None], -1)
    target_mask_BxL = loss_mask_BxL[:, 1:]
    batch = RLTrainBatch(
        input_ids=tokens_BxL[:, :-1], targets=tokens_BxL[:, 1:], loss_mask=target_mask_BxL,
        positions=np.where(real_BxL, np.arange(L, dtype=np.int32)[None, :], 0).astype(np.int32),
        segment_ids=real_BxL.astype(np.int32), behaviour_logprobs=logprobs_BxL[:, 1:],
        advantages=(advantages_B[:, None] * target_mask_BxL).astype(np.float32),
        versions=versions_BxL[:, 1:], sample_ids=sample_ids_BxL.astype(np.int32),
        rewards=np.where(real_BxL, rewards_B[:, None], 0.0).astype(np.float32),
        kept=kept_BxL[:, 1:] if kept else None,
        routing=None if routing is None else _routing(trajs, L, routing)[:, 1:])
    for name, value in batch.set_fields().items():
        assert value.shape[:2] == (B, L), (name, value.shape)
    return batch


def build_rl_batch(groups: Sequence[Sequence[Trajectory]], *, length_buckets: Sequence[int],
                   pad_id: int = 0, advantage: str | None = "grpo", adv_eps: float = 1e-6,
                   overlong_buffer: int = 0, overlong_max_len: int = 0,
                   overlong_penalty: float = 1.0, rows: int | Sequence[int] | None = None,
                   kept: bool = False, routing: tuple[int, int] | None = None
                   ) -> RLTrainBatch:
    """The RL step's batch of full groups (sample ``g * N + i`` is group g's i-th): rewards
    shaped with the DAPO overlong penalty, advantages from the registered estimator
    ``advantage`` over each group (None: advantages 0, left to the device, as when the KL
    reference is in the reward), rows of the smallest bucket length that holds the longest
    sequence. ``rows=None``: one sequence per row; otherwise packed into ``rows`` rows (at
    least ``rows_needed``), or into the smallest of the row counts ``rows`` that holds them.
    ``kept``: set the batch's ``kept`` (the sampler truncates; ``algorithms.truncation``).
    ``routing``: ``(layers, k)`` of an MoE model; set the batch's ``routing`` (MoE routing
    replay, ``rl.routing_replay``) from each trajectory's recorded experts.

    Multi-process runs must pass a single bucket (``length_buckets=(trainer.seq_len,)``): each
    process builds its own rows, and a per-process bucket choice would make processes compile
    and run different train steps (a collective hang)."""
    if not groups:
        raise ValueError("build_rl_batch needs at least one group")
    n = len(groups[0])
    if n == 0 or any(len(g) != n for g in groups):
        raise ValueError(f"every group needs the same non-zero size; got "
                         f"{[len(g) for g in groups]}")
    trajs = [t for g in groups for t in g]
    if kept and (missing := [i for i, t in enumerate(trajs) if t.kept is None]):
        raise ValueError(f"{len(missing)} trajectories (first: sample {missing[0]}) have no "
                         f"kept counts: a batch of truncated sampling (top-k/top-p/min-p) "
                         f"needs each generated token's kept count to score it")
    if routing is not None and (missing := [i for i, t in enumerate(trajs)
                                            if t.routing is None]):
        raise ValueError(f"{len(missing)} trajectories (first: sample {missing[0]}) have no "
                         f"recorded routing: routing replay (rl.routing_replay = 'rollout') "
                         f"needs each generated token's experts")
    L = bucket_for(max(len(t) for t in trajs), length_buckets, what="trajectory length",
                   fix="raise the bucket or cap sampler.max_new_tokens")
    rewards_B = _shaped_rewards(trajs, overlong_buffer, overlong_max_len, overlong_penalty)
    # numpy in, numpy out: no device dispatch, which would queue behind the sampler's decode and
    # the train step and stall the event loop that runs this.
    tokens_B = np.asarray([sum(t.loss_mask) for t in trajs], np.float32)
    advantages_B = (np.zeros_like(rewards_B) if advantage is None else
                    np.asarray(adv_lib.compute(advantage, rewards_B, n, eps=adv_eps,
                                               tokens_B=tokens_B), np.float32))
    padded = _padded(trajs, L, pad_id, rewards_B, advantages_B, kept, routing)
    if rows is None:
        return padded
    return _pack(padded, [len(t) for t in trajs], rows, pad_id)
