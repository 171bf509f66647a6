"""Renamed config keys keep working for one release, each with a warning; a rename that would
lose a value fails with one line."""

from __future__ import annotations

import logging

import pytest

from meshrl.configs import ConfigError, base_config, from_config_dict
from meshrl.configs.renames import rename_argv


def test_rename_argv_maps_the_sample_job_and_section_to_generate(caplog):
    with caplog.at_level(logging.WARNING):
        argv = rename_argv(["--config=c.py", "--config.job=sample", "--config.sample.version=3",
                            "--config.sampler.slots=4", "--workdir=/w"])
    assert argv == ["--config=c.py", "--config.job=generate", "--config.generate.version=3",
                    "--config.sampler.slots=4", "--workdir=/w"]
    assert "sample.version is deprecated" in caplog.text and "use generate.version" in caplog.text


def test_config_values_with_the_old_section_load_as_generate(caplog):
    values = base_config("generate").to_dict()
    values["job"] = "sample"
    values["sample"] = dict(values.pop("generate"), source="random")
    with caplog.at_level(logging.WARNING):
        config = from_config_dict(values)
    assert config.job.value == "generate" and config.generate.source == "random"
    assert "job = sample is deprecated" in caplog.text


def test_old_and_new_section_with_different_values_fail_naming_both():
    values = base_config("generate").to_dict()
    values["sample"] = dict(values["generate"], source="random")
    with pytest.raises(ConfigError, match=r"^sample\.\*: renamed generate\.\*"):
        from_config_dict(values)


def test_trainer_batch_size_of_an_rl_job_becomes_the_warm_start_batch(caplog):
    cfg = base_config("rl")
    cfg.trainer.batch_size = 16
    with caplog.at_level(logging.WARNING):
        config = from_config_dict(cfg)
    assert config.rl.warm_start_batch_size == 16 and config.trainer.batch_size == 8
    assert "use rl.warm_start_batch_size" in caplog.text


def test_rl_job_with_both_batch_sizes_set_fails_naming_the_unread_field():
    cfg = base_config("rl")
    cfg.trainer.batch_size, cfg.rl.warm_start_batch_size = 16, 32
    with pytest.raises(ConfigError, match=r"^trainer\.batch_size = 16: job = 'rl' does not read"):
        from_config_dict(cfg)


def test_sft_job_keeps_its_trainer_batch_size():
    cfg = base_config("sft")
    cfg.trainer.batch_size = 16
    assert from_config_dict(cfg).trainer.batch_size == 16
