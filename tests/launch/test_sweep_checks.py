"""A sweep checks each trial's whole config before it starts any, and a trial counts as
finished only when it wrote its summary and exited with 0; a trial started under other
settings is never resumed under these. Against a stand-in for main.py, without JAX."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from meshrl.launch import sweep, sweep_run
from meshrl.launch.recipes.common import RecipeError
from meshrl.launch.recipes.render import parse_pairs
from meshrl.launch.sweep import SweepError
from meshrl.tests.launch.fake_main import HEAD, install

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = f"{ROOT / 'configs' / 'default.py'}:smoke"
# main.py's stand-in: seed 1 fails before writing anything; seed 2 writes its summary, then
# crashes on its first attempt (as in a shutdown); the others finish.
FAKE_MAIN = HEAD + '''
import os
if over["trainer.seed"] == "1":
    sys.exit("error: the fake main.py rejects seed 1")
(workdir / "summary.json").write_text(json.dumps({"accuracy_after": 0.5}))
if over["trainer.seed"] == "2" and not (workdir / "crashed").exists():
    (workdir / "crashed").touch()
    os._exit(139)
'''


@pytest.fixture
def fake_main(tmp_path, monkeypatch, meshrl_logger):
    return install(tmp_path, monkeypatch, FAKE_MAIN)


def _sweep_file(tmp_path: pathlib.Path, seeds: list[int], fixed: str = "") -> pathlib.Path:
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent(f"""
        from meshrl.launch import sweep as hyper
        CONFIG = {SMOKE!r}
        {fixed}
        def sweep():
            return hyper.sweep("trainer.seed", {seeds!r})
        """))
    return path


def _run(path: pathlib.Path, workdir: pathlib.Path) -> int:
    return sweep.main([str(path), "--workdir", str(workdir)])


def test_a_trial_that_wrote_its_summary_then_crashed_is_failed_and_runs_again(
        tmp_path, fake_main, capsys):
    path, workdir = _sweep_file(tmp_path, [2]), tmp_path / "w"

    assert _run(path, workdir) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["seed=2", "failed"]

    assert _run(path, workdir) == 0
    assert "1 trials, 0 finished, 1 to run" in capsys.readouterr().err
    assert sweep.is_finished(workdir, sweep.load_sweep(path).trials[0])


def test_a_started_trial_whose_settings_changed_is_refused_not_resumed(tmp_path, fake_main,
                                                                      capsys):
    path, workdir = _sweep_file(tmp_path, [1]), tmp_path / "w"
    _run(path, workdir)  # seed 1 fails: a trial directory, no summary
    path.write_text(path.read_text() + "FIXED = {'trainer.steps': 50}\n")
    capsys.readouterr()

    rc = _run(path, workdir)

    assert rc == 2
    assert ("error: trial seed=1 started with other settings (overrides (none) -> "
            "--config.trainer.steps=50)") in capsys.readouterr().err
    assert (workdir / "seed=1" / sweep_run.LOG).read_text().count(" sweep: ") == 1


def test_fixed_overrides_in_another_order_are_the_same_settings(tmp_path, fake_main, capsys):
    first = "FIXED = {'trainer.steps': 5, 'optimizer.b2': 0.95}"
    path, workdir = _sweep_file(tmp_path, [0], first), tmp_path / "w"
    assert _run(path, workdir) == 0
    _sweep_file(tmp_path, [0], "FIXED = {'optimizer.b2': 0.95, 'trainer.steps': 5}")
    capsys.readouterr()

    assert _run(path, workdir) == 0
    assert "1 trials, 1 finished, 0 to run" in capsys.readouterr().err


@pytest.mark.parametrize("fixed, expected", [
    ("FIXED = {'trainer.steps': 2.5}",
     "flag --config.trainer.steps=2.5: invalid literal for int()"),
    ("FIXED = {'trainer.steps': -3}", "trainer.steps = -3: must be >= 0"),
    ("FIXED = {'job': 'generate', 'generate.source': 'random'}", "job = 'generate': a sweep runs sft, rl, dpo"),
])
def test_a_value_main_py_would_refuse_exits_2_before_any_trial_starts(tmp_path, fake_main,
                                                                      capsys, fixed, expected):
    path = _sweep_file(tmp_path, [0, 3], fixed)

    rc = _run(path, tmp_path / "w")

    err = capsys.readouterr().err
    assert rc == 2
    assert f"error: {path}: trial seed=0: " in err and expected in err, err
    assert not (tmp_path / "w").exists()


def test_keys_may_name_the_config_flag_in_fixed_and_in_trial_dicts(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(f"CONFIG = {SMOKE!r}\nFIXED = {{'config.trainer.steps': 2}}\n"
                    f"def sweep():\n    return [{{'config.trainer.seed': 0}}]\n")

    spec = sweep.load_sweep(path)

    assert spec.fixed == {"trainer.steps": 2}
    assert [(t.name, t.overrides) for t in spec.trials] == [("seed=0", {"trainer.seed": 0})]


def test_a_key_given_with_and_without_the_prefix_is_refused(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(f"CONFIG = {SMOKE!r}\ndef sweep():\n"
                    f"    return [{{'config.trainer.seed': 0, 'trainer.seed': 1}}]\n")

    with pytest.raises(SweepError, match="names a key twice"):
        sweep.load_sweep(path)


def test_trials_that_run_the_same_command_are_refused(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(f"CONFIG = {SMOKE!r}\ndef sweep():\n"
                    f"    return [{{'rl.pack_sequences': True}}, "
                    f"{{'rl.pack_sequences': 'true'}}]\n")

    with pytest.raises(SweepError, match="the same overrides as an earlier trial"):
        sweep.load_sweep(path)


@pytest.mark.parametrize("signal_as", [KeyboardInterrupt, sweep._Terminated])
def test_a_stop_while_the_sweep_file_loads_exits_without_a_traceback(
        tmp_path, monkeypatch, meshrl_logger, capsys, signal_as):
    def stopped(file):
        raise signal_as()

    monkeypatch.setattr(sweep, "load_sweep", stopped)

    rc = _run(tmp_path / "s.py", tmp_path / "w")

    assert rc == (130 if signal_as is KeyboardInterrupt else 143)
    assert "sweep stopped before any trial started" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_recipe_key_given_twice_is_refused():
    with pytest.raises(RecipeError, match="'data' is given twice"):
        parse_pairs("mesh", "data=2,tensor=4,data=1", int)
