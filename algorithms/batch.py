"""The train step's batch: one typed pytree per step, all fields ``[rows, L]`` (``routing``:
``[rows, L, layers, k]``) and target-aligned (position t predicts ``targets[t]``).

``TrainBatch`` is what SFT trains on; ``RLTrainBatch`` adds the rollout's per-token fields. The
same classes hold host arrays (numpy, one process's rows), device arrays, abstract
``ShapeDtypeStruct``s and ``NamedSharding``s (the shardings of a batch are a batch of shardings),
so one structure crosses every boundary. Each field's dtype is declared with the field. An
optional field left ``None`` is an empty subtree: no array, no sharding, nothing compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import flax.struct
import jax
import numpy as np

B = TypeVar("B", bound="TrainBatch")


def _field(dtype: Any, **kwargs: Any) -> Any:
    return flax.struct.field(pytree_node=True, metadata={"dtype": dtype}, **kwargs)


@flax.struct.dataclass
class TrainBatch:
    """An SFT step's batch (packed rows: ``segment_ids`` 0 is padding, 1.. the sequences)."""

    input_ids: Any = _field(np.int32)
    targets: Any = _field(np.int32)
    loss_mask: Any = _field(np.float32)
    positions: Any = _field(np.int32)
    segment_ids: Any = _field(np.int32)

    @classmethod
    def from_mapping(cls: type[B], arrays: Mapping[str, Any]) -> B:
        """The batch of a data iterator's ``{field name: array}``; an unknown or a missing
        required name is a ``ValueError`` naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(arrays) - names):
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(names)}")
        try:
            return cls(**arrays)
        except TypeError as e:
            raise ValueError(f"{cls.__name__} from {sorted(arrays)}: {e}") from None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def set_fields(self) -> dict[str, Any]:
        """``{name: value}`` of the fields that are set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def like(self: B, other: TrainBatch) -> B:
        """This batch with only the fields ``other`` sets (e.g. a batch of shardings)."""
        return self.replace(**{f.name: None for f in dataclasses.fields(self)
                               if getattr(other, f.name) is None})

    def map(self: B, fn: Callable[[str, Any], Any]) -> B:
        """A batch of ``fn(name, value)`` over the fields that are set (others stay ``None``)."""
        return self.replace(**{k: fn(k, v) for k, v in self.set_fields().items()})


@flax.struct.dataclass
class RLTrainBatch(TrainBatch):
    """An RL step's batch, built by ``workflows.batch.build_rl_batch``. Per target token: the
    sampler's logprob (0 off the loss mask), the advantage (0 off the mask), the weight version
    that generated it (-1 where no model generated it) and the index of its sample in the batch
    (-1 on padding). Optional: ``rewards`` (its sample's shaped reward on every token of the
    sample, 0 on padding: the KL-in-reward advantages need it on the device), ``ref_logprobs``
    (the KL reference, ``trainer.reference``), ``proximal_logprobs`` (decoupled PPO;
    default: the current policy) and ``kept`` (set when the sampler truncates with top-k,
    top-p or min-p: how many tokens its distribution kept for each target, 0 off the mask and
    for "the whole vocabulary"; the trainer scores each target under its own logits truncated
    to as many, ``algorithms.truncation``) and ``routing`` (MoE routing replay,
    ``rl.routing_replay``: ``[rows, L, layers, k]`` the experts the sampler's forward routed
    each position to when it sampled that position's target, -1 where it recorded none; the
    trainer's forwards route those positions to the same experts)."""

    behaviour_logprobs: Any = _field(np.float32)
    advantages: Any = _field(np.float32)
    versions: Any = _field(np.int32)
    sample_ids: Any = _field(np.int32)
    rewards: Any = _field(np.float32, default=None)
    ref_logprobs: Any = _field(np.float32, default=None)
    proximal_logprobs: Any = _field(np.float32, default=None)
    kept: Any = _field(np.int32, default=None)
    routing: Any = _field(np.int32, default=None)

    def sample_lags(self, version: int) -> np.ndarray:
        """``version`` minus the oldest weight version of each sample's loss-masked tokens, one
        entry per sample that has any (host arrays): the staleness the step trains on."""
        on = np.asarray(self.loss_mask) > 0
        ids, versions = np.asarray(self.sample_ids)[on], np.asarray(self.versions)[on]
        if not ids.size:
            return np.zeros((0,), np.int64)
        oldest = np.full(int(ids.max()) + 1, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(oldest, ids, versions)
        return version - oldest[np.unique(ids)]

    def sample_rewards(self) -> np.ndarray:
        """Each sample's reward, by sample id (host arrays with ``rewards`` set)."""
        ids, rewards = np.asarray(self.sample_ids), np.asarray(self.rewards)
        out = np.zeros(int(ids.max()) + 1 if ids.size else 0, np.float32)
        out[ids[ids >= 0]] = rewards[ids >= 0]
        return out


@flax.struct.dataclass
class PreferenceBatch(TrainBatch):
    """A preference (DPO-family) step's batch: one row per completion, the pairs adjacent --
    row ``2 i`` the chosen completion of pair ``i``, row ``2 i + 1`` the rejected one, both
    with the same prompt -- so any even split of the rows (data shards, processes) keeps every
    pair together. ``loss_mask`` marks the completion's tokens; ``ref_logprobs`` (set on the
    device before the step by ``trainer.preference_ref``; ``None`` for losses without a
    reference) the frozen reference's log p(target), 0 off the mask."""

    ref_logprobs: Any = _field(np.float32, default=None)


def field_dtype(cls: type[TrainBatch], name: str) -> Any:
    return next(f.metadata["dtype"] for f in dataclasses.fields(cls) if f.name == name)


def batch_of(cls: type[B], value: Any, *names: str) -> B:
    """A ``cls`` holding ``value`` in every required field and in the optional ``names``:
    e.g. the one ``NamedSharding`` all ``[rows, L]`` fields share."""
    fields = {f.name for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING or f.name in names}
    if unknown := sorted(set(names) - {f.name for f in dataclasses.fields(cls)}):
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**{n: value for n in fields})


def abstract_batch(shardings: B, rows: int, seq_len: int,
                   trailing: Mapping[str, tuple[int, ...]] | None = None) -> B:
    """``ShapeDtypeStruct``s ``[rows, seq_len, *trailing[name]]`` with each field's dtype and
    sharding (``trailing``: the dims after ``[rows, L]`` of fields that have more, e.g.
    ``{"routing": (layers, k)}``)."""
    cls, more = type(shardings), trailing or {}
    return shardings.map(lambda name, sh: jax.ShapeDtypeStruct(
        (rows, seq_len, *more.get(name, ())), field_dtype(cls, name), sharding=sh))
