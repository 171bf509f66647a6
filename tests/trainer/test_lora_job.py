"""The RL smoke job with LoRA on an nf4 base, end to end in a subprocess (``main.py``)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_rl_job_with_qlora_publishes_merged_weights_and_exports_only_versions(
        tmp_path):
    import orbax.checkpoint as ocp

    from meshrl.utils.params import flat_params

    workdir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "main.py"), "--config",
           str(ROOT / "configs/default.py:smoke"), f"--workdir={workdir}",
           "--config.lora.rank=4", "--config.lora.base_dtype=nf4"]
    out = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 4
    weights = flat_params(ocp.StandardCheckpointer().restore(workdir / "weights" / "4"))
    assert "embed" in weights and "layers/0/attn/q/kernel" in weights  # merged, full

    # The checkpoint holds adapters only: exporting it is one error line; a version exports.
    export = [*cmd, "--config.job=export", f"--config.export.path={tmp_path / 'hf'}"]
    out = subprocess.run(export, cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "holds LoRA adapters (lora.rank = 4)" in out.stderr and not (tmp_path / "hf").exists()
    out = subprocess.run([*export, "--config.export.version=4"], cwd=ROOT, env=cpu_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_lora_regex_matching_nothing_stops_the_job_with_one_error_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "main.py"), "--config",
           str(ROOT / "configs/default.py:smoke"), f"--workdir={tmp_path / 'run'}",
           "--config.lora.rank=4", "--config.lora.targets=nothing_here"]
    out = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "lora.targets = 'nothing_here': matches no projection" in out.stderr
    assert "Traceback" not in out.stderr
