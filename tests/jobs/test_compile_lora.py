"""The compile job's reference program of a LoRA run: the adapter-disabled frozen-base forward."""

from __future__ import annotations

import pytest

from meshrl.configs import base_config, from_config_dict
from meshrl.jobs import compile as compile_job


def _reference(**lora):
    cfg = base_config("sft")
    cfg.job, cfg.compile.job, cfg.rl.kl_coef = "compile", "rl", 0.1
    cfg.compile.programs = ("reference",)
    for k, v in lora.items():
        setattr(cfg.lora, k, v)
    config = from_config_dict(cfg)
    (result,) = compile_job.compile_all(config, *compile_job.target(config.compile)[:2])
    return result


def test_lora_reference_reads_the_frozen_base_once_not_a_second_copy():
    full = _reference()
    lora = _reference(rank=4, base_dtype="nf4")
    assert lora["program"] == "reference"
    # Its weights are the step's frozen base (nf4 projections, float32 rest), read in place:
    # no float32 copy of the projections is an argument.
    assert lora["weights_bytes_per_chip"] < 0.5 * full["weights_bytes_per_chip"]
    args = lora["memory_gib"]["arguments"] * 2 ** 30
    batch = (full["memory_gib"]["arguments"] * 2 ** 30 - full["weights_bytes_per_chip"])
    assert args == pytest.approx(lora["weights_bytes_per_chip"] + batch, abs=64)
    assert lora["hbm_per_chip_gib"] < full["hbm_per_chip_gib"]
