"""PEFT adapter export: transformers + peft on the HF base give meshrl's LoRA logits; so does
the merged HF export."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.lora_schema import LoraConfig
from meshrl.models import load_hf_checkpoint, save_hf_checkpoint, split_model
from meshrl.models.lora import Lora, init_adapters, projections
from meshrl.models.peft_export import (
    CONFIG,
    peft_tensors,
    save_peft_adapter,
    target_modules,
)
from meshrl.tests.models.conftest import hf_logits, random_ids

# float32 on both sides; differences are summation order only (as in test_hf_parity).
RTOL, ATOL = 1e-4, 1e-4


def _random_lora(model, cfg: LoraConfig):
    """(Lora, nonzero random adapters, merged params, graphdef) of a loaded meshrl model."""
    graphdef, params = split_model(model)
    lora = Lora.of(cfg, graphdef, params)
    adapters = init_adapters(list(lora.targets), cfg.rank, seed=1)
    keys = jax.random.split(jax.random.key(2), len(adapters))
    adapters = {p: {"a": ab["a"], "b": 0.05 * jax.random.normal(k, ab["b"].shape)}
                for k, (p, ab) in zip(keys, adapters.items())}
    frozen = lora.freeze(params)
    dtypes = {k: v.dtype for k, v in frozen.items()}
    merged = lora.merged(jax.tree.structure(params), frozen, adapters, dtypes)
    return lora, adapters, merged, graphdef


@pytest.mark.parametrize("kind,targets", [
    pytest.param("llama", r"attn/(q|k|v|o)|mlp/(gate|up|down)", marks=pytest.mark.slow),
    ("qwen2_untied", r"attn/(q|v)")])
def test_peft_adapter_on_the_hf_base_gives_meshrl_lora_logits(hf_checkpoint, tmp_path, kind,
                                                              targets):
    import peft
    import transformers

    path, _ = hf_checkpoint(kind)
    model = load_hf_checkpoint(path)
    cfg = LoraConfig(rank=4, alpha=8.0, targets=targets)
    lora, adapters, merged, graphdef = _random_lora(model, cfg)
    ids_BxL = random_ids(2, 10, seed=3)
    want_BxLxV = np.asarray(nnx.merge(graphdef, merged)(ids_BxL))

    every = projections(graphdef, nnx.state(model, nnx.Param))
    save_peft_adapter(model.cfg, cfg, lora.targets, every, adapters, str(path), tmp_path / "a")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "a").eval()
    np.testing.assert_allclose(hf_logits(tuned, ids_BxL), want_BxLxV, rtol=RTOL, atol=ATOL)
    config = json.loads((tmp_path / "a" / CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8.0, False)

    save_hf_checkpoint(nnx.merge(graphdef, merged), tmp_path / "merged")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                              attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again.eval(), ids_BxL), want_BxLxV, rtol=RTOL,
                               atol=ATOL)


def test_peft_names_and_layout_split_stacked_layers(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    plain = load_hf_checkpoint(path)
    cfg = LoraConfig(rank=3, targets="attn/o")
    lora, adapters, _, _ = _random_lora(plain, cfg)
    tensors, modules = peft_tensors(plain.cfg, lora.targets, adapters)
    name = "base_model.model.model.layers.1.self_attn.o_proj.lora_"
    o = adapters["layers/1/attn/o/kernel"]  # A: [N, H, r], B: [r, D]
    np.testing.assert_array_equal(tensors[name + "A.weight"], np.asarray(o["a"]).reshape(-1, 3).T)
    np.testing.assert_array_equal(tensors[name + "B.weight"], np.asarray(o["b"]).T)
    assert modules == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]

    stacked = {"layers/attn/o/kernel": {k: np.stack([adapters[f"layers/{i}/attn/o/kernel"][k]
                                                     for i in range(2)]) for k in ("a", "b")}}
    scan_cfg = dataclasses.replace(plain.cfg, scan_layers=True)
    target = dataclasses.replace(lora.targets[0], path="layers/attn/o/kernel",
                                 shape=(2,) + lora.targets[0].shape, n_lead=1)
    got, _ = peft_tensors(scan_cfg, [target], stacked)
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)


def test_target_modules_are_short_names_only_when_every_such_module_is_adapted():
    every = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert target_modules(every, every) == ["q_proj", "v_proj"]
    assert target_modules(every[:1], every) == ["model.layers.0.self_attn.q_proj"]


def test_peft_export_of_an_moe_models_dense_mlp_adapters_is_refused_before_writing(tmp_path):
    # peft reads gate/up/down_proj targets of an MoE model type as its fused experts: the
    # dense layer's adapters would be dropped, so the export stops with one line instead.
    from meshrl.configs.fields import ConfigError
    from meshrl.configs.schema import ModelConfig
    from meshrl.models import create_model

    moe = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32,
                      intermediate_size=64, moe_intermediate_size=16, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=(1,), max_position_embeddings=256)
    model = create_model(moe, seed=0)
    graphdef, params = split_model(model)
    every = projections(graphdef, nnx.state(model, nnx.Param))
    for targets, refused in ((r"attn/(q|k|v|o)|mlp/(gate|up|down)", True), (r"attn/q", False)):
        cfg = LoraConfig(rank=2, targets=targets)
        lora = Lora.of(cfg, graphdef, params)
        adapters = init_adapters(list(lora.targets), cfg.rank, seed=1)
        out = tmp_path / targets.replace("/", "_").replace("|", "+")
        if refused:
            with pytest.raises(ConfigError, match=r"adapted dense MLP modules of an MoE model "
                                                  r"\(model.layers.1.mlp"):
                save_peft_adapter(moe, cfg, lora.targets, every, adapters, "base", out)
            assert not out.exists()
        else:
            save_peft_adapter(moe, cfg, lora.targets, every, adapters, "base", out)
            assert (out / CONFIG).is_file()
