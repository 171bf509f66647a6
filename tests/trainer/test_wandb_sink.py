"""logging.wandb_project logs the scalars TensorBoard gets to Weights & Biases from process 0
(a recording stand-in for the package: no network, no wandb needed), and stops with one line
when the package is missing or wandb refuses to start a run."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from meshrl.configs import base_config, from_config_dict
from meshrl.tests.trainer.test_metrics_writer import _scalars as tensorboard_scalars
from meshrl.tests.trainer.tiny import make_loop, tiny_config
from meshrl.trainer.metrics import MetricsWriter
from meshrl.trainer.sft_loop import run_sft
from meshrl.trainer.wandb_sink import WandbSink, check_wandb
from meshrl.utils.errors import UserError


class FakeWandbError(Exception):
    pass


class FakeRun:
    def __init__(self, **kwargs) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(scalars)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch) -> types.ModuleType:
    """A ``wandb`` module that records its runs in ``.runs``; ``.fail`` makes init raise."""
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.errors = types.SimpleNamespace(Error=FakeWandbError)
    fake.runs, fake.fail = [], None

    def init(**kwargs):
        if fake.fail:
            raise FakeWandbError(fake.fail)
        fake.runs.append(FakeRun(**kwargs))
        return fake.runs[-1]

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def _config(**overrides):
    return tiny_config(**{"checkpoint.every_steps": 0, "checkpoint.async_save": False,
                          "trainer.steps": 3, "logging.wandb_project": "meshrl-test",
                          **overrides})


def test_sft_run_logs_to_wandb_the_steps_and_values_tensorboard_got(tmp_path, fake_wandb):
    loop = make_loop(_config(), tmp_path)
    run_sft(loop)
    loop.close()
    (run,) = fake_wandb.runs
    assert run.kwargs["project"] == "meshrl-test" and run.kwargs["name"] == tmp_path.name
    assert run.kwargs["config"]["logging"]["wandb_project"] == "meshrl-test"
    assert run.kwargs["config"]["trainer"]["steps"] == 3 and run.finished
    logged = [(tag, step, value) for step, scalars in run.logged for tag, value in scalars.items()]
    tb = tensorboard_scalars(tmp_path / "tb")
    assert [step for step, _ in run.logged] == [1, 2, 3]
    assert [(tag, step) for tag, step, _ in logged] == [(tag, step) for tag, step, _ in tb]
    # TensorBoard stores float32: equal up to its rounding.
    assert [v for *_, v in logged] == pytest.approx([v for *_, v in tb], rel=1e-6, abs=1e-30)


def test_run_name_override_and_processes_other_than_0_log_nothing(tmp_path, fake_wandb):
    sink = WandbSink(_config(**{"logging.wandb_run_name": "lr-sweep-3"}), tmp_path)
    assert fake_wandb.runs[0].kwargs["name"] == "lr-sweep-3"
    writer = MetricsWriter(tmp_path, tensorboard=False, process_index=1, wandb=sink)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert fake_wandb.runs[0].logged == [] and not fake_wandb.runs[0].finished


def test_wandb_refusing_to_start_a_run_is_one_user_error_line(tmp_path, fake_wandb):
    fake_wandb.fail = "No API key configured.\nUse `wandb login` to log in."
    with pytest.raises(UserError, match=r"^logging.wandb_project = 'meshrl-test': wandb did not "
                                        r"start a run: No API key .*WANDB_MODE=offline") as e:
        WandbSink(_config(), tmp_path)
    assert "\n" not in str(e.value)


def test_wandb_project_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    cfg = base_config("sft")
    cfg.logging.wandb_project = "p"
    with pytest.raises(UserError, match=r"^logging.wandb_project = 'p': the wandb package is not "
                                        r"installed: pip install -e \"\.\[wandb\]\" -c "
                                        r"constraints.txt"):
        check_wandb(from_config_dict(cfg))
    check_wandb(from_config_dict(base_config("sft")))  # off: the package is not needed


def test_dry_run_and_run_preflight_reject_wandb_project_without_the_package(monkeypatch):
    from meshrl.jobs.dispatch import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r'pip install -e "\.\[wandb\]"'):
        preflight(_config())


def test_rl_warm_start_keeps_out_of_the_wandb_run():
    from meshrl.jobs.rl_setup import warm_start_config

    cfg = base_config("rl")
    cfg.logging.wandb_project = "p"
    warm = warm_start_config(from_config_dict(cfg), 5)
    assert warm.logging.wandb_project == "" and warm.trainer.steps == 5
