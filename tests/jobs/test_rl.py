"""The RL job end to end (smoke config through main.py in a subprocess, one CPU device), its
recovery from SIGKILL, and the evaluation helpers."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from meshrl.inference.sampler import Completion, Request
from meshrl.tests import main_process
from meshrl.tests.xla import cpu_env
from meshrl.trainer.curves import plot_curves, read_metrics
from meshrl.workflows.evaluate import EvalVersionError, aevaluate, pass_at_k

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = [sys.executable, str(ROOT / "main.py"), "--config", str(ROOT / "configs/default.py:smoke")]


def _env() -> dict[str, str]:
    return cpu_env()  # one CPU device, as on a laptop: not the suite's 8 fake ones


def _start(workdir: pathlib.Path, *overrides: str) -> subprocess.Popen:
    return main_process.start([*SMOKE, *overrides], workdir, ROOT, _env())


def _finish(proc: subprocess.Popen, workdir: pathlib.Path, timeout: float = 240) -> None:
    main_process.finish(proc, workdir, timeout)


def _final_weights(workdir: pathlib.Path, version: int) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    from meshrl.utils.params import flat_params

    restored = ocp.StandardCheckpointer().restore(workdir / "weights" / str(version))
    return {k: np.asarray(v) for k, v in flat_params(restored).items()}


def test_smoke_rl_job_writes_summary_events_checkpoints_weights_and_plot(tmp_path):
    workdir = tmp_path / "run"

    t0 = time.monotonic()
    _finish(_start(workdir), workdir)
    wall = time.monotonic() - t0

    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0, summary
    assert summary["steps"] == summary["start_step"] + 4 == 4
    assert summary["tokens_per_s"] > 0
    # Admission and the hand-over check bound staleness; the histogram reaches the summary.
    assert 0 <= summary["max_staleness_seen"] <= summary["max_staleness"] == 2
    assert sum(summary["staleness_hist"].values()) == 4 * 4 * 4  # steps x groups x group size
    assert list((workdir / "tb").glob("events.out.tfevents.*"))
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [2, 4]
    assert (workdir / "weights" / "4").is_dir()
    assert (workdir / "sft" / "checkpoints").is_dir()  # the SFT warm start ran
    assert (workdir / "rl_curves.png").stat().st_size > 1000
    metrics = read_metrics(workdir / "metrics.jsonl")
    assert all("rollout/reward_mean" in metrics[s] for s in range(1, 5))
    for s in range(1, 5):  # the process's CPU time over each step: some, and at most all cores
        m = metrics[s]
        assert 0.0 < m["perf/process_cpu_s"] <= m["perf/step_time_s"] * os.cpu_count() + 0.05, m
        # The trainer's phases are parts of the step (the rollout wait is the rest).
        phases = [m[f"perf/{k}_s"] for k in ("batch_build", "train_step", "handoff")]
        assert all(x >= 0.0 for x in phases), m
        assert m["perf/rollout_wait_s"] + sum(phases) <= m["perf/step_time_s"] + 1e-6, m
    assert "eval/greedy_accuracy" in metrics[0] and "eval/greedy_accuracy" in metrics[4]
    assert wall < 120, wall
    # A quiet console: one line per logged step, a closing table, no third-party INFO records.
    console = main_process.log_path(workdir).read_text().splitlines()
    assert len(console) <= 40, "\n".join(console)
    assert sum(" version " in line and " reward " in line for line in console) == 4
    assert any(line.endswith("RL summary") for line in console)
    assert not [line for line in console if "orbax" in line.lower() or line.startswith("I1")]


@pytest.mark.slow  # ~50 s; the MoE train step and sampler have their own default-run tests
def test_moe_smoke_rl_job_trains_an_moe_decoder_and_logs_its_router_metrics(tmp_path):
    workdir = tmp_path / "moe"
    cmd = [*SMOKE[:-1], str(ROOT / "configs/default.py:moe_smoke")]

    _finish(main_process.start(cmd, workdir, ROOT, _env()), workdir)

    summary = json.loads((workdir / "summary.json").read_text())
    metrics = read_metrics(workdir / "metrics.jsonl")
    assert summary["steps"] == 4
    for s in range(1, 5):
        m = metrics[s]
        assert 1.0 <= m["train/moe/aux_loss"] < 4.0, m  # 4 experts, top-2: 2 when balanced
        assert m["train/moe/load_max_over_mean"] >= 1.0 and m["train/moe/dropped_frac"] == 0
    assert (workdir / "weights" / "4").is_dir()


@pytest.mark.slow  # three smoke runs, ~90 s on 2 CPU cores
def test_sigkill_after_first_checkpoint_then_rerun_resumes_and_matches_uninterrupted_run(
        tmp_path):
    sync = ["--config.rollout.max_staleness=0", "--config.trainer.steps=6"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _finish(_start(reference, *sync), reference)

    proc = _start(killed, *sync)
    manifest = killed / "checkpoints" / "2" / "meshrl_manifest.json"
    deadline = time.monotonic() + 240
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert manifest.exists()
    assert not (killed / "summary.json").exists(), "the run finished before it was killed"

    _finish(_start(killed, *sync), killed)

    summary = json.loads((killed / "summary.json").read_text())
    assert summary["start_step"] >= 2 and summary["steps"] == 6
    ref, got = _final_weights(reference, 6), _final_weights(killed, 6)
    assert ref.keys() == got.keys()
    for name in ref:
        # Same prompts, seeds and versions: only float summation order could differ.
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    np.testing.assert_allclose(pass_at_k(4, 1, 1), 0.25, rtol=1e-12, atol=0)
    np.testing.assert_allclose(pass_at_k(4, 1, 2), 0.5, rtol=1e-12, atol=0)  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(2, 3, 1)


class _FakeEngine:
    """Answers ``"7"`` to every prompt; its version may change mid-evaluation."""

    def __init__(self, version: int, drift_after: int | None = None) -> None:
        self.version, self.calls, self.drift_after = version, 0, drift_after

    async def agenerate(self, request: Request) -> Completion:
        self.calls += 1
        v = self.version + (1 if self.drift_after is not None and self.calls > self.drift_after
                            else 0)
        return Completion(request, [ord("7")], [0.0], [0.0], [v], "stop")


class _ExactPool:
    names = ["exact"]

    def score_components(self, prompts, completions, answer, **_):
        return {"exact": [float(c == a) for c, a in zip(completions, answer, strict=True)]}


def _examples() -> list[dict]:
    return [{"prompt": "3+4=", "prompt_ids": [1, 51], "answer": "7"},
            {"prompt": "1+1=", "prompt_ids": [1, 49], "answer": "2"}]


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_evaluation_reports_greedy_accuracy_and_pass_at_k_from_the_verifier():
    out = asyncio.run(aevaluate(_FakeEngine(3), _ExactPool(), _examples(), version=3,
                                decode=_decode, stop_ids=(2,), max_new_tokens=4, n=4))

    assert out["eval/greedy_accuracy"] == 0.5
    assert out["eval/pass_at_1"] == 0.5 and out["eval/pass_at_4"] == 0.5


def test_evaluation_reports_the_greedy_completions_mean_score_beside_accuracy():
    class PartialPool(_ExactPool):  # 0.4 for a wrong answer: a score, never correct
        def score_components(self, prompts, completions, answer, **_):
            return {"exact": [1.0 if c == a else 0.4 for c, a in zip(completions, answer,
                                                                       strict=True)]}

    out = asyncio.run(aevaluate(_FakeEngine(3), PartialPool(), _examples(), version=3,
                                decode=_decode, stop_ids=(2,), max_new_tokens=4))

    assert out["eval/greedy_accuracy"] == 0.5
    assert out["eval/reward_mean"] == pytest.approx(0.7, rel=0, abs=1e-12)


def test_evaluation_scores_rows_with_and_without_an_optional_field_each_with_its_own():
    class NeedsAllFieldsPool(_ExactPool):
        def score_components(self, prompts, completions, answer, **extra):
            assert all(len(v) == len(prompts) for v in extra.values()), extra
            return super().score_components(prompts, completions, answer)

    rows = [{**_examples()[0], "difficulty": 3}, _examples()[1], _examples()[0]]
    out = asyncio.run(aevaluate(_FakeEngine(3), NeedsAllFieldsPool(), rows, version=3,
                                decode=_decode, stop_ids=(2,), max_new_tokens=4, n=2))

    assert out["eval/greedy_accuracy"] == pytest.approx(2 / 3, rel=0, abs=1e-12)
    assert out["eval/pass_at_2"] == pytest.approx(2 / 3, rel=0, abs=1e-12)


def test_evaluation_with_tokens_of_another_version_raises():
    with pytest.raises(EvalVersionError, match="versions"):
        asyncio.run(aevaluate(_FakeEngine(3, drift_after=1), _ExactPool(), _examples(),
                              version=3, decode=_decode, stop_ids=(2,), max_new_tokens=4))


def test_plot_curves_writes_the_png_and_leaves_the_callers_matplotlib_backend(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # stands in for a notebook's inline backend
    try:
        plot_curves({1: {"rollout/reward_mean": 0.2}, 2: {"rollout/reward_mean": 0.4,
                                                          "eval/greedy_accuracy": 0.5}},
                    tmp_path / "curves.png")
        backend = matplotlib.get_backend()
    finally:
        matplotlib.use(before)

    assert backend == "svg"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_curves_shows_rewards_outside_zero_to_one(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    limits = []
    monkeypatch.setattr(Axes, "set_ylim", lambda self, lo, hi: limits.append((lo, hi)))
    plot_curves({1: {"rollout/reward_mean": -0.6}, 2: {"rollout/reward_mean": 1.45,
                                                       "eval/greedy_accuracy": 0.5}},
                tmp_path / "curves.png")

    ((lo, hi),) = limits
    assert lo < -0.6 and hi > 1.45


def _rl_config(**overrides):
    from meshrl.configs.loader import base_config, from_config_dict

    cfg = base_config("rl")
    cfg.data.max_prompt_len = 64
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return from_config_dict(cfg)


@pytest.mark.parametrize("overrides, steps", [
    ({"trainer.steps": 9}, 9),  # rl.warm_start_steps = -1: as many as trainer.steps
    ({"trainer.steps": 9, "rl.warm_start_steps": 4}, 4),
    ({"trainer.steps": 9, "rl.warm_start_steps": 0}, 0),
    ({"trainer.steps": 9, "model.hf_path": "/ckpt/qwen"}, 0),  # pretrained: no warm start
])
def test_warm_start_length_follows_rl_warm_start_steps(overrides, steps):
    from meshrl.jobs.rl_setup import warm_start_steps

    assert warm_start_steps(_rl_config(**overrides)) == steps


def test_warm_start_sft_config_runs_adamw_at_rl_warm_start_lr():
    from meshrl.configs.schema import Job
    from meshrl.jobs.rl_setup import warm_start_config
    from meshrl.trainer.optimizer import make_optimizer

    config = _rl_config(**{"rl.warm_start_lr": 3e-4, "trainer.learning_rate": 1e-6,
                           "trainer.eval_every": 5, "optimizer.name": "sgd",
                           "optimizer.schedule": "constant", "rl.warm_start_batch_size": 24,
                           "lora.rank": 4})

    sft = warm_start_config(config, 12)
    _, schedule = make_optimizer(sft.optimizer, sft.trainer.learning_rate, sft.trainer.steps)

    assert sft.job == Job.SFT and sft.optimizer.name == "adamw"
    assert (sft.trainer.steps, sft.trainer.eval_every, sft.trainer.batch_size) == (12, 0, 24)
    assert sft.lora.rank == 0  # the warm start trains the whole model; RL trains the adapters
    np.testing.assert_allclose(float(schedule(0)), 3e-4, rtol=1e-6, atol=0)
    assert (sft.model, sft.data, sft.mesh) == (config.model, config.data, config.mesh)


def test_reinforce_pp_across_processes_is_refused_unless_the_device_recomputes_it():
    from meshrl.configs.fields import ConfigError
    from meshrl.jobs.rl import check_process_split
    from meshrl.tests.trainer.tiny import tiny_rl_config

    batch_wide = tiny_rl_config(**{"rl.advantage": "reinforce_pp", "rollout.prompts_per_step": 4})
    with pytest.raises(ConfigError, match=r"rl.advantage = 'reinforce_pp' with 2 processes"):
        check_process_split(batch_wide, 2)
    check_process_split(batch_wide, 1)
    check_process_split(tiny_rl_config(**{"rl.advantage": "grpo",
                                           "rollout.prompts_per_step": 4}), 2)
    check_process_split(tiny_rl_config(**{"rl.advantage": "reinforce_pp", "rl.kl_coef": 0.1,
                                           "rl.kl_where": "reward",
                                           "rollout.prompts_per_step": 4}), 2)
