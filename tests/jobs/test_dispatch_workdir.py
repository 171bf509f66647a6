"""Every job that writes into its workdir checks it and takes its lock first: the compile job
(it writes compile.json) as the training jobs do."""

from __future__ import annotations

import dataclasses
import os

import pytest

from meshrl.configs import Job, base_config, from_config_dict
from meshrl.jobs import dispatch
from meshrl.utils.workdir import WorkdirError


def _compile_config():
    return dataclasses.replace(from_config_dict(base_config("sft")), job=Job.COMPILE)


def test_the_compile_job_refuses_a_symlinked_workdir(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")

    with pytest.raises(WorkdirError, match="is a symlink"):
        dispatch._claim_workdir(_compile_config(), str(tmp_path / "link"))


def test_the_compile_job_creates_its_workdir_private_and_holds_a_lock_of_its_own(tmp_path):
    lock = dispatch._claim_workdir(_compile_config(), str(tmp_path / "new"))
    try:
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
        assert lock is not None and lock.path.endswith(".meshrl.compile.lock")
    finally:
        lock.release()
