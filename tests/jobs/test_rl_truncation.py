"""The RL job with truncated sampling (top-k, top-p, min-p): the trainer scores each token under
its logits truncated to the sampler's kept count, so with a float32 sampler and synchronous RL
the logprob mismatch stays float rounding, the loss is finite and the truncation mismatch is
reported every step."""

from __future__ import annotations

import math

import pytest

from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config


@pytest.mark.parametrize("settings, minibatches", [
    ({"sampler.top_p": 0.9}, 2),
    pytest.param({"sampler.top_k": 5}, 1, marks=pytest.mark.slow),  # ~10-20 s each
    pytest.param({"sampler.min_p": 0.3}, 1, marks=pytest.mark.slow)])
def test_truncated_sampling_rl_matches_sampler_logprobs_and_reports_the_mismatch(
        tmp_path, settings, minibatches):
    config = tiny_rl_config(**{"rollout.max_staleness": 0, "sampler.dtype": "float32",
                               "model.compute_dtype": "float32",
                               "rl.ppo_minibatches": minibatches, **settings})
    trainer, _ = run_rl(config, tmp_path)

    assert len(trainer.history) == config.trainer.steps
    for record in trainer.history:
        assert math.isfinite(record["train/loss"]), record
        assert record["train/rl/truncation_mismatch_frac_tokens"] > 0, record
        # Same params, same model code: every sampled token is inside the trainer's set ...
        assert record["train/rl/truncation_mismatch_frac"] == 0.0, record
        # ... and its truncated logprob is the sampler's up to float rounding.
        assert record["train/logprob_mismatch"] <= 1e-5, record


@pytest.mark.slow  # ~30 s: the smoke job through main.py
def test_smoke_rl_job_with_top_p_reports_finite_loss_and_the_truncation_mismatch(tmp_path):
    import json
    import pathlib
    import subprocess
    import sys

    from meshrl.tests.xla import cpu_env

    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "main.py"), "--config",
                          str(root / "configs/default.py:smoke"), f"--workdir={tmp_path}",
                          "--config.sampler.top_p=0.9"], cwd=root, env=cpu_env(),
                         capture_output=True, text=True, timeout=300)

    assert out.returncode == 0, out.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in steps if "train/loss" in r]
    assert len(trained) == 4
    for r in trained:
        assert math.isfinite(r["train/loss"]), r
        assert 0.0 <= r["train/rl/truncation_mismatch_frac"] <= 1.0, r
