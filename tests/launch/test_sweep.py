"""launch/sweep.py without JAX: the sweep vocabulary, trial names, bad sweep files, and the
local launcher driven end to end against a stand-in for main.py (a failing trial, a rerun)."""

from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import sys
import textwrap

import pytest

from meshrl.launch import sweep, sweep_run
from meshrl.launch.sweep import SweepError
from meshrl.tests.launch.fake_main import HEAD, install

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = f"{ROOT / 'configs' / 'default.py'}:smoke"
# Stands in for main.py: trial seed 1 fails the way main.py fails on bad input; the others
# write what a finished RL run leaves behind.
FAKE_MAIN = HEAD + '''if over["trainer.seed"] == "1":
    sys.exit("error: trainer.seed = 1: the fake main.py rejects it")
lr = float(over["trainer.learning_rate"])
with open(workdir / "metrics.jsonl", "a") as f:
    for step in range(3):
        f.write(json.dumps({"step": step, "rollout/reward_mean": lr * step,
                            "eval/greedy_accuracy": 0.5}) + "\\n")
(workdir / "summary.json").write_text(json.dumps({
    "accuracy_before": 0.25, "accuracy_after": 0.5, "reward_last": lr * 2, "wall_s": 1.5,
    "eval_after": {"eval/greedy_accuracy": 0.5}, "staleness_list": [1, 2]}))
'''


def _sweep_file(tmp_path: pathlib.Path, body: str, name: str = "s.py") -> pathlib.Path:
    path = tmp_path / name
    path.write_text("from meshrl.launch import sweep as hyper\n" + textwrap.dedent(body))
    return path


LR_SEED = f"""
CONFIG = {SMOKE!r}
def sweep():
    return hyper.product(hyper.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                         hyper.sweep("trainer.seed", [0, 1]))
"""


@pytest.fixture
def fake_main(tmp_path, monkeypatch, meshrl_logger):
    return install(tmp_path, monkeypatch, FAKE_MAIN)


# --- the vocabulary -------------------------------------------------------------------------


def test_product_of_two_axes_gives_every_combination_first_axis_slowest():
    got = sweep.product(sweep.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                        sweep.sweep("trainer.seed", [0, 1]))

    assert got == [{"trainer.learning_rate": 1e-3, "trainer.seed": 0},
                   {"trainer.learning_rate": 1e-3, "trainer.seed": 1},
                   {"trainer.learning_rate": 3e-4, "trainer.seed": 0},
                   {"trainer.learning_rate": 3e-4, "trainer.seed": 1}]


def test_zip_pairs_axes_elementwise_and_nests_in_product():
    paired = sweep.zip(sweep.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                       sweep.sweep("optimizer.warmup_steps", [10, 20]))

    got = sweep.product(paired, sweep.sweep("trainer.seed", [0, 1, 2]))

    assert paired == [{"trainer.learning_rate": 1e-3, "optimizer.warmup_steps": 10},
                      {"trainer.learning_rate": 3e-4, "optimizer.warmup_steps": 20}]
    assert len(got) == 6 and got[-1] == {**paired[1], "trainer.seed": 2}


def test_zip_of_different_lengths_raises_naming_the_lengths():
    with pytest.raises(SweepError, match=r"zipit: the axes have different lengths \[2, 3\]"):
        sweep.zip(sweep.sweep("trainer.seed", [0, 1]), sweep.sweep("data.difficulty", [1, 2, 3]))


def test_product_with_one_key_in_two_axes_raises_naming_the_key():
    with pytest.raises(SweepError, match="key 'trainer.seed' appears in more than one"):
        sweep.product(sweep.sweep("trainer.seed", [0]), sweep.sweep("trainer.seed", [1]))


@pytest.mark.parametrize("name, values, expected", [
    ("trainer.seed", "01", "values must be a non-empty list"),
    ("trainer.seed", [], "values must be a non-empty list"),
    ("seed", [0], "'section.field' string"),
])
def test_sweep_with_a_bad_axis_raises(name, values, expected):
    with pytest.raises(SweepError, match=expected):
        sweep.sweep(name, values)


# --- names -------------------------------------------------------------------------------------


def test_trial_names_are_field_names_and_values_in_sweep_order():
    trials = sweep.product(sweep.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                           sweep.sweep("trainer.seed", [0, 1]))

    names = sweep.trial_names(trials)

    assert names == ["learning_rate=0.001,seed=0", "learning_rate=0.001,seed=1",
                     "learning_rate=0.0003,seed=0", "learning_rate=0.0003,seed=1"]
    assert sweep.trial_names([{}]) == ["base"]


def test_trial_names_use_the_dotted_key_where_an_earlier_section_owns_the_field_name():
    trials = [{"trainer.seed": 0, "lora.seed": 0, "trainer.steps": 5},
              {"trainer.seed": 1, "lora.seed": 0, "trainer.steps": 5}]

    names = sweep.trial_names(trials)

    assert names == ["seed=0,lora.seed=0,steps=5", "seed=1,lora.seed=0,steps=5"]


def test_a_trial_added_to_a_sweep_renames_none_of_the_others():
    trials = sweep.product(sweep.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                           sweep.sweep("trainer.seed", [0, 1]))

    before = sweep.trial_names(trials)
    after = sweep.trial_names([*trials, {"trainer.learning_rate": 1e-3, "lora.seed": 1}])

    assert after[:4] == before
    assert after[4] == "learning_rate=0.001,lora.seed=1"


def test_numpy_floats_name_and_pass_as_plain_floats():
    np = pytest.importorskip("numpy")
    trials = sweep.sweep("trainer.learning_rate", list(np.logspace(-4, -3, 2)))
    spec = sweep.Sweep(pathlib.Path("s.py"), SMOKE, {"optimizer.b2": np.float64(0.95)},
                       [sweep.Trial(n, t) for n, t in zip(sweep.trial_names(trials), trials)])

    assert [t.name for t in spec.trials] == ["learning_rate=0.0001", "learning_rate=0.001"]
    assert sweep.trial_args(spec, spec.trials[0], pathlib.Path("w"))[4:] == [
        "--config.optimizer.b2=0.95", "--config.trainer.learning_rate=0.0001"]
    assert sweep.format_value((np.float64(0.5), 2)) == "(0.5, 2)"


def test_trial_names_are_filesystem_safe_unique_bounded_and_their_own():
    trials = [{"data.path": "/a/b"}, {"data.path": "_a_b"}, {"data.path": "x" * 400},
              {"reward.names": ("math", "format")}, {"rl.flag": True}]

    names = sweep.trial_names(trials)

    assert names[0].startswith("path=_a_b-") and names[1] == "path=_a_b"
    # A trial's name follows from its overrides alone: adding a trial renames none.
    assert [sweep.trial_names([t])[0] for t in trials] == names
    assert len(set(names)) == len(names)
    assert all("/" not in n and " " not in n and len(n) <= 150 for n in names)
    assert names[3] == "names=math+format" and names[4] == "flag=true"
    assert sweep.trial_names(trials) == names  # deterministic


def test_trial_command_runs_main_py_in_the_trial_workdir_with_fixed_then_trial_overrides(
        tmp_path):
    spec = sweep.Sweep(tmp_path / "s.py", SMOKE, {"trainer.steps": 2},
                       [sweep.Trial("seed=1", {"trainer.seed": 1, "sampler.temperature": 0.5})])

    cmd = sweep.trial_command(spec, spec.trials[0], tmp_path / "w")

    assert cmd == [sys.executable, str(ROOT / "main.py"), "--config", SMOKE, "--workdir",
                   str(tmp_path / "w" / "seed=1"), "--config.trainer.steps=2",
                   "--config.trainer.seed=1", "--config.sampler.temperature=0.5"]


def test_example_sweep_file_is_the_2x2_smoke_sweep():
    spec = sweep.load_sweep(ROOT / "launch" / "sweeps" / "smoke_lr.py")

    assert spec.config == SMOKE
    assert [t.name for t in spec.trials] == [
        "learning_rate=0.001,seed=0", "learning_rate=0.001,seed=1",
        "learning_rate=0.0003,seed=0", "learning_rate=0.0003,seed=1"]


# --- bad sweep files ---------------------------------------------------------------------------


@pytest.mark.parametrize("body, expected", [
    ("def sweep():\n    return [{}]\n", "defines no CONFIG"),
    (f"CONFIG = {SMOKE!r}\n", "defines no sweep"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return {{'trainer.seed': 0}}\n",
     "sweep() returned dict"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return [{{'trainer.seed': 0}}, 3]\n",
     "sweep() item 1: 3 is not a dict"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return []\n", "non-empty list of dicts"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    raise KeyError('lr')\n",
     "sweep() raised KeyError at s.py:4: 'lr'"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return hyper.zip(hyper.sweep('trainer.seed', [0]), "
     f"hyper.sweep('trainer.steps', [1, 2]))\n",
     "sweep(): zipit: the axes have different lengths [1, 2]"),
    ("CONFIG = 'configs/nope.py'\ndef sweep():\n    return [{}]\n", "no such file"),
    ("CONFIG = 'configs/default.py:tiny'\ndef sweep():\n    return [{}]\n",
     "unknown variant 'tiny'"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return [{{'trainer.seed': None}}]\n",
     "trial seed=None: trainer.seed = None: values must be"),
    (f"CONFIG = {SMOKE!r}\ndef sweep():\n    return [{{'trainer.seed': 0}}, "
     f"{{'trainer.seed': 0}}]\n", "the same overrides as an earlier trial"),
    (f"CONFIG = {SMOKE!r}\nFIXED = {{'trainer.seed': 1}}\ndef sweep():\n"
     f"    return [{{'trainer.seed': 0}}]\n", "key 'trainer.seed' is in FIXED too"),
    (f"CONFIG = {SMOKE!r}\nFIXED = {{'trainer.stepz': 1}}\ndef sweep():\n    return [{{}}]\n",
     "FIXED: unknown config key 'trainer.stepz'"),
])
def test_load_sweep_of_a_bad_sweep_file_raises_naming_the_file(tmp_path, body, expected):
    path = _sweep_file(tmp_path, body)

    with pytest.raises(SweepError) as e:
        sweep.load_sweep(path)

    assert str(e.value).startswith(f"{path}: ") and expected in str(e.value), str(e.value)


def test_unknown_key_exits_2_naming_file_trial_and_key_before_launching(tmp_path, fake_main,
                                                                        capsys):
    path = _sweep_file(tmp_path, f"""
    CONFIG = {SMOKE!r}
    def sweep():
        return hyper.product(hyper.sweep("trainer.seed", [0, 1]),
                             hyper.sweep("trainer.lerning_rate", [1e-3]))
    """)

    rc = sweep.main([str(path), "--workdir", str(tmp_path / "w")])

    err = capsys.readouterr().err
    assert rc == 2
    assert (f"error: {path}: trial seed=0,lerning_rate=0.001: unknown config key "
            f"'trainer.lerning_rate'; did you mean 'trainer.learning_rate'?") in err
    assert not (tmp_path / "w").exists()


def test_missing_sweep_file_exits_2_naming_it(tmp_path, meshrl_logger, capsys):
    rc = sweep.main([str(tmp_path / "nope.py"), "--workdir", str(tmp_path / "w")])

    assert rc == 2
    assert f"error: {tmp_path / 'nope.py'}: no such sweep file" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("xmanager") is not None,
                    reason="xmanager is installed: the missing-package message cannot show")
def test_xmanager_launcher_without_xmanager_exits_2_saying_what_to_install(tmp_path, fake_main,
                                                                           capsys):
    path = _sweep_file(tmp_path, LR_SEED)

    rc = sweep.main([str(path), "--workdir", str(tmp_path / "w"), "--launcher", "xmanager"])

    assert rc == 2
    assert "pip install xmanager" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


# --- the local launcher, against the stand-in main.py ------------------------------------------


def test_failing_trials_are_marked_failed_with_their_log_and_the_others_still_finish(
        tmp_path, fake_main, capsys):
    path, workdir = _sweep_file(tmp_path, LR_SEED), tmp_path / "w"

    rc = sweep.main([str(path), "--workdir", str(workdir), "--parallel", "2"])

    out, err = capsys.readouterr()
    assert rc == 1
    status = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:5]}
    assert status == {"learning_rate=0.001,seed=0": "done", "learning_rate=0.001,seed=1": "failed",
                      "learning_rate=0.0003,seed=0": "done",
                      "learning_rate=0.0003,seed=1": "failed"}
    log = workdir / "learning_rate=0.001,seed=1" / sweep_run.LOG
    assert f"failed: learning_rate=0.001,seed=1; the last lines of {log}:" in out
    assert "  | error: trainer.seed = 1: the fake main.py rejects it" in out
    assert "trial learning_rate=0.0003,seed=1: failed (exit code 1)" in err
    with open(workdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["done", "failed", "done", "failed"]
    assert rows[0]["trainer.learning_rate"] == "0.001" and rows[0]["reward_last"] == "0.002"
    assert rows[0]["eval_after.eval/greedy_accuracy"] == "0.5"  # nested, flattened
    assert "staleness_list" not in rows[0]  # lists are no scalars
    assert rows[1]["error"] == "error: trainer.seed = 1: the fake main.py rejects it"
    assert (workdir / "sweep_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_rerun_skips_finished_trials_and_reruns_the_failed_ones(tmp_path, fake_main, capsys):
    path, workdir = _sweep_file(tmp_path, LR_SEED), tmp_path / "w"
    sweep.main([str(path), "--workdir", str(workdir)])
    capsys.readouterr()

    rc = sweep.main([str(path), "--workdir", str(workdir), "--parallel", "3"])

    assert rc == 1
    assert "4 trials, 2 finished, 2 to run" in capsys.readouterr().err
    attempts = {t: (workdir / t / sweep_run.LOG).read_text().count(" sweep: ")
                for t in ("learning_rate=0.001,seed=0", "learning_rate=0.001,seed=1")}
    assert attempts == {"learning_rate=0.001,seed=0": 1, "learning_rate=0.001,seed=1": 2}


def test_trial_workdirs_are_created_private_so_main_py_accepts_them_under_umask_002(
        tmp_path, fake_main):
    from meshrl.utils.workdir import prepare

    path, workdir = _sweep_file(tmp_path, LR_SEED), tmp_path / "w"
    old = os.umask(0o002)  # many distributions' default for users with a group of their own
    try:
        sweep.main([str(path), "--workdir", str(workdir)])
    finally:
        os.umask(old)

    trials = [p for p in workdir.iterdir() if p.is_dir()]
    assert len(trials) == 4
    for trial in trials:
        assert trial.stat().st_mode & 0o777 == 0o700
        prepare(trial)  # what main.py checks first: no WorkdirError


def test_a_finished_trial_whose_fixed_settings_changed_is_an_error_not_a_result(
        tmp_path, fake_main, capsys):
    path, workdir = _sweep_file(tmp_path, LR_SEED), tmp_path / "w"
    sweep.main([str(path), "--workdir", str(workdir)])
    path.write_text(path.read_text() + "FIXED = {'trainer.steps': 50}\n")
    capsys.readouterr()

    rc = sweep.main([str(path), "--workdir", str(workdir)])

    err = capsys.readouterr().err
    assert rc == 2
    assert (f"error: trial learning_rate=0.001,seed=0 finished with other settings (overrides "
            f"(none) -> --config.trainer.steps=50) than {path}") in err
