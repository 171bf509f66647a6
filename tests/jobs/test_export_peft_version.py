"""``job = export`` as a PEFT adapter from a published weight version: refused in one line.

A published version holds the merged params the sampler loads, not adapters; the adapters live
in the trainer checkpoint, which the error line points to. Nothing is written."""

from __future__ import annotations

import pytest

from meshrl.configs import base_config, from_config_dict
from meshrl.configs.fields import ConfigError
from meshrl.inference.published import publish_weights
from meshrl.jobs import export
from meshrl.models import create_model, split_model


def test_peft_export_of_a_published_version_names_it_and_the_checkpoint(tmp_path):
    cfg = base_config("sft")
    cfg.lora.rank = 4
    cfg.job, cfg.export.format, cfg.export.version = "export", "peft", 3
    cfg.export.path = str(tmp_path / "out")
    config = from_config_dict(cfg)
    _, params = split_model(create_model(config.model, seed=0))
    publish_weights(params, tmp_path / "run", 3)
    with pytest.raises(ConfigError, match=r"export.format = 'peft': weight version 3 holds "
                                          r"merged weights, not adapters: export the adapters "
                                          r"from the run's trainer checkpoint \(export.version "
                                          r"= -1"):
        export.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "out").exists()
