"""The RL smoke job with LoRA on an nf4 base, end to end in a subprocess (``main.py``)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_rl_job_with_qlora_publishes_merged_weights_and_exports_merged_models(
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

    # The checkpoint's adapters merge into the warm start they adapt: the same tensors as
    # the version the run published at that step. A PEFT export of that base is one line.
    from safetensors.numpy import load_file

    export = [*cmd, "--config.job=export"]
    for name, extra in (("ckpt", []), ("v4", ["--config.export.version=4"])):
        out = subprocess.run([*export, f"--config.export.path={tmp_path / name}", *extra],
                             cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-4000:]
    ckpt, v4 = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("ckpt", "v4"))
    assert sorted(ckpt) == sorted(v4)
    for name, tensor in v4.items():
        np.testing.assert_allclose(ckpt[name], tensor, rtol=1e-6, atol=1e-6, err_msg=name)
    out = subprocess.run([*export, f"--config.export.path={tmp_path / 'peft'}",
                          "--config.export.format=peft"], cwd=ROOT, env=cpu_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "adapt the SFT warm start's checkpoint step" in out.stderr
    assert not (tmp_path / "peft").exists()


def test_a_lora_regex_matching_nothing_stops_the_job_with_one_error_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "main.py"), "--config",
           str(ROOT / "configs/default.py:smoke"), f"--workdir={tmp_path / 'run'}",
           "--config.lora.rank=4", "--config.lora.targets=nothing_here"]
    out = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "lora.targets = 'nothing_here': matches no projection" in out.stderr
    assert "Traceback" not in out.stderr
