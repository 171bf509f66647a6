"""An RL run whose reward scores every sample alike stops with one line naming the reward's
answer format and the setting to change, and leaves its newest checkpoint restorable; so does a
requested stop (Ctrl-C), after saving the step it reached."""

from __future__ import annotations

import time

import jax
import pytest

from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config
from meshrl.tests.trees import assert_trees_equal
from meshrl.utils import interrupt
from meshrl.workflows.watch import RewardStallError

ZERO = ("meshrl.tests.jobs.zero_reward:reward",)


def _run(config, workdir):
    trainer, summary = run_rl(config, workdir, timeout_s=120)
    return trainer, summary


@pytest.mark.slow
def test_all_zero_reward_run_stops_with_one_line_and_keeps_a_restorable_checkpoint(tmp_path):
    from meshrl.jobs import rl as rl_job

    # Two steps that keep every group (no filter, no stop) leave a checkpoint at step 2.
    first = tiny_rl_config(**{"reward.names": ZERO, "rollout.max_filtered_in_a_row": 0})
    done, _ = _run(first, tmp_path)
    done_params = jax.device_get(done.engine.params)
    # Resumed with filtering on: every group is dropped, so no batch can ever fill.
    stalled = tiny_rl_config(**{"reward.names": ZERO, "trainer.steps": 4,
                                "rollout.filter_equal_groups": True,
                                "rollout.max_filtered_in_a_row": 6})

    start = time.monotonic()
    with pytest.raises(RewardStallError) as info:
        _run(stalled, tmp_path)

    assert time.monotonic() - start < 60.0
    message = str(info.value)
    assert "\n" not in message
    assert "6 groups in a row had every sample scored alike (rewards 0)" in message
    assert "expects the word 'never'" in message
    assert "rollout.filter_equal_groups=false" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2"]
    trainer = rl_job.build(first, tmp_path)  # the newest checkpoint restores
    try:
        assert trainer.start_step == 2
        assert int(jax.device_get(trainer.state.step)) == 2
        assert_trees_equal(jax.device_get(trainer.engine.params), done_params)
    finally:
        trainer.close()


@pytest.mark.slow
def test_requested_stop_saves_the_reached_step_and_the_run_resumes_there(tmp_path, monkeypatch):
    from meshrl.jobs import rl as rl_job

    config = tiny_rl_config(**{"trainer.steps": 5})
    monkeypatch.setattr(interrupt, "_state", {"requested": True})  # a Ctrl-C before step 1

    with pytest.raises(interrupt.Stopped) as info:
        _run(config, tmp_path)

    step = info.value.step
    assert step in (0, 1)  # during the first batch's wait, or after the first step
    assert str(info.value) == (f"stopped at step {step}; checkpoint saved: "
                               f"{tmp_path / 'checkpoints' / str(step)}")
    monkeypatch.setattr(interrupt, "_state", {"requested": False})
    trainer = rl_job.build(config, tmp_path)
    try:
        assert trainer.start_step == step
    finally:
        trainer.close()
