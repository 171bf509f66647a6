"""RL on 2 processes: each process samples its share of the groups on its own devices, the
trainer steps on all of them with one agreed batch shape; both end with the same params, the
staleness bound holds, and on the default config accuracy rises (slow)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py"), "--num_processes", "2"]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 50 s and 6 min on 2 CPU cores


def _rl(workdir: pathlib.Path, variant: str, devices: int, *extra: str) -> dict:
    out = subprocess.run([*LAUNCH, "--devices_per_process", str(devices), "--", "main.py",
                          "--config", f"{ROOT / 'configs' / 'default.py'}{variant}",
                          "--workdir", str(workdir), "--config.logging.progress_bar=false",
                          *extra], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:]
    sums = dict(re.findall(r"^\[(p\d)\] .* params_checksum (\S+)$", out.stdout, re.M))
    assert set(sums) == {"p0", "p1"} and sums["p0"] == sums["p1"], sums
    return json.loads((workdir / "summary.json").read_text())


def test_smoke_rl_on_two_processes_ends_with_equal_params_within_the_staleness_bound(
        tmp_path):
    summary = _rl(tmp_path, ":smoke", 2, "--config.mesh.data=4",
                  "--config.distributed.step_timeout_s=300")

    assert summary["processes"] == 2 and summary["devices"] == 4
    assert summary["sampler_devices"] == 2  # each process samples on its own two devices
    assert summary["max_staleness_seen"] <= summary["max_staleness"]
    assert sorted(int(p.name) for p in (tmp_path / "weights").iterdir()) == [2, 4]


def test_default_rl_on_two_processes_raises_held_out_accuracy(tmp_path):
    summary = _rl(tmp_path, "", 1)

    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05, summary
