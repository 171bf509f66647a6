"""The RL job's console beyond its step line: why a step's groups were filtered, and a
Ctrl-C (``utils.interrupt``) that stops between steps with a checkpoint."""

from __future__ import annotations

import asyncio
from typing import Any

from meshrl.utils import interrupt
from meshrl.workflows.runner import Group, RolloutRunner
from meshrl.workflows.watch import Window

_POLL_S = 0.25  # how soon a Ctrl-C is seen while the trainer waits for a batch


async def await_batch(runner: RolloutRunner, version: int) -> list[Group] | None:
    """``runner.get_batch(version)``, or None when a stop is requested while it waits."""
    task = asyncio.ensure_future(runner.get_batch(version))
    while True:
        done, _ = await asyncio.wait([task], timeout=_POLL_S)
        if done:
            return task.result()
        if interrupt.requested():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


def filtered_note(step: int, w: Window) -> str | None:
    """One line when filtering dropped more of the step's groups than it kept."""
    if w.filtered <= w.kept:
        return None
    return (f"version {step}: {w.filtered:,} of {w.scored:,} groups scored since the last line "
            f"were filtered: every sample of each got the same reward, so its advantages are "
            f"all zero (rollout.filter_equal_groups); {w.kept:,} kept")


def stop_at(trainer: Any, step: int, runner: RolloutRunner) -> None:
    """Checkpoint ``step`` (unless it is on disk), wait for the write, raise ``Stopped``."""
    engine = trainer.engine
    if step not in engine.checkpointer.all_steps():
        trainer.save(step, runner)
    engine.finish()
    raise interrupt.Stopped(step, trainer.workdir / "checkpoints" / str(step))
