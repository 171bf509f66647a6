"""A config file that defines ``get_sweep(hyper)`` (big_vision) or ``get_hyper(hyper)``
(scenic) is a sweep of itself: ``launch/sweep.py configs/x.py[:arg]``. A malformed sweep gets
one ``error:`` line naming the file and the rule, exit code 2, and no traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from meshrl.launch import sweep, sweep_trials

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Stands in for main.py: records its arguments and finishes.
FAKE_MAIN = '''
import json, pathlib, sys
args = sys.argv[1:]
workdir = pathlib.Path(args[args.index("--workdir") + 1])
workdir.mkdir(parents=True, exist_ok=True)
(workdir / "args.json").write_text(json.dumps(args))
(workdir / "summary.json").write_text(json.dumps({"final_loss": 1.0}))
'''
# A config file of its own: default.py's configs, and a sweep of them.
CONFIG_HEAD = """
from meshrl.configs import default
def get_config(arg=None):
    return default.get_config(arg)
"""


@pytest.fixture
def fake_main(tmp_path, monkeypatch, meshrl_logger):
    path = tmp_path / "fake_main.py"
    path.write_text(FAKE_MAIN)
    monkeypatch.setattr(sweep_trials, "MAIN", path)


def _file(tmp_path: pathlib.Path, body: str, head: str = CONFIG_HEAD) -> pathlib.Path:
    path = tmp_path / "c.py"
    path.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    return path


@pytest.mark.parametrize("function", ["get_sweep", "get_hyper"])
def test_config_file_with_its_own_sweep_runs_each_trial_on_itself(tmp_path, fake_main,
                                                                  function, capsys):
    import json

    path = _file(tmp_path, f"""
    def {function}(hyper):
        return hyper.product([hyper.sweep("config.trainer.seed", [0, 1]),
                              hyper.fixed("trainer.steps", 2)])
    """)

    rc = sweep.main([f"{path}:smoke", "--workdir", str(tmp_path / "w")])

    assert rc == 0, capsys.readouterr().err
    for seed in (0, 1):
        args = json.loads((tmp_path / "w" / f"seed={seed},steps=2" / "args.json").read_text())
        assert args[:2] == ["--config", f"{path}:smoke"]
        assert args[-2:] == [f"--config.trainer.seed={seed}", "--config.trainer.steps=2"]


def test_vocabulary_imported_into_a_config_file_is_no_sweep_function(tmp_path, fake_main):
    path = _file(tmp_path, """
    from meshrl.launch.sweep import product, sweep
    def get_sweep(hyper):
        return product([sweep("trainer.seed", [3])])
    """)

    assert [t.name for t in sweep.load_sweep(path).trials] == ["seed=3"]


@pytest.mark.parametrize("body, expected", [
    ("def get_sweep(hyper):\n    return {'trainer.seed': 0}\n",
     "get_sweep(hyper) returned dict {'trainer.seed': 0}: it must return a non-empty list"),
    ("def get_sweep(hyper):\n    return [{'trainer.seed': 0}, 3]\n",
     "get_sweep(hyper) item 1: 3 is not a dict"),
    ("def get_hyper(hyper):\n    return hyper.product([hyper.sweep('trainer.sed', [0, 1])])\n",
     "trial sed=0: unknown config key 'trainer.sed'; did you mean 'trainer.seed'?"),
    ("def get_sweep(hyper):\n    return hyper.product([hyper.sweep('trainer.seed', 3)])\n",
     "get_sweep(hyper): sweep('trainer.seed', 3): values must be a non-empty list"),
    ("def get_sweep(hyper):\n    return hyper.product([hyper.sweep('trainer.seed', [0]), 1])\n",
     "get_sweep(hyper): product: axis 1 = 1: each axis must be a list of dicts"),
    ("def get_sweep(hyper):\n    return [{'trainer.seed': 1 / 0}]\n",
     "get_sweep(hyper) raised ZeroDivisionError at c.py:6: division by zero"),
    ("def get_sweep():\n    return [{}]\n", "get_sweep(hyper) raised TypeError"),
    ("def get_sweep(hyper):\n    return [{}]\nget_hyper = get_sweep\n",
     "defines get_sweep and get_hyper: define one"),
    ("", "defines no sweep function: define one; a sweep file sets CONFIG"),
    ("undefined_name\ndef get_sweep(hyper):\n    return [{}]\n",
     "importing it raised NameError at c.py:5: name 'undefined_name' is not defined"),
])
def test_malformed_config_file_sweep_exits_2_with_one_error_line(tmp_path, fake_main, capsys,
                                                                 body, expected):
    path = _file(tmp_path, body)

    rc = sweep.main([f"{path}:smoke", "--workdir", str(tmp_path / "w")])

    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {path}") and expected in err, err
    assert err.count("\n") == 1 and not (tmp_path / "w").exists()


@pytest.mark.parametrize("spec, head, expected", [
    (":tiny", CONFIG_HEAD, "unknown variant 'tiny'"),
    ("", "def get_config(arg=None):\n    return {}['model']\n",
     "loading it raised KeyError at c.py:2: 'model'"),
    ("", "", "defines no CONFIG and no get_config"),
    (":smoke", "CONFIG = 'configs/default.py'\n", "a sweep file with CONFIG takes no ':smoke'"),
])
def test_config_file_sweep_with_a_bad_base_config_exits_2_naming_it(tmp_path, fake_main, capsys,
                                                                    spec, head, expected):
    path = _file(tmp_path, "def get_sweep(hyper):\n    return [{}]\n", head=head)

    rc = sweep.main([f"{path}{spec}", "--workdir", str(tmp_path / "w")])

    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {path}") and expected in err, err


def test_sweep_py_script_on_a_raising_sweep_file_prints_no_traceback(tmp_path):
    path = _file(tmp_path, "def get_sweep(hyper):\n    raise RuntimeError('no GPUs here')\n")

    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), f"{path}:smoke",
                           "--workdir", str(tmp_path / "w")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)

    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: {path}: get_sweep(hyper) raised RuntimeError at c.py:6: "
                           f"no GPUs here\n")
