"""A resumed run's summary covers the whole run: the first step's figures come from the
metrics the first process logged, and the reward pool's counts go on from the checkpoint."""

from __future__ import annotations

import jax
import pytest

from meshrl.configs import sft_synthetic
from meshrl.configs.loader import from_config_dict
from meshrl.jobs import sft as sft_job
from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config
from meshrl.trainer.curves import read_metrics

VARIED = ("meshrl.tests.jobs.varied_reward:reward",)


def _metrics(workdir) -> dict[int, dict]:
    return read_metrics(workdir / "metrics.jsonl")  # a step's rows merged


def test_a_resumed_rl_runs_summary_keeps_the_first_reward_and_counts_every_reward_call(
        tmp_path):
    _, first = run_rl(tiny_rl_config(**{"reward.names": VARIED}), tmp_path)
    _, resumed = run_rl(tiny_rl_config(**{"reward.names": VARIED, "trainer.steps": 3}),
                        tmp_path)

    metrics = _metrics(tmp_path)
    assert resumed["start_step"] == 2
    assert metrics[1]["rollout/reward_mean"] != metrics[3]["rollout/reward_mean"]
    assert resumed["reward_first"] == first["reward_first"] == metrics[1]["rollout/reward_mean"]
    assert resumed["reward_last"] == metrics[3]["rollout/reward_mean"]
    # Step 3 scores at least its own 3 groups of 2 on top of the first run's calls.
    assert resumed["reward/calls"] >= first["reward/calls"] + 6, (first, resumed)


def test_the_first_logged_value_of_a_resumed_run_comes_from_its_metrics_file(tmp_path):
    import json
    import types

    from meshrl.trainer.summary import first_logged

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 5.0}, {"step": 1, "eval": 0.5}, {"step": 2, "loss": 4.0})))
    history = [{"step": 3, "loss": 3.0}]
    resumed = types.SimpleNamespace(start_step=2, workdir=tmp_path, history=history)
    fresh = types.SimpleNamespace(start_step=0, workdir=tmp_path, history=history)

    assert first_logged(resumed, "loss") == 5.0
    assert first_logged(fresh, "loss") == 3.0  # a fresh run's own history
    assert first_logged(resumed, "nope") is None


def test_a_finished_rl_run_run_again_keeps_its_last_reward_and_reports_no_throughput(tmp_path):
    _, first = run_rl(tiny_rl_config(**{"reward.names": VARIED}), tmp_path)
    _, again = run_rl(tiny_rl_config(**{"reward.names": VARIED}), tmp_path)

    assert again["start_step"] == again["steps"] == 2
    assert again["reward_last"] == first["reward_last"] == _metrics(tmp_path)[2][
        "rollout/reward_mean"]
    assert again["tokens_per_s"] is None  # nothing generated: no rate, not 0


def test_the_summary_of_a_run_that_trained_nothing_comes_from_its_metrics_file(tmp_path):
    import json
    import types

    from meshrl.trainer.sft_loop import sft_summary

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "mfu": 0.1, "skipped": 0},
        {"step": 2, "loss": 4.0, "tokens_per_s": 30.0, "mfu": 0.3, "skipped": 1})))
    engine = types.SimpleNamespace(
        start_step=2, workdir=tmp_path, history=[], params={"w": jax.numpy.ones(2)}, data=None,
        config=types.SimpleNamespace(job=types.SimpleNamespace(value="sft"),
                                     trainer=types.SimpleNamespace(steps=2)),
        mesh=types.SimpleNamespace(devices=types.SimpleNamespace(size=1)))

    summary = sft_summary(engine, [], {}, 1.0, 0)

    assert (summary["first_loss"], summary["final_loss"]) == (5.0, 4.0)
    assert (summary["tokens_per_s"], summary["mfu"], summary["skipped_steps"]) == (30.0, 0.3, 1)


@pytest.mark.slow  # two SFT runs; the RL case above runs the same helper end to end
def test_a_resumed_sft_runs_summary_keeps_the_first_loss(tmp_path):
    def config(steps):
        cfg = sft_synthetic.get_config("smoke")
        cfg.trainer.steps = steps
        cfg.trainer.eval_every = 0
        cfg.checkpoint.async_save = False
        cfg.logging.progress_bar = False
        cfg.logging.tensorboard = False
        return from_config_dict(cfg)

    first = sft_job.run(config(2), str(tmp_path))
    resumed = sft_job.run(config(3), str(tmp_path))

    metrics = _metrics(tmp_path)
    assert resumed["start_step"] == 2
    assert resumed["first_loss"] == pytest.approx(first["first_loss"], rel=0, abs=0)
    assert resumed["first_loss"] == pytest.approx(metrics[1]["loss"], rel=0, abs=0)
    assert resumed["final_loss"] == pytest.approx(metrics[3]["loss"], rel=0, abs=0)
