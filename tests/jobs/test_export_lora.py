"""``job = export`` of a LoRA run's checkpoint: the merged model, and a PEFT adapter that
transformers + peft load onto the HF base with the same logits; a base PEFT cannot name is one
error line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import from_config_dict
from meshrl.configs.lora_schema import LoraConfig
from meshrl.configs.schema import ModelConfig
from meshrl.jobs import dispatch, weights_source
from meshrl.jobs.export import check_peft
from meshrl.jobs.lora_source import LoraBase, base_of
from meshrl.mesh import create_mesh
from meshrl.models import forward
from meshrl.tests.jobs.test_export import _bpe_tokenizer, _export, _sft_config, hf_llama

pytestmark = pytest.mark.distributed


def _torch_logits(model, ids_BxL):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids_BxL.astype(np.int64))).logits.float().numpy()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two SFT steps of rank-4 adapters on a transformers Llama (a rate that moves B off 0)."""
    hf = tmp_path_factory.mktemp("hf")
    hf_llama(hf)
    _bpe_tokenizer(hf)
    workdir = tmp_path_factory.mktemp("lora")
    cfg = _sft_config(hf, **{"trainer.steps": 2, "trainer.learning_rate": 0.05,
                             "lora.rank": 4, "lora.alpha": 8.0})
    dispatch.run(from_config_dict(cfg), str(workdir))
    return hf, cfg, workdir


@pytest.mark.slow  # an SFT run and two exports: about a minute on a 2-core CPU
def test_peft_and_merged_exports_give_the_runs_merged_logits(lora_run, tmp_path):
    import peft
    import transformers

    hf, cfg, workdir = lora_run
    _export(cfg, workdir, tmp_path / "peft", format="peft")
    _export(cfg, workdir, tmp_path / "merged")

    config = from_config_dict(cfg)
    src = weights_source.resolve(config, workdir, "checkpoint", weights_source.Wording(
        "job = 'export'", "export.step", "export.version", "-"))
    loaded, _ = weights_source.load_source(config, workdir, src, create_mesh(config.mesh),
                                           "train")
    ids_BxL = np.random.default_rng(0).integers(0, 320, (2, 9), np.int32)
    want = np.asarray(forward(loaded.graphdef, loaded.params, ids_BxL))

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager")
    base_logits = _torch_logits(base.eval(), ids_BxL)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    # float32 both sides; the remaining difference is op order (XLA vs torch matmuls).
    np.testing.assert_allclose(_torch_logits(tuned, ids_BxL), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_torch_logits(merged, ids_BxL), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - base_logits).max() > 1e-3  # the adapters changed the model
    config_json = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config_json["base_model_name_or_path"] == str(hf)
    assert config_json["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                             "q_proj", "up_proj", "v_proj"]


def _source(kind="checkpoint", base: LoraBase | None = LoraBase("hf_path", 0)):
    model = ModelConfig(hf_path="/models/base")
    lora = LoraConfig(rank=4) if base is not None else None
    return weights_source.WeightSource(kind, model, step=3, version=5, lora=lora, base=base)


@pytest.mark.parametrize("source, match", [
    (_source("version"), r"export.format = 'peft': weight version 5 holds merged weights, "
                         r"not adapters: .*export.format = 'merged'"),
    (_source(base=None), r"export.format = 'peft': checkpoint step 3 of run is no LoRA run "
                         r"\(lora.rank = 0\): export it with export.format = 'merged'"),
    (_source(base=LoraBase("random", 7)), r"adapt the random init of trainer.seed = 7, not a "
                                          r"Hugging Face directory.*export.format = 'merged'"),
    (_source(base=LoraBase("warm_start", 0, 12)), r"adapt the SFT warm start's checkpoint step "
                                                  r"12 .*export.format = 'merged'"),
])
def test_a_peft_export_without_an_hf_base_is_one_line_naming_merged(source, match):
    with pytest.raises(ConfigError, match=match):
        check_peft(source, "run")


def test_peft_of_an_hf_base_names_the_base_directory():
    assert check_peft(_source(), "run") == "/models/base"


@pytest.mark.slow  # a LoRA SFT run and a load: tens of seconds on a 2-core CPU
def test_a_lora_checkpoint_source_loads_the_engines_merged_params(tmp_path):
    from meshrl.tests.trainer.test_lora import LORA, _engine
    from meshrl.tests.trainer.tiny import mesh_for, tiny_config
    from meshrl.trainer.sft_loop import run_sft
    from meshrl.utils.params import flat_params

    # The char tokenizer that the loader pairs with a model without hf_path has 256 ids.
    config = tiny_config(**LORA, **{"trainer.steps": 2, "checkpoint.every_steps": 0,
                                    "checkpoint.async_save": False, "model.vocab_size": 256})
    engine, _ = _engine(config, tmp_path)
    run_sft(engine)
    engine.finish()
    want = flat_params(engine.params)
    engine.close()

    words = weights_source.Wording("generate.source = 'checkpoint'", "", "", "-")
    src = weights_source.resolve(config, tmp_path, "checkpoint", words)
    loaded, version = weights_source.load_source(config, tmp_path, src, mesh_for(config),
                                                 "train")
    assert src.base == LoraBase("random", config.trainer.seed) and version == 2
    assert "LoRA adapters merged into the random init of trainer.seed" in src.describe(
        tmp_path, version)
    got = flat_params(loaded.params)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(value), rtol=1e-6,
                                   atol=1e-6, err_msg=name)


@pytest.mark.parametrize("run, want", [
    ({"job": "sft", "model": {"hf_path": "/m"}, "trainer": {"seed": 3}}, LoraBase("hf_path", 3)),
    ({"job": "rl", "model": {}, "rl": {"warm_start_steps": 0}, "trainer": {"seed": 3}},
     LoraBase("random", 3)),
    ({"job": "dpo", "model": {}, "trainer": {"seed": 1}}, LoraBase("random", 1)),
])
def test_the_base_of_a_lora_run_is_what_its_saved_config_names(tmp_path, run, want):
    assert base_of(run, tmp_path, "ckpt") == want


def test_an_rl_lora_run_whose_warm_start_is_gone_is_one_line(tmp_path):
    run = {"job": "rl", "model": {}, "rl": {"warm_start_steps": -1}, "trainer": {"steps": 4}}
    with pytest.raises(ConfigError, match=r"^ckpt: its LoRA adapters adapt the SFT warm start, "
                                          r"and .*sft/checkpoints holds no verified checkpoint"):
        base_of(run, tmp_path, "ckpt")
