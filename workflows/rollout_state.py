"""The rollout state a checkpoint carries, and the per-step record of trained prompts.

At a checkpoint the runner holds work the trainer has not consumed yet: prompts read from the
iterator but not started, groups being generated, and finished groups waiting for a batch. The
prompt iterator's saved position is past all of them, so a restart that dropped them would skip
those prompts. ``RolloutRunner.rollout_state`` saves them, in order:

- finished, untrained groups whole (tokens, logprobs, per-token versions, rewards): restored
  into the runner's queue, where the hand-over check drops (and re-queues) any that the restored
  version makes too stale;
- partial groups as their prompt: the sampler cannot resume a sequence mid-way, so the prompt is
  generated again (fresh tokens, so the staleness bound holds for them by construction);
- prompts read but not started, after those.

A prompt's id is ``[epoch, dataset index]`` (the prompt iterator adds ``epoch`` and
``prompt_index`` to each item). ``TrainedPromptsLog`` appends one JSON line per train step to
``<workdir>/trained_prompts.jsonl``; on resume the lines past the restored step are dropped, so
the file reads as if the run had never been killed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshrl.workflows.batch import Trajectory

TRAINED_PROMPTS = "trained_prompts.jsonl"
_TRAJ_FIELDS = ("prompt_ids", "completion_ids", "logprobs", "versions", "loss_mask", "reward",
                "group_id", "finish_reason", "metadata", "kept", "routing")


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as lists and Python numbers (JSON-able)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def encode_item(item: dict) -> dict:
    return _plain(item)


def encode_group(item: dict, group: Sequence[Trajectory]) -> dict:
    return {"item": _plain(item),
            "group": [{k: _plain(getattr(t, k)) for k in _TRAJ_FIELDS} for t in group]}


def decode_group(entry: dict) -> tuple[dict, list[Trajectory]]:
    return entry["item"], [Trajectory(**t) for t in entry["group"]]


def prompt_id(item: dict) -> list[int] | None:
    """``[epoch, dataset index]``; None for items without an id (hand-made prompt lists)."""
    if "prompt_index" not in item:
        return None
    return [int(item.get("epoch", 0)), int(item["prompt_index"])]


class TrainedPromptsLog:
    """``<workdir>/trained_prompts.jsonl``: per train step ``{"step", "prompt_ids", "epoch",
    "skipped"}``: ``prompt_ids`` the step's prompts, ``epoch`` the oldest epoch among them,
    ``skipped`` the prompts whose groups ended untrained since the previous line (all rewards
    equal, or errored) as ``[epoch, index, reason]``.

    Each line is one ``write`` of a whole line: a kill leaves it whole or absent. ``resume``
    keeps only the whole lines up to the restored step (written atomically), so a line the
    killed run wrote after its last checkpoint never counts twice."""

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        self.path = os.path.join(os.fspath(workdir), TRAINED_PROMPTS)

    def resume(self, step: int) -> None:
        """Drop torn lines and lines of steps after ``step`` (the restored checkpoint's)."""
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        keep = []
        for line in text.split("\n")[:-1]:  # the part after the last newline is torn
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(record["step"]) <= step:
                keep.append(line + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, step: int, items: Sequence[dict], skipped: Sequence[tuple[dict, str]]
               ) -> None:
        ids = [pid for pid in map(prompt_id, items) if pid is not None]
        record = {"step": step, "prompt_ids": ids,
                  "epoch": min((e for e, _ in ids), default=0),
                  "skipped": [[*pid, reason] for item, reason in skipped
                              if (pid := prompt_id(item)) is not None]}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write: a kill cannot leave half a line
        finally:
            os.close(fd)


def read_trained_prompts(workdir: str | os.PathLike[str]) -> list[dict]:
    """The whole lines of ``trained_prompts.jsonl`` (a checker's view)."""
    path = os.path.join(os.fspath(workdir), TRAINED_PROMPTS)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1] if line]
