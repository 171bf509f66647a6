"""An RL step's metrics are recorded as soon as the step is done, not at the next dispatch: the
loop already waits for the step's params (the weight handoff), so the step's console line and
metric row do not also wait for the next rollout batch."""

from __future__ import annotations

import asyncio

from meshrl.tests.trainer.tiny import tiny_rl_config


def test_each_rl_steps_metrics_are_recorded_before_the_next_batch_is_awaited(
        tmp_path, monkeypatch):
    from meshrl.jobs import rl as rl_job
    from meshrl.trainer import rl_loop

    config = tiny_rl_config(**{"trainer.steps": 3, "rollout.max_staleness": 1})
    make, seen = rl_loop.make_runner, []

    def recording_runner(*args, **kwargs):
        runner = make(*args, **kwargs)
        get_batch = runner.get_batch

        async def get_batch_after_recording(version: int):
            # Steps recorded when the batch that trains version ``version`` is asked for.
            seen.append((version, [h["step"] for h in trainer.history]))
            return await get_batch(version)

        runner.get_batch = get_batch_after_recording
        return runner
    monkeypatch.setattr(rl_loop, "make_runner", recording_runner)

    trainer = rl_job.build(config, tmp_path)
    try:
        asyncio.run(asyncio.wait_for(trainer.arun(), timeout=300))
    finally:
        trainer.close()

    assert seen == [(0, []), (1, [1]), (2, [1, 2])]
    assert [h["step"] for h in trainer.history] == [1, 2, 3]
