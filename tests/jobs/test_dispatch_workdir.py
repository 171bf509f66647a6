"""Every job that writes into its workdir checks it and takes its lock first: the compile job
(it writes compile.json) as the training jobs do; and the dry run checks what the run would
refuse only later (the paged sampler's page pool over its mesh)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from meshrl.configs import Job, base_config, from_config_dict
from meshrl.configs.fields import ConfigError
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


def _paged_generate_config(num_pages: int):
    cfg = base_config("generate")
    cfg.generate.source = "random"
    cfg.sampler.kv_cache, cfg.sampler.slots, cfg.sampler.max_len = "paged", 8, 32
    cfg.sampler.page_size, cfg.sampler.num_pages, cfg.sampler.prompt_buckets = 4, num_pages, (16,)
    return from_config_dict(cfg)


def test_dry_run_refuses_a_page_count_that_does_not_split_over_the_sampler_mesh():
    # 8 devices on data: 8 slots, so 8 pool shards of at least one max_len sequence (8 pages).
    with pytest.raises(ConfigError, match=r"^sampler.num_pages = 20: the pool splits over the "
                                          r"mesh axes \('data',\) .* use a multiple of 8 that "
                                          r"is >= 64, or 0$"):
        dispatch.dry_run(_paged_generate_config(20))
    assert "sampler.num_pages = 64" in dispatch.dry_run(_paged_generate_config(64))
