"""The sweeps the docs show, run as written: README's sweep recipe (its bash block, read from
README.md) through the real main.py, and docs/sweeps.md's config-file example; plus one fast
end-to-end sweep of a config file's ``get_sweep`` through the script and the real main.py."""

from __future__ import annotations

import csv
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from meshrl.launch import sweep_load
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_sweep_commands() -> list[list[str]]:
    """The commands of README's ``<!-- recipe: sweep -->`` bash block, split into arguments."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- recipe: sweep -->\n```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no '<!-- recipe: sweep -->' bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(ln) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    assert cmd[0] == "python", cmd
    return subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, cwd=ROOT,
                          env=cpu_env(), timeout=500)


@pytest.mark.slow  # four smoke RL runs of main.py, about a minute on 2 CPU cores
def test_readme_sweep_recipe_runs_as_written_and_its_rerun_runs_nothing(tmp_path):
    commands = readme_sweep_commands()
    assert commands, "README's sweep block has no command"

    for cmd in commands:
        cmd = [a.replace("/tmp/", f"{tmp_path}/") for a in cmd]  # the recipe's workdir
        first = _run(cmd)
        again = _run(cmd)

        assert first.returncode == 0, shlex.join(cmd) + "\n" + first.stderr[-4000:]
        statuses = [ln.split()[1] for ln in first.stdout.splitlines()[1:] if "=" in ln.split()[0]]
        assert statuses and set(statuses) == {"done"}, first.stdout
        assert again.returncode == 0 and ", 0 to run" in again.stderr, again.stderr[-4000:]


def docs_config_example() -> str:
    """The ``my_config.py`` of docs/sweeps.md."""
    text = (ROOT / "docs" / "sweeps.md").read_text()
    block = re.search(r"```python\n# my_config.py\n(.*?)```", text, re.S)
    assert block, "docs/sweeps.md has no '# my_config.py' python block"
    return block.group(1)


def test_docs_config_file_example_loads_as_a_four_trial_sweep_of_itself(tmp_path):
    path = tmp_path / "my_config.py"
    path.write_text(docs_config_example())

    spec = sweep_load.load_sweep(f"{path}:smoke")

    assert spec.config == f"{path}:smoke"
    assert [t.name for t in spec.trials] == [
        "learning_rate=0.001,seed=0,temperature=0.7", "learning_rate=0.001,seed=1,temperature=1.0",
        "learning_rate=0.0003,seed=0,temperature=0.7",
        "learning_rate=0.0003,seed=1,temperature=1.0"]


# A one-step SFT smoke run: the cheapest real main.py job.
ONE_TRIAL = """
from meshrl.configs import sft_synthetic

def get_config(arg=None):
    return sft_synthetic.get_config(arg)

def get_sweep(hyper):
    return hyper.product([hyper.sweep("trainer.seed", [3]), hyper.fixed("trainer.steps", 1)])
"""


@pytest.mark.slow  # runs main.py per trial; test_sweep_e2e stays
def test_get_sweep_config_file_sweeps_through_the_script_and_the_real_main_py(tmp_path):
    path, workdir = tmp_path / "one.py", tmp_path / "w"
    path.write_text(textwrap.dedent(ONE_TRIAL))

    proc = _run(["python", "launch/sweep.py", f"{path}:smoke", "--workdir", str(workdir)])

    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines()[1].split()[:2] == ["seed=3,steps=1", "done"]
    with open(workdir / "results.csv") as f:
        [row] = list(csv.DictReader(f))
    assert row["status"] == "done" and row["trainer.seed"] == "3" and row["steps"] == "1", row
