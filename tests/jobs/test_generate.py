"""The generate job end to end: weights from hf_path / random / a run's checkpoint / a published
version, prompts rendered as in training, samples.jsonl out; every bad input is a clear error."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import ml_collections
import numpy as np
import pytest

from meshrl.configs import generate as generate_config
from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import from_config_dict
from meshrl.configs.schema import MeshConfig
from meshrl.datasets import eval_examples, make_prompt_iterator
from meshrl.datasets.sources import DatasetError
from meshrl.inference.published import publish_weights
from meshrl.inference.sampler import Request, Sampler
from meshrl.jobs import generate as job
from meshrl.jobs.rl_eval import sample_versions
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import create_model, split_model
from meshrl.models.hf import save_hf_checkpoint
from meshrl.models.load import abstract_params
from meshrl.models.tokenizer import tokenizer_for
from meshrl.tests.inference.tiny import TINY
from meshrl.tests.trainer.tiny import make_loop, tiny_config
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.trainer.sft_loop import run_sft
from meshrl.utils.params import flat_params

# The sample config's mesh fills data=-1: the job runs over all 8 fake devices.
pytestmark = pytest.mark.distributed

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RUN_VERSIONS = (2, 7)  # published by the run fixture: 2 = its trained params, 7 = other params


def _config(**data):
    cfg = generate_config.get_config()
    cfg.sampler.max_new_tokens = 5
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def _jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _samples(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def templated_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A tiny HF checkpoint shipping a BPE tokenizer.json with a chat template and BOS."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(["what is 12 plus 34 ?", "the answer is 46", "be brief"],
                            trainer=trainer)
    out = tmp_path_factory.mktemp("templated")
    save_hf_checkpoint(create_model(dataclasses.replace(TINY, vocab_size=320), seed=1), out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step SFT run (char tokenizer) with weight versions 2 (its params) and 7."""
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(**{"model.vocab_size": 256, "trainer.steps": 2,
                            "logging.tensorboard": False})
    loop = make_loop(config, workdir)
    try:
        run_sft(loop)
    finally:
        loop.close()
    other = split_model(create_model(config.model, seed=5))[1]
    publish_weights(loop.state.params, workdir, RUN_VERSIONS[0])
    publish_weights(other, workdir, RUN_VERSIONS[1])
    return workdir, config, {"checkpoint": loop.state.params, "version": other}


def test_sample_job_writes_one_record_per_jsonl_prompt(tmp_path):
    # A row field named like one the job writes (a reference completion) is kept beside it.
    prompts = _jsonl(tmp_path / "prompts.jsonl",
                     [{"prompt": p, "id": i, "completion": f"ref {i}", "tokens": [i]}
                      for i, p in enumerate(["1+1=", "hello", "x" * 200])])
    config = from_config_dict(_config(source="jsonl", path=str(prompts)))

    job.run(config, str(tmp_path))

    rows = _samples(tmp_path)
    assert [r["id"] for r in rows] == [0, 1]  # the 200-char prompt is over every bucket: dropped
    assert [(r["row.completion"], r["row.tokens"]) for r in rows] == [("ref 0", [0]),
                                                                       ("ref 1", [1])]
    for r in rows:
        assert r["prompt_ids"] == [1, *r["prompt"].encode()]  # BOS, then the raw bytes
        assert 1 <= len(r["tokens"]) <= 5
        assert len(r["raw_logprobs"]) == len(r["tokens"]) == len(r["versions"])
        assert r["finish_reason"] in ("stop", "length")
        assert isinstance(r["completion"], str) and "answer" not in r


def test_a_records_row_fields_json_cannot_hold_are_written_as_text():
    import datetime
    import decimal
    import types

    from meshrl.models.tokenizer import CharTokenizer

    out = types.SimpleNamespace(tokens=[104, 105], logprobs=[-1.0, -2.0], raw_logprobs=[-1, -2],
                                versions=[0, 0], finish_reason="length")
    row = {"prompt": "p", "day": datetime.date(2026, 1, 2), "blob": b"ab",
           "price": decimal.Decimal("1.50"), "tags": [datetime.date(2026, 1, 3)]}

    record = job._record(row, "p", [1, 112], out, CharTokenizer())

    assert (record["day"], record["blob"], record["price"], record["tags"]) == (
        "2026-01-02", "ab", "1.50", ["2026-01-03"])
    assert record["completion"] == "hi"


def test_sample_job_loads_hf_checkpoint_and_samples_with_its_weights(tmp_path):
    ckpt = tmp_path / "hf"
    save_hf_checkpoint(create_model(dataclasses.replace(TINY, vocab_size=256), seed=3), ckpt)
    cfg = _config(num_examples=3)
    cfg.generate.source = "hf_path"
    cfg.model.hf_path = str(ckpt)
    cfg.model.num_layers = 1  # ignored: the checkpoint's config.json wins
    cfg.model.tokenizer = "char"  # a byte-vocabulary checkpoint without tokenizer.json

    config = from_config_dict(cfg)

    job.run(config, str(tmp_path))

    rows = _samples(tmp_path)
    assert len(rows) == 3
    assert all(r["prompt"].endswith("=") and r["tokens"] for r in rows)
    # The checkpoint's weights, not another init: a sampler on them draws the same tokens.
    from meshrl.models import load_hf_checkpoint, split_model
    from meshrl.models.tokenizer import CharTokenizer

    model = load_hf_checkpoint(ckpt)
    sampler = Sampler(model.cfg, config.sampler, create_mesh(config.mesh))
    sampler.update_weights(split_model(model)[1], 0)
    stop = CharTokenizer().stop_ids
    requests = [Request(r["prompt_ids"], seed=(config.trainer.seed + i) & 0x7FFFFFFF,
                        stop_ids=stop) for i, r in enumerate(rows)]
    assert [c.tokens for c in sampler.generate(requests)] == [r["tokens"] for r in rows]


@pytest.mark.slow  # a BPE tokenizer and two prompt pipelines; seconds of set-up
def test_templated_prompt_ids_equal_the_rl_prompt_iterators(tmp_path, templated_checkpoint):
    rows = [{"question": "what is 12 plus 34 ?", "answer": "46"},
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "what is 12 plus 34 ?"}], "answer": "46"}]
    cfg = _config(source="jsonl", path=str(_jsonl(tmp_path / "p.jsonl", rows)),
                  prompt_field="question")
    cfg.generate.source = "hf_path"
    cfg.model.hf_path = str(templated_checkpoint)
    config = from_config_dict(cfg)

    job.run(config, str(tmp_path))

    tokenizer = tokenizer_for(config.model, 320)
    rl = make_prompt_iterator(config.data, tokenizer, batch_size=1, seed=0)
    rl_ids = {ex["prompt_text"]: ex["prompt_ids"] for ex in (next(rl)[0] for _ in rows)}
    samples = {r["prompt_text"]: r["prompt_ids"] for r in _samples(tmp_path)}
    assert samples == rl_ids and len(samples) == 2
    start = tokenizer.encode("<|im_start|>")
    assert all(ids[0] == tokenizer.bos_id and ids[1:2] == start for ids in samples.values())


def _run_sample_config(workdir: pathlib.Path, source: str) -> ml_collections.ConfigDict:
    cfg = _config(source="jsonl", path=str(_jsonl(workdir / "p.jsonl",
                                                  [{"prompt": "1+1="}, {"prompt": "hi"}])))
    cfg.generate.source = source
    cfg.model.num_layers = 1  # ignored: the run's saved config defines the model
    cfg.generate.overwrite = True  # the tests sample one run several times, reading samples.jsonl
    return cfg


@pytest.fixture(scope="module")
def direct_sampler(run_dir) -> Sampler:
    """A sampler built directly on the run's model, the job's sampler settings and mesh."""
    workdir, run_config, _ = run_dir
    config = from_config_dict(_run_sample_config(workdir, "checkpoint"))
    return Sampler(run_config.model, config.sampler, create_mesh(config.mesh))


@pytest.mark.slow  # trains a run first; the generate job's fast end-to-end test stays
@pytest.mark.parametrize("source, expected_version", [
    ("checkpoint", 2),  # the state's weight version after 2 steps
    ("version", RUN_VERSIONS[-1]),  # generate.version = -1: the newest published
])
def test_greedy_samples_from_a_run_equal_a_sampler_on_its_params(run_dir, direct_sampler, source,
                                                                 expected_version):
    workdir, _, params = run_dir
    config = from_config_dict(_run_sample_config(workdir, source))

    job.run(config, str(workdir))

    rows = _samples(workdir)
    requests = [Request(r["prompt_ids"], stop_ids=(2,)) for r in rows]
    direct_sampler.update_weights(params[source], 0)
    assert [r["tokens"] for r in rows] == [c.tokens for c in direct_sampler.generate(requests)]
    assert all(set(r["versions"]) == {expected_version} for r in rows)
    direct_sampler.update_weights(params["version" if source == "checkpoint" else "checkpoint"],
                                  0)
    assert [c.tokens for c in direct_sampler.generate(requests)] != \
        [r["tokens"] for r in rows]  # the two weight sets are told apart


@pytest.mark.slow  # restore onto another mesh: tests/trainer/test_checkpoint.py
def test_checkpoint_params_restore_onto_another_mesh_with_the_runs_values(run_dir):
    workdir, run_config, params = run_dir
    mesh = create_mesh(MeshConfig(data=-1, tensor=2))  # the run trained on one device
    _, target, _ = abstract_params(run_config.model, mesh, rules_for("sample"))
    reader = CheckpointReader(workdir / "checkpoints")

    try:
        restored, version = reader.params(reader.latest_step(), target)
    finally:
        reader.close()

    want, got, where = flat_params(params["checkpoint"]), flat_params(restored), \
        flat_params(target)
    assert version == 2 and sorted(got) == sorted(want)
    for name, leaf in got.items():
        assert leaf.sharding == where[name].sharding, name
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[name]), err_msg=name)
    assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
               for leaf in got.values())  # tensor-parallel leaves really moved


def test_missing_tokenizer_is_an_error_in_sample_and_rl(tmp_path):
    from meshrl.jobs import rl_setup

    ckpt = tmp_path / "hf"  # a subword-sized vocabulary with no tokenizer.json
    save_hf_checkpoint(create_model(dataclasses.replace(TINY, vocab_size=2048), seed=0), ckpt)
    cfg = _config(num_examples=1)
    cfg.generate.source = "hf_path"
    cfg.model.hf_path = str(ckpt)
    config = from_config_dict(cfg)
    mesh = create_mesh(dataclasses.replace(config.mesh, data=1), jax.devices()[:1])

    with pytest.raises(ConfigError, match=r"model.hf_path = .*: has no tokenizer.json "
                                          r"\(model.tokenizer = 'auto'"):
        job.run(config, str(tmp_path))
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        rl_setup.load_trainee(config, mesh)
    assert not (tmp_path / "samples.jsonl").exists()


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "x" * 100}, {"prompt": "y" * 90}], r"data.path = .*: none of its 2 prompts is "
                                                     r"1..64 tokens long"),
    ([], r"data.path = .*: the file holds no examples"),
])
def test_zero_prompts_kept_is_an_error(tmp_path, rows, match):
    config = from_config_dict(_config(source="jsonl", path=str(_jsonl(tmp_path / "p.jsonl",
                                                                      rows))))

    with pytest.raises(DatasetError, match=match):
        job.run(config, str(tmp_path))


def test_malformed_jsonl_reports_the_files_line_number(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1="}\n\n{"prompt": "2+2=",\n')
    config = from_config_dict(_config(source="jsonl", path=str(path)))

    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: malformed JSON")):
        job.run(config, str(tmp_path))


@pytest.mark.parametrize("sample, model, match", [
    ({"source": "checkpoint"}, {}, r"generate.source = 'checkpoint': no verified checkpoint under "),
    ({"source": "version"}, {}, r"generate.source = 'version': no published weights under "),
    ({"source": "hf_path"}, {}, r"generate.source = 'hf_path': model.hf_path is empty"),
    ({"source": "random"}, {"hf_path": "/ckpt"}, r"model.hf_path = '/ckpt' would be ignored"),
    ({}, {"tokenizer": "/no/such/dir"}, r"model.tokenizer = '/no/such/dir': no tokenizer.json"),
    ({"source": "checkpoint", "version": 3}, {},
     r"generate.version = 3: only read with generate.source = 'version'"),
])
def test_missing_source_is_an_error_naming_it(tmp_path, sample, model, match):
    cfg = _config(num_examples=1)
    for k, v in sample.items():
        setattr(cfg.generate, k, v)
    for k, v in model.items():
        setattr(cfg.model, k, v)

    with pytest.raises(ConfigError, match=match):
        job.run(from_config_dict(cfg), str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()  # the reader never creates a run


def test_unpublished_version_is_an_error_listing_the_published(run_dir, tmp_path):
    workdir, _, _ = run_dir
    cfg = _config(num_examples=1)
    cfg.generate.source, cfg.generate.version = "version", 3

    with pytest.raises(ConfigError, match=r"generate.version = 3: not published under .*"
                                          r"\(published: \[2, 7\]\)"):
        job.run(from_config_dict(cfg), str(workdir))


def test_sample_job_refuses_model_vocab_smaller_than_tokenizer(tmp_path):
    cfg = _config(num_examples=1)
    cfg.model.vocab_size = 96

    with pytest.raises(ConfigError, match="model.vocab_size = 96"):
        job.run(from_config_dict(cfg), str(tmp_path))


def test_sample_versions_gives_each_published_versions_greedy_held_out_completions(
        run_dir, direct_sampler):
    workdir, _, params = run_dir
    # Held-out arithmetic prompts; the run's saved model. A large trainer.seed: the requests'
    # seeds must stay in the sampler's range (greedy: they change nothing else).
    cfg = _config()
    cfg.trainer.seed = 10 ** 6
    config = from_config_dict(cfg)
    tokenizer = tokenizer_for(config.model, 256)
    examples = eval_examples(config.data, tokenizer)[:2]

    records = sample_versions(config, workdir, num_prompts=2)

    assert [r["version"] for r in records] == [2, 2, 7, 7]
    requests = [Request(ex["prompt_ids"], temperature=0.0, stop_ids=(tokenizer.eos_id,))
                for ex in examples]
    for version, key in zip(RUN_VERSIONS, ("checkpoint", "version"), strict=True):
        rows = [r for r in records if r["version"] == version]
        direct_sampler.update_weights(params[key], version)
        assert [r["tokens"] for r in rows] == [c.tokens for c in
                                               direct_sampler.generate(requests)]
        assert [r["prompt"] for r in rows] == [ex["prompt"] for ex in examples]
        assert all(r["completion"] == tokenizer.decode(r["tokens"]) for r in rows)
        assert all(0.0 <= r["reward"] <= 1.0 for r in rows)


def test_sample_versions_of_an_unpublished_version_is_an_error_listing_the_published(run_dir):
    workdir, _, _ = run_dir

    with pytest.raises(ConfigError, match=r"versions = \[3\]: not published under .*"
                                          r"\(published: \[2, 7\]\)"):
        sample_versions(from_config_dict(_config()), workdir, versions=[3, 7])
