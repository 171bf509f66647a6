"""A skipped (non-finite) RL step still consumes its batch: the weight version the sampler and the
staleness controller see goes up by one per batch, so a synchronous run does not stall."""

from __future__ import annotations

import numpy as np

from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config


def test_synchronous_rl_run_with_a_skipped_non_finite_step_completes_one_version_per_batch(
        tmp_path, monkeypatch):
    from meshrl.trainer import rl_loop

    config = tiny_rl_config(**{"trainer.steps": 3, "rollout.max_staleness": 0,
                               "trainer.on_nonfinite": "skip"})
    build, built = rl_loop.make_rl_batch, []

    def poison_second_batch(*args, **kwargs):
        rb = build(*args, **kwargs)
        built.append(rb)
        if len(built) == 2:  # a NaN behaviour logprob on every loss token: a non-finite loss
            rb = rb.replace(behaviour_logprobs=np.where(
                rb.loss_mask > 0, np.nan, rb.behaviour_logprobs).astype(np.float32))
        return rb
    monkeypatch.setattr(rl_loop, "make_rl_batch", poison_second_batch)

    trainer, summary = run_rl(config, tmp_path)

    assert summary["steps"] == 3 and len(built) == 3
    assert [h["train/skipped"] for h in trainer.history] == [0.0, 1.0, 1.0]
    assert int(trainer.state.weight_version) == 2  # the skipped update never reached the params
    assert trainer.sampler.version == 3  # one published version per consumed batch
    assert summary["max_staleness_seen"] == 0
    # Synchronous: every loss token came from the version the step updates.
    assert [h["rollout/batch_staleness_max"] for h in trainer.history] == [0.0, 0.0, 0.0]
