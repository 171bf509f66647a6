"""``job = export``: a run's checkpoint or published weight version as a HF checkpoint that
transformers loads; SFT from a transformers checkpoint trains those weights; bad input is one
clear error with nothing written."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import base_config, from_config_dict
from meshrl.configs.schema import SamplerConfig
from meshrl.datasets import make_sft_iterator
from meshrl.inference.published import publish_weights
from meshrl.inference.sampler import Sampler
from meshrl.jobs import dispatch
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import build_model, forward, split_model
from meshrl.models.tokenizer import tokenizer_for

# The jobs run over all 8 fake devices (mesh.data = -1).
pytestmark = pytest.mark.distributed

HF_TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)


def _bpe_tokenizer(out: pathlib.Path) -> None:
    """A byte-level BPE tokenizer.json (+ config with BOS/EOS/PAD) trained on arithmetic."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<s>", "</s>"])
    tok.train_from_iterator(["12+34=46", "7+8=15", "99+1=100"], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


def hf_llama(out: pathlib.Path, seed: int = 0) -> object:
    """A random tiny LlamaForCausalLM saved by transformers (float32 safetensors) in ``out``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**HF_TINY, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return model


def _sft_config(hf_path: pathlib.Path, **overrides):
    cfg = base_config("sft")
    cfg.model.hf_path = str(hf_path)
    cfg.trainer.steps = 1
    cfg.trainer.learning_rate = 0.0
    cfg.trainer.batch_size = 8
    cfg.trainer.seq_len = 32
    cfg.trainer.peak_flops = 1e11
    cfg.data.num_examples = 64
    cfg.data.eval_examples = 0
    cfg.checkpoint.every_steps = 1
    cfg.checkpoint.async_save = False
    cfg.logging.tensorboard = False
    cfg.logging.progress_bar = False
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(cfg[section], name, value)
    return cfg


def _export(cfg, workdir: pathlib.Path, out: pathlib.Path, **export) -> None:
    cfg = cfg.copy_and_resolve_references()
    cfg.job = "export"
    cfg.export.path = str(out)
    for k, v in export.items():
        setattr(cfg.export, k, v)
    dispatch.run(from_config_dict(cfg), str(workdir))


def _tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One SFT step at learning rate 0 from a transformers Llama shipping a BPE tokenizer."""
    hf = tmp_path_factory.mktemp("hf")
    torch_model = hf_llama(hf)
    _bpe_tokenizer(hf)
    workdir = tmp_path_factory.mktemp("sft")
    cfg = _sft_config(hf)
    dispatch.run(from_config_dict(cfg), str(workdir))
    summary = json.loads((workdir / "summary.json").read_text())
    return hf, torch_model, cfg, workdir, summary


def test_sft_from_hf_path_at_zero_lr_exports_the_input_tensors_bitwise(sft_run, tmp_path):
    from safetensors.numpy import save_file

    hf, _, cfg, workdir, _ = sft_run
    out = tmp_path / "exported"
    want = _tensors(hf)
    # While the export runs, model.hf_path holds other weights: an export that read them
    # instead of the run's checkpoint would show it.
    original = (hf / "model.safetensors").read_bytes()
    save_file({k: v * 2.0 + 1.0 for k, v in want.items()}, str(hf / "model.safetensors"))
    try:
        _export(cfg, workdir, out)
    finally:
        (hf / "model.safetensors").write_bytes(original)

    got = _tensors(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    # The run's tokenizer (the checkpoint's own) travels with the weights.
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()


def test_sft_first_step_loss_equals_transformers_loss_on_the_same_batch(sft_run):
    import torch

    hf, torch_model, cfg, _, summary = sft_run
    config = from_config_dict(cfg)
    tokenizer = tokenizer_for(config.model, HF_TINY["vocab_size"])
    assert tokenizer.vocab_size > 256  # the checkpoint's BPE tokenizer, not the char one
    t = config.trainer
    batch = next(make_sft_iterator(config.data, tokenizer, batch_size=t.batch_size,
                                   seq_len=t.seq_len, seed=t.seed))

    # Packed rows: run each segment alone (its own positions), score its loss-masked targets.
    nll_sum, count = 0.0, 0.0
    for r in range(t.batch_size):
        seg_L, mask_L = batch["segment_ids"][r], batch["loss_mask"][r]
        for s in sorted(set(seg_L.tolist()) - {0}):
            at = np.flatnonzero(seg_L == s)
            with torch.no_grad():
                logits = torch_model(
                    input_ids=torch.tensor(batch["input_ids"][r, at][None].astype(np.int64)),
                    position_ids=torch.tensor(batch["positions"][r, at][None].astype(np.int64)),
                ).logits[0].double()
            nll = torch.nn.functional.cross_entropy(
                logits, torch.tensor(batch["targets"][r, at].astype(np.int64)), reduction="none")
            nll_sum += float((nll * torch.tensor(mask_L[at], dtype=torch.float64)).sum())
            count += float(mask_L[at].sum())

    assert count > 0
    np.testing.assert_allclose(summary["first_loss"], nll_sum / count, rtol=0, atol=1e-4)


@pytest.mark.slow  # the export job's default-run end to end: test_sft_from_hf_path_at_zero_lr_...
def test_export_of_a_published_version_gives_the_samplers_logits_in_transformers(tmp_path):
    import transformers

    hf = tmp_path / "hf"
    hf_llama(hf, seed=1)
    cfg = _sft_config(hf)
    cfg.model.tokenizer = "char"  # a byte-vocabulary checkpoint without tokenizer.json
    config = from_config_dict(cfg)
    mesh = create_mesh(config.mesh)
    trained = build_model(config.model, mesh=mesh, rules=rules_for("train", True))
    # Version 4 holds params other than the checkpoint's: perturb every tensor.
    params = jax.tree.map(lambda a: a * 1.25 + 0.01, split_model(trained)[1])
    publish_weights(params, tmp_path, 4)
    sampler = Sampler(trained.cfg, SamplerConfig(max_len=32, slots=2, prompt_buckets=(8,)),
                      mesh, workdir=str(tmp_path))
    sampler.load_weights(4)
    out = tmp_path / "v4"

    _export(cfg, tmp_path, out, version=4)

    ids_BxL = np.random.default_rng(0).integers(0, HF_TINY["vocab_size"], (2, 7), np.int32)
    want = np.asarray(forward(sampler.graphdef, sampler.params, ids_BxL))
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    import torch

    with torch.no_grad():
        got = model(input_ids=torch.tensor(ids_BxL.astype(np.int64))).logits.float().numpy()
    # float32 both sides; the remaining difference is op order (XLA vs torch matmuls).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not (out / "tokenizer.json").exists()  # the run used the char tokenizer


@pytest.mark.parametrize("export, workdir_kind, match", [
    ({}, "empty", r"no verified checkpoint under .*checkpoints"),
    ({"version": 9}, "empty", r"export.version = 9: not published under .*weights"),
    ({"step": 5}, "run", r"export.step = 5: no verified checkpoint of that step .*verified: "
                         r"\[1\]"),
])
def test_export_of_a_missing_checkpoint_or_version_is_one_error_and_writes_nothing(
        sft_run, tmp_path, export, workdir_kind, match):
    hf, _, cfg, run_workdir, _ = sft_run
    workdir = run_workdir if workdir_kind == "run" else tmp_path / "empty"
    out = tmp_path / "out"

    with pytest.raises(ConfigError, match=match):
        _export(cfg, workdir, out, **export)

    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert workdir == run_workdir or not workdir.exists()  # export only reads the workdir


def test_export_into_a_non_empty_directory_is_an_error(sft_run, tmp_path):
    _, _, cfg, workdir, _ = sft_run
    (tmp_path / "keep.txt").write_text("x")

    with pytest.raises(ConfigError, match=r"export.path = .*: a non-empty directory"):
        _export(cfg, workdir, tmp_path)

    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_peft_export_of_a_run_without_lora_is_one_line_naming_merged(sft_run, tmp_path):
    _, _, cfg, workdir, _ = sft_run

    with pytest.raises(ConfigError, match=r"export.format = 'peft': checkpoint step 1 of .* is "
                                          r"no LoRA run \(lora.rank = 0\): export it with "
                                          r"export.format = 'merged'"):
        _export(cfg, workdir, tmp_path / "out", format="peft")

    assert not (tmp_path / "out").exists()
