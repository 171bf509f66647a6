"""Context parallelism in the train step: a sharded-sequence SFT step gives one device's loss,
gradients and params (both strategies), and a real SFT run at seq 4,096 completes on 8 fake CPU
devices with context = 4."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meshrl.tests.trainer.test_step import (
    _sgd,
    _single_device_reference,
    _train,
    _two_batches,
)
from meshrl.tests.trees import assert_trees_close
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", [pytest.param("all_gather", marks=pytest.mark.slow), "ring"])
def test_context4_data2_step_matches_one_device(strategy):
    ref_state, ref_hist = _single_device_reference()

    state, hist = _train(_sgd(**{"mesh.data": 2, "mesh.context": 4,
                                 "model.context_attention": strategy}), _two_batches())

    for r, s in zip(ref_hist, hist, strict=True):
        np.testing.assert_allclose(s["loss"], r["loss"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(s["grad_norm"], r["grad_norm"], rtol=1e-5, atol=1e-7)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~1 minute: 4,096-token sequences through main.py on 8 fake devices
def test_sft_run_at_seq_4096_with_context4_completes_on_8_fake_devices(tmp_path):
    env = cpu_env(8)
    overrides = ["--config.mesh.data=2", "--config.mesh.context=4",
                 "--config.model.context_attention=ring", "--config.trainer.seq_len=4096",
                 "--config.trainer.batch_size=2", "--config.trainer.steps=2",
                 "--config.trainer.eval_every=0", "--config.checkpoint.every_steps=0",
                 "--config.logging.progress_bar=false"]
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
                          "--workdir", str(tmp_path), *overrides],
                         capture_output=True, text=True, env=env, timeout=600)

    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["devices"] == 8
    assert np.isfinite(summary["final_loss"])
