"""The SFT loop's side of a requested stop (``utils.interrupt``): save the step, then stop."""

from __future__ import annotations

from typing import Any

from meshrl.utils import interrupt


def stop_hook(step: int, engine: Any) -> None:
    """``trainer.sft_loop.run_sft`` after each step's save: after a Ctrl-C, checkpoint ``step``
    (unless the loop just did) and raise ``interrupt.Stopped``; the last step is left to the
    loop's own final save."""
    if not interrupt.requested() or step == engine.config.trainer.steps:
        return
    every = engine.config.checkpoint.every_steps
    if not (every and step % every == 0):
        engine.save(step)
    engine.finish()  # the save is durable before the job reports it
    raise interrupt.Stopped(step, engine.workdir / "checkpoints" / str(step))
