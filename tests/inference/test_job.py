"""The sample job end to end: prompts file in, samples.jsonl out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshrl.configs import sample as sample_config
from meshrl.configs.loader import from_config_dict
from meshrl.inference import job
from meshrl.models import create_model
from meshrl.models.hf import save_hf_checkpoint
from meshrl.tests.inference.tiny import TINY

# The sample config's mesh fills data=-1: the job runs over all 8 fake devices.
pytestmark = pytest.mark.distributed


def _config(**data):
    cfg = sample_config.get_config()
    cfg.sampler.max_new_tokens = 5
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_sample_job_writes_one_record_per_jsonl_prompt(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i})
                                 for i, p in enumerate(["1+1=", "hello", "x" * 200])) + "\n")
    config = from_config_dict(_config(source="jsonl", path=str(prompts)))

    job.run(config, str(tmp_path))

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1]  # the 200-char prompt is over every bucket: dropped
    for r in rows:
        assert 1 <= len(r["tokens"]) <= 5
        assert len(r["raw_logprobs"]) == len(r["tokens"]) == len(r["versions"])
        assert r["finish_reason"] in ("stop", "length")
        assert isinstance(r["completion"], str)


def test_sample_job_loads_hf_checkpoint_and_samples_with_its_weights(tmp_path):
    ckpt = tmp_path / "hf"
    save_hf_checkpoint(create_model(dataclasses.replace(TINY, vocab_size=256), seed=3), ckpt)
    cfg = _config(num_examples=3)
    cfg.model.hf_path = str(ckpt)
    cfg.model.num_layers = 1  # ignored: the checkpoint's config.json wins

    job.run(from_config_dict(cfg), str(tmp_path))

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["prompt"].endswith("=") and r["tokens"] for r in rows)


def test_sample_job_refuses_model_vocab_smaller_than_tokenizer(tmp_path):
    cfg = _config(num_examples=1)
    cfg.model.vocab_size = 96

    with pytest.raises(ValueError, match="model.vocab_size = 96"):
        job.run(from_config_dict(cfg), str(tmp_path))
