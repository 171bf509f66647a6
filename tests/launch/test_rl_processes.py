"""RL on 2 processes: each process samples its share of the groups on its own devices, the
trainer steps on all of them with one agreed batch shape; both end with the same params (every
replica of every param block on both processes, bitwise), the staleness bound holds, and on the
default config accuracy rises (slow)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meshrl.tests.launch.shards_main import ENV, Blocks, load_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py"), "--num_processes", "2"]
SHARDS_MAIN = str(ROOT / "tests" / "launch" / "shards_main.py")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 50 s and 6 min on 2 CPU cores


def _rl(workdir: pathlib.Path, variant: str, devices: int, *extra: str) -> dict:
    shards = workdir / "shards"
    out = subprocess.run([*LAUNCH, "--devices_per_process", str(devices), "--", SHARDS_MAIN,
                          "--config", f"{ROOT / 'configs' / 'default.py'}{variant}",
                          "--workdir", str(workdir), "--config.logging.progress_bar=false",
                          *extra], cwd=ROOT, env={**os.environ, ENV: str(shards)},
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:]
    _assert_replicas_equal(load_blocks(shards))
    return json.loads((workdir / "summary.json").read_text())


def _assert_replicas_equal(processes: dict[str, Blocks]) -> None:
    """Both processes hold every param, and every copy of a block (on any device of either
    process) is bitwise the same."""
    assert sorted(processes) == ["p0", "p1"], sorted(processes)
    p0, p1 = processes["p0"], processes["p1"]
    assert {path for path, _ in p0} == {path for path, _ in p1}
    shared = set(p0) & set(p1)
    assert shared, "no param block is held by both processes: nothing to compare"
    for block in sorted(set(p0) | set(p1)):
        first, *rest = p0.get(block, []) + p1.get(block, [])
        for copy in rest:
            np.testing.assert_array_equal(copy, first, err_msg=f"block {block}", strict=True)


def test_smoke_rl_on_two_processes_ends_with_equal_params_within_the_staleness_bound(
        tmp_path):
    summary = _rl(tmp_path, ":smoke", 2, "--config.mesh.data=4",
                  "--config.distributed.step_timeout_s=300")

    assert summary["processes"] == 2 and summary["devices"] == 4
    assert summary["sampler_devices"] == 2  # each process samples on its own two devices
    assert summary["max_staleness_seen"] <= summary["max_staleness"]
    assert sorted(int(p.name) for p in (tmp_path / "weights").iterdir()) == [2, 4]
    # Rates count both processes' samples: every sample of every step over the RL wall time.
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "perf/samples_per_s" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    per_step = {round(r["perf/samples_per_s"] * r["perf/step_time_s"]) for r in steps.values()}
    assert per_step == {4 * 4}, per_step  # prompts_per_step x group_size, both processes'
    assert summary["samples_per_s"] * summary["rl_wall_s"] == pytest.approx(4 * 16, rel=1e-6)


def test_default_rl_on_two_processes_raises_held_out_accuracy(tmp_path):
    summary = _rl(tmp_path, "", 1)

    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05, summary
