"""The evaluate job: every weight version an RL run publishes is evaluated once, with the version
as the step; a rerun skips what is done; it ends on the run's final version or its end, and a
missing run, an ended run without its final version or weights of another model are clear
errors."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Job
from meshrl.inference.published import published_versions
from meshrl.jobs import evaluate
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.tests.xla import cpu_env
from meshrl.trainer.curves import read_metrics
from meshrl.workflows import version_eval
from meshrl.workflows.version_eval import VersionEvaluator

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = [sys.executable, str(ROOT / "main.py"), "--config", str(ROOT / "configs/default.py:smoke")]
# A reward that varies with the text: versions with other weights get other held-out scores,
# so the equal-metrics checks below can tell weights apart.
RL_OVERRIDES = {"trainer.steps": 4, "checkpoint.publish_every": 2, "data.eval_examples": 8,
                "reward.names": ("meshrl.tests.jobs.varied_reward:reward",)}


def _eval_config(**overrides):
    config = tiny_rl_config(**{**RL_OVERRIDES, "evaluate.poll_s": 0.1, **overrides})
    return dataclasses.replace(config, job=Job.EVALUATE)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory) -> pathlib.Path:
    """A finished tiny RL run (4 steps, versions 2 and 4 published, summary.json written)."""
    from meshrl.jobs import rl

    workdir = tmp_path_factory.mktemp("rl") / "run"
    rl.run(tiny_rl_config(**RL_OVERRIDES), str(workdir))
    return workdir


@pytest.fixture
def workdir(rl_run, tmp_path) -> pathlib.Path:
    """A copy of the RL run's workdir the test may change."""
    return pathlib.Path(shutil.copytree(rl_run, tmp_path / "run"))


def _count_evaluations(monkeypatch) -> list[int]:
    seen: list[int] = []
    original = VersionEvaluator.evaluate

    async def counting(self, version):
        seen.append(version)
        return await original(self, version)

    monkeypatch.setattr(VersionEvaluator, "evaluate", counting)
    return seen


def test_evaluate_after_rl_run_writes_every_published_version_with_version_as_step(workdir):
    config = _eval_config(**{"logging.tensorboard": True})

    summary = evaluate.run(config, str(workdir))

    assert published_versions(workdir) == evaluate.rl_versions(config) == [2, 4]
    assert summary["versions"] == [2, 4] and summary["exit"] == "final_version"
    assert summary["final_version"] == 4 and summary["not_evaluated"] == []
    metrics = read_metrics(workdir / "eval" / "metrics.jsonl")
    assert sorted(metrics) == [2, 4]
    for m in metrics.values():  # greedy, and pass@k from rollout.group_size = 2 samples
        assert {"eval/greedy_accuracy", "eval/pass_at_1", "eval/pass_at_2"} <= set(m), m
        assert 0.0 <= m["eval/pass_at_1"] <= m["eval/pass_at_2"] <= 1.0
    # The same evaluation as the RL job's own at its last version (the Orbax copy of the
    # weights is bitwise the in-process handoff's): identical held-out numbers.
    rl_eval = read_metrics(workdir / "metrics.jsonl")[4]
    for key in ("eval/greedy_accuracy", "eval/reward_mean", "eval/completion_len",
                "eval/pass_at_1", "eval/pass_at_2"):
        assert metrics[4][key] == rl_eval[key], key
    assert metrics[2]["eval/reward_mean"] != metrics[4]["eval/reward_mean"]
    assert list((workdir / "eval" / "tb").glob("events.out.tfevents.*"))
    saved = json.loads((workdir / "eval" / "summary.json").read_text())
    assert saved["accuracy_final"] == metrics[4]["eval/greedy_accuracy"]


def test_rerun_skips_versions_already_in_the_eval_metrics(workdir, monkeypatch):
    config = _eval_config()
    evaluate.run(config, str(workdir))
    path = workdir / "eval" / "metrics.jsonl"
    rows = path.read_text().splitlines()
    seen = _count_evaluations(monkeypatch)

    again = evaluate.run(config, str(workdir))
    path.write_text(rows[0] + "\n")  # as if killed after evaluating version 2
    resumed = evaluate.run(config, str(workdir))

    assert seen == [4]  # the complete rerun evaluated nothing, the resumed one only version 4
    assert again["versions"] == resumed["versions"] == [2, 4]
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [2, 4]


def test_a_version_published_again_after_its_evaluation_is_evaluated_again(workdir,
                                                                          monkeypatch):
    config = _eval_config()
    evaluate.run(config, str(workdir))
    before = read_metrics(workdir / "eval" / "metrics.jsonl")
    assert before[2]["eval/reward_mean"] != before[4]["eval/reward_mean"]
    # As a resumed RL run publishes a version again, with other weights (here version 4's).
    weights = workdir / "weights"
    shutil.rmtree(weights / "2")
    shutil.copytree(weights / "4", weights / "2")
    seen = _count_evaluations(monkeypatch)

    summary = evaluate.run(config, str(workdir))
    again = evaluate.run(config, str(workdir))

    assert seen == [2]  # once: the second rerun finds every evaluation current
    assert summary["versions"] == again["versions"] == [2, 4]
    metrics = read_metrics(workdir / "eval" / "metrics.jsonl")
    for key in ("eval/greedy_accuracy", "eval/reward_mean", "eval/completion_len",
                "eval/pass_at_1"):
        assert metrics[2][key] == metrics[4][key], key


def test_a_rerun_waits_for_a_final_version_the_resumed_run_deleted_after_its_evaluation(
        workdir, monkeypatch):
    evaluate.run(_eval_config(), str(workdir))  # versions 2 and 4 evaluated
    # The RL run resumes from step 2: it deleted version 4 and has not published it again.
    (workdir / "summary.json").unlink()
    shutil.rmtree(workdir / "weights" / "4")
    seen = _count_evaluations(monkeypatch)

    with pytest.raises(evaluate.EvaluateTimeoutError, match="waiting for the final version 4"):
        evaluate.run(_eval_config(**{"evaluate.timeout_s": 0.5}), str(workdir))

    assert seen == []


def test_versions_appearing_one_by_one_are_each_evaluated_as_they_appear(workdir, monkeypatch):
    (workdir / "summary.json").unlink()  # the run is still going
    real = published_versions(workdir)
    listings: list[list[int]] = []

    def appearing(path):  # one more published version at each listing, from none
        listings.append(real[:len(listings)])
        return listings[-1]
    monkeypatch.setattr(version_eval, "published_versions", appearing)
    seen = _count_evaluations(monkeypatch)

    summary = evaluate.run(_eval_config(), str(workdir))

    assert seen == summary["versions"] == [2, 4] and summary["exit"] == "final_version"
    assert listings == [[], [2], [2, 4]]  # 2 was evaluated before 4 was listed; then it exits


def test_run_that_ended_without_its_final_version_is_an_error(workdir):
    shutil.rmtree(workdir / "weights" / "4")

    with pytest.raises(evaluate.RunEndedError, match=r"summary.json: the RL run ended with "
                                                     r"trainer.steps = 4, but its final version "
                                                     r"4 is not under .*published: \[2\]"):
        evaluate.run(_eval_config(), str(workdir))

    assert sorted(read_metrics(workdir / "eval" / "metrics.jsonl")) == [2]


def test_rl_schedule_publishes_every_publish_every_th_step_every_checkpoint_and_the_last():
    config = tiny_rl_config(**{"trainer.steps": 7, "checkpoint.publish_every": 3,
                               "checkpoint.every_steps": 2})

    assert evaluate.rl_versions(config) == [2, 3, 4, 6, 7]
    assert evaluate.final_version(config) == 7


def test_ended_run_of_zero_steps_publishes_nothing_and_the_job_exits_at_once(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"job": "rl", "steps": 0}))

    summary = evaluate.run(_eval_config(**{"trainer.steps": 0}), str(tmp_path))

    assert summary["versions"] == [] and summary["exit"] == "run_ended"
    assert summary["final_version"] is None


def test_summary_of_a_shorter_earlier_run_does_not_end_the_wait(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"job": "rl", "steps": 2}))

    assert not evaluate.run_ended(tmp_path, tiny_rl_config(**RL_OVERRIDES))  # steps = 4


def test_weights_of_another_model_are_a_config_error_naming_the_version(workdir):
    config = _eval_config(**{"model.hidden_size": 64, "model.intermediate_size": 128})

    with pytest.raises(ConfigError, match=r"weights/2: weight version 2 does not fit model.\* "
                                          r"of this config \(param .*shape"):
        evaluate.run(config, str(workdir))


def test_no_weights_ever_is_an_error_naming_evaluate_timeout_s_after_the_timeout(tmp_path):
    config = _eval_config(**{"evaluate.timeout_s": 1.0, "evaluate.poll_s": 0.2})
    t0 = time.monotonic()

    with pytest.raises(evaluate.EvaluateTimeoutError,
                       match=r"evaluate.timeout_s = 1.0: no new weight version under .*weights "
                             r"and no end of the RL run .* for 1 s; evaluated \[\], waiting for "
                             r"the final version 4"):
        evaluate.run(config, str(tmp_path / "empty"))

    assert 1.0 <= time.monotonic() - t0 < 30  # the set-up (no compile) plus the timeout


def _env() -> dict[str, str]:
    return cpu_env()  # one CPU device


def _start(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 (closed by the OS)
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_evaluate_job_in_main_times_out_with_one_error_line(tmp_path):
    cmd = [*SMOKE, f"--workdir={tmp_path / 'run'}", "--config.job=evaluate",
           "--config.evaluate.timeout_s=2", "--config.evaluate.poll_s=0.5"]

    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)

    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: evaluate.timeout_s = 2.0: no new weight version under "), out.stderr[-2000:]


@pytest.mark.slow  # the smoke RL run and the evaluator side by side: ~30 s on 2 CPU cores
def test_evaluate_job_beside_a_running_rl_job_evaluates_every_version_it_publishes(tmp_path):
    workdir = tmp_path / "run"
    evaluator = _start([*SMOKE, f"--workdir={workdir}", "--config.job=evaluate",
                        "--config.trainer.steps=8",
                        "--config.evaluate.poll_s=0.5", "--config.evaluate.timeout_s=240"],
                       tmp_path / "evaluate.log")
    time.sleep(1.0)  # the evaluator is watching before the RL job starts
    trainer = _start([*SMOKE, f"--workdir={workdir}", "--config.trainer.steps=8",
                      "--config.checkpoint.keep_versions=0"],  # every version stays to compare
                     tmp_path / "rl.log")

    rc_rl = _wait(trainer, 300)
    rc_eval = _wait(evaluator, 120)

    assert rc_rl == 0, (tmp_path / "rl.log").read_text(errors="replace")[-4000:]
    assert rc_eval == 0, (tmp_path / "evaluate.log").read_text(errors="replace")[-4000:]
    versions = published_versions(workdir)
    assert versions == [2, 4, 6, 8]
    metrics = read_metrics(workdir / "eval" / "metrics.jsonl")
    assert sorted(metrics) == versions
    summary = json.loads((workdir / "eval" / "summary.json").read_text())
    assert summary["versions"] == versions and summary["exit"] == "final_version"
    rl_metrics = read_metrics(workdir / "metrics.jsonl")  # eval_every = 2: the RL job's own
    for v in versions:
        for key in ("eval/greedy_accuracy", "eval/completion_len"):
            assert metrics[v][key] == rl_metrics[v][key], (v, key)


def test_wandb_project_logs_the_evaluated_versions_to_a_run_of_their_own(workdir, monkeypatch):
    import importlib.machinery
    import types

    runs: list[dict] = []

    class Run:
        def __init__(self, **kwargs) -> None:
            self.kwargs, self.steps = kwargs, []
            runs.append(self.__dict__)

        def log(self, scalars: dict, step: int) -> None:
            self.steps.append(step)

        def finish(self) -> None:
            pass

    fake = types.ModuleType("wandb")  # a recording stand-in: no network, no wandb needed
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.errors = types.SimpleNamespace(Error=RuntimeError)
    fake.init = lambda **kwargs: Run(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)

    evaluate.run(_eval_config(**{"logging.wandb_project": "p"}), str(workdir))

    assert len(runs) == 1 and runs[0]["kwargs"]["name"] == "run-eval"
    assert sorted(set(runs[0]["steps"])) == [2, 4]


def test_a_job_waiting_for_another_final_version_than_the_runs_says_so(workdir):
    from meshrl.tests.logs import captured

    # The run has 4 steps; the evaluate job was given 2 (its overrides forgotten).
    with captured("meshrl.evaluate") as messages:
        summary = evaluate.run(_eval_config(**{"trainer.steps": 2}), str(workdir))

    assert summary["final_version"] == 2
    assert any("written with trainer.steps = 4, this job has 2" in m for m in messages), messages


def test_the_evaluate_job_on_several_processes_is_one_clear_error(workdir, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="job = 'evaluate' on 2 processes: it runs on one"):
        evaluate.run(_eval_config(), str(workdir))
    assert not (workdir / "eval").exists()
