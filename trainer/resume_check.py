"""What a resumed run may change: the checkpoint's config snapshot against the run's config.

A change the resumed run cannot work with is refused with one line naming the field and both
values; any other change to what is trained (model, optimizer, trainer, data, rollout, rl,
reward, ...) is logged in one warning line, so a run never resumes changed without a word. Where
the run writes and how it runs (``checkpoint``, ``logging``, ``runtime``, ``distributed``) and
how long (``trainer.steps``, at least the checkpoint's step) may change freely.
"""

from __future__ import annotations

import json
from typing import Any

from meshrl.utils.errors import UserError
from meshrl.utils.log import get_logger

_log = get_logger("checkpoint")

# The RL counters (groups accepted and consumed, the staleness capacity) count in these units:
# a resumed run with others admits nothing (fewer prompts a step: it waits for good) or drops
# whole steps' groups as stale (more).
# The optimizer's update count indexes the schedule as count // (ppo_minibatches * ppo_epochs):
# another product would put the learning rate at another step's.
REFUSED = (("rollout", "prompts_per_step"), ("rollout", "group_size"), ("rl", "ppo_minibatches"),
           ("rl", "ppo_epochs"))
FREE_SECTIONS = frozenset({"checkpoint", "logging", "runtime", "distributed", "compile",
                           "generate", "export", "evaluate"})
FREE_FIELDS = frozenset({("trainer", "steps")})


class ResumeConfigError(UserError, ValueError):
    """The run's config changes a field its checkpoint cannot be resumed with."""


def check_resume(saved: dict[str, Any], current: dict[str, Any], step: int) -> None:
    """Refuse or report the differences between ``saved`` (the snapshot of the checkpoint at
    ``step``) and ``current`` (``Config.to_dict()`` of this run)."""
    now = json.loads(json.dumps(current))  # as the snapshot was stored: tuples become lists
    was_job = saved.get("job")
    if was_job is not None and was_job != now.get("job"):
        # Another job's state, data position and counters: nothing of it fits this job.
        raise ResumeConfigError(f"job = {now.get('job')!r}: the workdir's checkpoints were "
                                f"written by the {was_job!r} job; pass another --workdir")
    steps = now["trainer"]["steps"]
    if steps < step:
        raise ResumeConfigError(f"trainer.steps = {steps}: the workdir's checkpoint is at step "
                                f"{step}; resume with trainer.steps >= {step}, or use another "
                                f"workdir")
    for section, key in REFUSED:
        was = saved.get(section, {}).get(key)
        if was is not None and was != now[section][key]:
            raise ResumeConfigError(
                f"{section}.{key} = {now[section][key]!r}: the workdir's checkpoint was written "
                f"with {was!r} and its counters count in those units; resume with {was!r}, or "
                f"use another workdir")
    changed = [f"{s}.{k}: {saved[s][k]!r} -> {v!r}"
               for s, fields in now.items() if isinstance(fields, dict) and s not in FREE_SECTIONS
               and isinstance(saved.get(s), dict)
               for k, v in fields.items()
               if k in saved[s] and saved[s][k] != v and (s, k) not in FREE_FIELDS]
    was_steps = saved.get("trainer", {}).get("steps")
    schedule = now.get("optimizer", {}).get("schedule")
    if was_steps is not None and was_steps != steps and schedule != "constant":
        # trainer.steps may change freely, but a decaying schedule's horizon moves with it.
        changed.append(f"trainer.steps: {was_steps!r} -> {steps!r} (the {schedule} learning-rate "
                       f"schedule now decays to step {steps})")
    if changed:
        _log.warning("resuming step %d with config changes: %s", step, "; ".join(changed))
