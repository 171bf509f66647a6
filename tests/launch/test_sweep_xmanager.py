"""launch/sweep.py's XManager jobs, built without launching them. xmanager is optional (it pins
protobuf < 7, meshrl pins 7), so this runs only where it is installed."""

from __future__ import annotations

import pathlib
import sys

import pytest

from meshrl.launch import sweep, sweep_run

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_xmanager_jobs_are_one_local_job_per_trial_with_the_local_command_line(tmp_path):
    pytest.importorskip("xmanager", reason="xmanager is optional: pip install xmanager "
                                           "(needs protobuf < 7; not in the test extra)")
    from xmanager import xm, xm_local

    spec = sweep.load_sweep(ROOT / "launch" / "sweeps" / "smoke_lr.py")

    jobs = sweep_run.xmanager_jobs(spec, spec.trials, tmp_path)
    packageable = sweep_run.python_packageable()

    assert [j.name for j in jobs] == [t.name for t in spec.trials]
    for job, trial in zip(jobs, spec.trials, strict=True):
        assert isinstance(job, xm.Job) and isinstance(job.executor, xm_local.Local)
        assert job.executable.command == sys.executable
        assert job.args.to_list(escaper=str) == sweep.trial_command(spec, trial, tmp_path)[1:]
    assert job.args.to_list()[-2:] == ["--config.trainer.learning_rate=0.0003",
                                       "--config.trainer.seed=1"]
    assert packageable.executable_spec.path == sys.executable
    assert isinstance(packageable.executor_spec, xm_local.Local.Spec)
