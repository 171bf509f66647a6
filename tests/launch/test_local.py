"""launch/local.py: N JAX processes on this machine. Two processes x 4 fake devices train SFT
(data=4 x tensor=2; also with FSDP and with HSDP) with one process x 8 devices' losses and final
params (every leaf of the runs' last checkpoints); a failing process stops the others (no
orphans) and the launcher exits with its code; output lines carry their process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from meshrl.tests.trees import assert_trees_close, final_params
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]
pytestmark = pytest.mark.distributed

# SGD: Adam's first steps are ~lr * sign(g) and would turn the two runs' last-bit differences
# (gloo's all-reduce order against the in-process one) into lr-sized jumps. Rows are packed: each
# global batch row has its own example sub-stream, so the batch is the same for any process count.
SFT = ["main.py", "--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
       "--config.trainer.steps=3",
       "--config.trainer.eval_every=0", "--config.optimizer.name=sgd",
       "--config.trainer.learning_rate=0.5", "--config.optimizer.weight_decay=0.0",
       "--config.logging.progress_bar=false"]


def _env(devices: int) -> dict[str, str]:
    return cpu_env(devices)


def _losses(workdir: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


MESHES = {
    "data4_tensor2": ["--config.mesh.data=4", "--config.mesh.tensor=2"],
    "fsdp": ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.mesh.fsdp=true"],
    # HSDP: params sharded over data=2 within each process, replicated across the 2 processes.
    "hsdp": ["--config.mesh.data=2", "--config.mesh.dcn_data=2", "--config.mesh.tensor=2",
             "--config.mesh.fsdp=true"],
}


@pytest.mark.parametrize("mesh", [pytest.param("data4_tensor2", marks=pytest.mark.slow),
                                  pytest.param("fsdp", marks=pytest.mark.slow),
                                  pytest.param("hsdp", marks=pytest.mark.slow)])
def test_two_processes_train_sft_like_one_process_of_eight_devices(tmp_path, mesh):
    extra = MESHES[mesh]
    multi = subprocess.run([*LAUNCH, "--num_processes", "2", "--devices_per_process", "4", "--",
                            *SFT, "--workdir", str(tmp_path / "multi"), *extra], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    single = subprocess.run([sys.executable, *SFT, "--workdir", str(tmp_path / "single"),
                             *extra], cwd=ROOT, env=_env(8), capture_output=True, text=True,
                            timeout=300)

    assert multi.returncode == 0, multi.stdout[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    a = json.loads((tmp_path / "multi" / "summary.json").read_text())
    b = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert (a["processes"], a["devices"], b["processes"], b["devices"]) == (2, 8, 1, 8)
    # Each process builds the whole held-out set; it is counted once, not once per process.
    held_out = {k: v for k, v in b.items() if k.startswith("eval_")}
    assert held_out["eval_sequences"] > 0
    np.testing.assert_allclose([a[k] for k in held_out], list(held_out.values()), rtol=1e-5)
    np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(tmp_path / "single"),
                               rtol=1e-5)
    # gloo's all-reduce adds in another order than one process: last-bit differences, ~1e-8
    # absolute after three steps; atol covers the entries near 0 that rtol cannot.
    assert_trees_close(final_params(tmp_path / "multi"), final_params(tmp_path / "single"),
                       rtol=1e-5, atol=1e-6)
    lines = multi.stdout.splitlines()
    assert any(line.startswith("[p0] ") for line in lines)
    assert any(line.startswith("[p1] ") for line in lines)


def test_a_failing_process_stops_the_others_and_the_launcher_exits_with_its_code(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    # Process 1 fails at once; process 0 would run for a minute.
    script = ("import os, sys, time, pathlib; pid = [a for a in sys.argv if 'process_id=' in a]"
              "[0].split('=')[1]; pathlib.Path(sys.argv[1], pid).write_text(str(os.getpid()));"
              "print('started', flush=True); time.sleep(0.5 if pid == '1' else 60);"
              "sys.exit(3)")

    t0 = time.monotonic()
    out = subprocess.run([*LAUNCH, "--num_processes", "2", "--", "-c", script, str(pids)],
                         capture_output=True, text=True, timeout=60)

    assert out.returncode == 3, out.stdout + out.stderr
    assert time.monotonic() - t0 < 30
    assert "[p0] started" in out.stdout and "[p1] started" in out.stdout
    for f in pids.iterdir():  # no orphan: every process of the job is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def test_bad_sizes_are_an_error_naming_both():
    out = subprocess.run([*LAUNCH, "--num_processes", "0", "--", "main.py"],
                         capture_output=True, text=True, timeout=30)

    assert out.returncode == 2
    assert "--num_processes = 0 and --devices_per_process = 4: both must be >= 1" in out.stderr
