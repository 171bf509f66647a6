"""A checkpoint written by 2 processes resumes in 1 process on another mesh, and one written by
1 process resumes in 2, with the data iterator's state: the resumed losses and final params
equal an uninterrupted run's (packed SFT, constant learning rate, SGD)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meshrl.tests.trees import assert_trees_close, final_params
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]
pytestmark = pytest.mark.distributed

# SGD at a constant rate: a run cut at step 3 and resumed to 6 follows the same schedule as one
# run to 6, and Adam's sign-like first steps would amplify last-bit reduction differences.
SFT = ["main.py", "--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
       "--config.trainer.eval_every=0", "--config.optimizer.name=sgd",
       "--config.optimizer.schedule=constant", "--config.optimizer.warmup_steps=0",
       "--config.trainer.learning_rate=0.5", "--config.optimizer.weight_decay=0.0",
       "--config.logging.progress_bar=false", "--config.checkpoint.async_save=false"]
TWO_PROCS = ["--config.mesh.data=2", "--config.mesh.tensor=2"]  # 2 processes x 2 devices
ONE_PROC = ["--config.mesh.data=4", "--config.mesh.tensor=1"]  # 1 process x 4 devices


def _single(workdir: pathlib.Path, steps: int, mesh: list[str]) -> None:
    env = cpu_env(4)
    out = subprocess.run([sys.executable, *SFT, *mesh, f"--config.trainer.steps={steps}",
                          "--workdir", str(workdir)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def _multi(workdir: pathlib.Path, steps: int) -> None:
    out = subprocess.run([*LAUNCH, "--num_processes", "2", "--devices_per_process", "2", "--",
                          *SFT, *TWO_PROCS, f"--config.trainer.steps={steps}",
                          "--workdir", str(workdir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]


def _result(workdir: pathlib.Path) -> tuple[dict[int, float], dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((workdir / "summary.json").read_text())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, summary


def _assert_same_run(resumed: pathlib.Path, reference: pathlib.Path) -> None:
    (losses, summary), (want, _) = _result(resumed), _result(reference)
    assert summary["start_step"] == 3 and sorted(losses) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([losses[s] for s in range(1, 7)],
                               [want[s] for s in range(1, 7)], rtol=1e-5)
    assert_trees_close(final_params(resumed), final_params(reference), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("reference")
    _single(workdir, 6, ONE_PROC)
    return workdir


@pytest.mark.slow  # ~55 s: three SFT runs; the default run's multi-process test is test_local's
# failing-process one (its training equivalence runs are slow too)
def test_two_process_checkpoint_resumes_in_one_process_on_another_mesh(tmp_path, reference):
    _multi(tmp_path, 3)
    _single(tmp_path, 6, ONE_PROC)
    _assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_in_two_processes(tmp_path, reference):
    _single(tmp_path, 3, ONE_PROC)
    _multi(tmp_path, 6)
    _assert_same_run(tmp_path, reference)
    assert json.loads((tmp_path / "summary.json").read_text())["processes"] == 2


@pytest.mark.slow
def test_export_on_two_processes_of_params_sharded_across_them_equals_one_process(
        tmp_path, reference):
    export = ["main.py", "--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
              "--config.job=export", "--workdir", str(reference)]
    multi = subprocess.run([*LAUNCH, "--num_processes", "2", "--devices_per_process", "2", "--",
                            *export, "--config.mesh.data=4", "--config.mesh.fsdp=true",
                            f"--config.export.path={tmp_path / 'multi'}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert multi.returncode == 0, multi.stdout[-3000:]
    env = cpu_env(4)
    single = subprocess.run([sys.executable, *export, f"--config.export.path={tmp_path / 'one'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "multi" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
