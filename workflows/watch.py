"""What the rollout did since the last batch, and when its rewards cannot teach anything.

``RolloutWatch.on_scored`` sees every scored group (kept or filtered). It keeps a window of
groups that the caller closes with ``take_window`` (the RL job does at each step line: its
all-groups mean reward and kept fraction; the waiting log reads the open one) and detects a reward that gives every sample the same score:

* with ``rollout.filter_equal_groups`` on (groups of 2 or more), ``rollout.max_filtered_in_a_row``
  groups in a row whose samples all scored alike: every one was dropped, so no batch can fill;
* otherwise, the first ``max_filtered_in_a_row`` scored groups all scored one and the same value
  (every advantage is zero: the run would train on nothing).

Either is a ``RewardStallError`` naming the reward's answer format and the setting to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshrl.rewards.registry import answer_format
from meshrl.utils.errors import UserError

_MAX_VALUES = 4  # distinct values a stall message lists


class RewardStallError(UserError, RuntimeError):
    """Every recent group scored alike: the reward or the data cannot give a learning signal."""


@dataclasses.dataclass
class Window:
    """Groups scored since the window was last taken."""
    kept: int = 0
    filtered: int = 0
    reward_sum: float = 0.0
    samples: int = 0

    @property
    def scored(self) -> int:
        return self.kept + self.filtered


class RolloutWatch:
    def __init__(self, *, reward_names: Sequence[str], filter_equal: bool, group_size: int,
                 max_in_a_row: int) -> None:
        self.reward_names = list(reward_names)
        # Filtering drops a group only when it has two or more samples to compare.
        self.filtering = filter_equal and group_size > 1
        self.max_in_a_row = max_in_a_row
        self.window = Window()
        self.scored = 0
        self._in_a_row = 0
        self._values: set[float] = set()  # rewards of the current run of alike groups
        self.error: RewardStallError | None = None

    def on_scored(self, rewards: Sequence[float], kept: bool) -> None:
        """Record one scored group; sets ``error`` when the rewards stalled the run."""
        w = self.window
        w.kept += kept
        w.filtered += not kept
        w.reward_sum += float(sum(rewards))
        w.samples += len(rewards)
        self.scored += 1
        alike = len(set(rewards)) == 1
        if self.filtering:
            self._in_a_row = self._in_a_row + 1 if alike else 0
            self._values = self._values | set(rewards) if alike else set()
        elif self._in_a_row == self.scored - 1:  # still the first groups, all one value so far
            values = self._values | set(rewards)
            if len(values) == 1:
                self._in_a_row, self._values = self._in_a_row + 1, values
        if self.max_in_a_row and self._in_a_row >= self.max_in_a_row and self.error is None:
            self.error = RewardStallError(self._message())

    def take_window(self) -> Window:
        """The window since the last call; starts a new one."""
        w, self.window = self.window, Window()
        return w

    def _message(self) -> str:
        n, values = self._in_a_row, sorted(self._values)[:_MAX_VALUES]
        shown = ", ".join(f"{v:g}" for v in values)
        formats = "; ".join(f"reward {name!r} expects {answer_format(name)}"
                            for name in self.reward_names)
        if self.filtering:
            what = (f"{n} groups in a row had every sample scored alike (rewards {shown}), so "
                    f"rollout.filter_equal_groups dropped them all")
            fix = ("make the data's answers and the prompts ask for that format, fix the "
                   "reward, or set rollout.filter_equal_groups=false")
        else:
            what = f"the first {n} scored groups all got reward {shown} for every sample"
            fix = "fix the reward or the data's answer field"
        return (f"rollout: {what} (rollout.max_filtered_in_a_row = {self.max_in_a_row}): "
                f"{formats}: {fix}, or set rollout.max_filtered_in_a_row=0 to never stop")


def window_metrics(w: Window) -> dict[str, float]:
    """The step's all-groups figures: the mean reward over every sample scored (kept and
    filtered groups) and the fraction of scored groups kept."""
    if not w.scored:
        return {}
    return {"rollout/reward_mean_all": w.reward_sum / max(w.samples, 1),
            "rollout/kept_fraction": w.kept / w.scored,
            "rollout/scored_groups": float(w.scored),
            "rollout/filtered_groups": float(w.filtered)}


def waiting_line(w: Window, *, version: int, ready: int, batch_size: int, in_flight: int,
                 waited_s: float) -> str:
    """The periodic line while the trainer waits for a batch."""
    return (f"rollout: waiting {waited_s:.0f} s for the batch of version {version + 1}: "
            f"{ready}/{batch_size} groups ready; since the last step line {w.scored:,} scored, "
            f"{w.kept:,} kept, {w.filtered:,} filtered (every sample scored alike), "
            f"{in_flight} in flight")
