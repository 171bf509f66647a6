"""main.py: dry run prints the mesh; bad mesh sizes and typos exit non-zero with clear text."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = cpu_env(8)


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "main.py"),
                           "--config", str(ROOT / "configs" / "default.py"), *args],
                          capture_output=True, text=True, env=ENV, timeout=300)


def test_dry_run_exits_zero_and_prints_all_five_axes():
    out = _main("--dry_run")
    assert out.returncode == 0, out.stderr
    assert "data=8, tensor=1, context=1, expert=1, expert_tensor=1" in out.stdout
    assert "trainer.learning_rate = " in out.stdout
    assert "# logical -> physical rules: sample" in out.stdout


def test_dry_run_applies_overrides():
    out = _main("--dry_run", "--config.mesh.data=2", "--config.mesh.tensor=4",
                "--config.mesh.fsdp=true")
    assert out.returncode == 0, out.stderr
    assert "data=2, tensor=4" in out.stdout
    assert "rules: train (fsdp)" in out.stdout


def test_dry_run_of_a_split_rl_job_prints_the_trainer_and_the_sampler_mesh():
    out = _main("--dry_run", "--config.rl.placement=split", "--config.rl.sampler_devices=2",
                "--config.mesh.data=3", "--config.mesh.tensor=2")
    assert out.returncode == 0, out.stderr
    assert "# mesh (6 devices" in out.stdout and "data=3, tensor=2" in out.stdout
    assert "# sampler mesh (rl.placement = split, 2 devices)" in out.stdout
    assert "data=1, tensor=2" in out.stdout


@pytest.mark.parametrize("args, expected", [
    (("--config.mesh.data=3",), "but 8 devices are available"),
    (("--config.rl.placement=split", "--config.rl.sampler_devices=2", "--config.mesh.data=4"),
     "rl.sampler_devices = 2 leaves 6 of the 8 devices to the trainer"),
    (("--config.trainer.lerning_rate=1e-4",), "did you mean 'trainer.learning_rate'"),
    (("--config.model.num_kv_heads=3",), "model.num_kv_heads = 3: must divide"),
])
def test_bad_config_exits_nonzero_with_message(args, expected):
    out = _main("--dry_run", *args)
    assert out.returncode != 0
    assert expected in out.stderr
    assert "Traceback" not in out.stderr


def test_deprecated_sample_job_and_section_still_run_with_one_warning_each():
    out = _main("--dry_run", "--config.job=sample", "--config.sample.source=random")
    assert out.returncode == 0, out.stderr
    assert "job = generate" in out.stdout and "generate.source = 'random'" in out.stdout
    assert "job = sample is deprecated" in out.stderr
    assert "sample.source is deprecated" in out.stderr and "use generate.source" in out.stderr


def test_an_empty_workdir_exits_with_one_error_line_not_the_default_workdir():
    out = _main("--workdir=")  # an unset $VAR in a script
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: --workdir = '': empty")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("body, arg, expected", [
    ("def sweep():\n    return []\n", "", "AttributeError"),  # a sweep file given as --config
    ("def get_config():\n    return {}\n", ":smoke", "TypeError"),
])
def test_a_file_that_is_no_config_file_exits_with_one_error_line(tmp_path, body, arg, expected):
    path = tmp_path / "not_a_config.py"
    path.write_text(body)
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", f"{path}{arg}"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --config = '{path}{arg}': loading it raised {expected}")
    assert "defines get_config(arg)" in last and "Traceback" not in out.stderr


def test_an_override_of_the_wrong_type_is_one_error_line_not_absls_fatal():
    out = _main("--dry_run", "--config.trainer.steps=abc")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "error: flag --config.trainer.steps=abc: invalid literal for int() with base 10: 'abc'")
    assert "FATAL" not in out.stderr and "Traceback" not in out.stderr
