"""Staleness control: how far rollout generation may run ahead of training.

All counts are in **groups** (one prompt's ``group_size`` samples); ``batch_size`` is groups per
optimizer step (``rollout.prompts_per_step``). A new group may start only while

    capacity = (max_staleness + version + 1) * batch_size - (accepted + running) > 0

where ``version`` is the trainer's current weight version, ``accepted`` counts groups accepted
so far (consumed or waiting; groups dropped as stale are taken back out) and ``running`` counts
groups in flight. So at most ``max_staleness + 1`` batches are ever generated ahead of the
trainer; ``max_staleness = 0`` is synchronous RL. The caller must advance ``version`` by one per
consumed batch (also for a skipped non-finite step), otherwise the capacity shrinks.

Admission control bounds staleness only on average: a slow group admitted early can finish late.
``consume`` is the hard guarantee: a group with any generated token older than
``version - max_staleness`` is dropped and counted, never trained on.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from meshrl.utils.log import get_logger
from meshrl.workflows.batch import Trajectory

log = get_logger("workflows")


class StalenessController:
    def __init__(self, *, batch_size: int, max_staleness: int, version: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size (groups per step) must be >= 1, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.batch_size, self.max_staleness, self.version = batch_size, max_staleness, version
        self.accepted = self.running = self.rejected = self.consumed = 0
        self.dropped_stale = self.dropped_stale_samples = 0
        # Per consumed sample: version at consumption - its oldest generated token's version.
        self.staleness_hist: collections.Counter[int] = collections.Counter()

    def capacity(self) -> int:
        return ((self.max_staleness + self.version + 1) * self.batch_size
                - (self.accepted + self.running))

    def can_admit(self) -> bool:
        return self.capacity() > 0

    def on_submit(self) -> None:
        if not self.can_admit():
            raise RuntimeError(f"admission over capacity: version {self.version}, accepted "
                               f"{self.accepted}, running {self.running}")
        self.running += 1

    def on_accept(self) -> None:
        assert self.running > 0, "on_accept without a running group"
        self.running -= 1
        self.accepted += 1

    def on_reject(self) -> None:
        """A running group ended without a trainable result (rejected, filtered, failed)."""
        assert self.running > 0, "on_reject without a running group"
        self.running -= 1
        self.rejected += 1

    def set_version(self, version: int) -> None:
        # The RL loop passes the number of batches consumed (``step - 1``), not the train
        # state's weight_version, which stays put on a skipped non-finite step: a skip must not
        # shrink the capacity (with max_staleness = 0 it would stall the run).
        if version < self.version:
            raise ValueError(f"weight version went backwards: {self.version} -> {version}")
        self.version = version

    def is_stale(self, oldest_version: int) -> bool:
        return oldest_version < self.version - self.max_staleness

    def consume(self, group: Sequence[Trajectory]) -> bool:
        """Check a finished group at hand-over to the trainer. Returns False (and counts the
        drop) when any sample has a generated token older than the allowed lag."""
        oldest = min(t.oldest_version for t in group)
        if self.is_stale(oldest):
            # Give the slot back: the group will never be trained on, so it must not keep
            # occupying capacity (that would shrink the pipeline for good).
            self.accepted -= 1
            self.dropped_stale += 1
            self.dropped_stale_samples += len(group)
            log.debug("dropped stale group: oldest token version %d < %d - max_staleness %d",
                     oldest, self.version, self.max_staleness)
            return False
        self.consumed += 1
        for t in group:
            self.staleness_hist[self.version - t.oldest_version] += 1
        return True

    def unconsume(self, group: Sequence[Trajectory]) -> None:
        """Undo ``consume`` of a group handed back untrained (its batch was abandoned)."""
        self.consumed -= 1
        for t in group:
            lag = self.version - t.oldest_version
            self.staleness_hist[lag] -= 1
            if not self.staleness_hist[lag]:
                del self.staleness_hist[lag]

    def state_dict(self) -> dict[str, Any]:
        """Counters for a checkpoint. The saved ``accepted`` is the consumed count: groups
        running or waiting are not counted (the runner's rollout state re-queues their prompts
        and re-adds the finished groups it restores), so after a restore at the same version
        the capacity is the normal ``(max_staleness + 1) * batch_size`` ahead, never a burst."""
        return {"version": self.version, "accepted": self.consumed, "consumed": self.consumed,
                "rejected": self.rejected, "dropped_stale": self.dropped_stale,
                "dropped_stale_samples": self.dropped_stale_samples,
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.accepted, self.consumed = int(state["accepted"]), int(state["consumed"])
        self.rejected, self.running = int(state["rejected"]), 0
        self.dropped_stale = int(state["dropped_stale"])
        self.dropped_stale_samples = int(state["dropped_stale_samples"])
        self.staleness_hist = collections.Counter(
            {int(k): int(v) for k, v in state["staleness_hist"].items()})

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/{k}": float(getattr(self, k)) for k in (
            "version", "accepted", "running", "rejected", "consumed", "dropped_stale",
            "dropped_stale_samples")}
        out["rollout/capacity"] = float(self.capacity())
        out.update({f"rollout/staleness_hist/{k}": float(v)
                    for k, v in sorted(self.staleness_hist.items())})
        return out
