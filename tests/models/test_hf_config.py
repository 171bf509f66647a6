"""HF config conversion: supported fields round-trip, unsupported ones fail naming the thing,
real-size configs build abstractly, broken checkpoints fail naming the tensor."""

from __future__ import annotations

import json

import jax
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.models import (
    CheckpointError,
    abstract_model,
    flops_per_token,
    hf_config_from_model,
    load_hf_checkpoint,
    load_hf_config,
    model_config_from_hf,
    param_count,
    split_model,
)

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 21, "torch_dtype": "bfloat16",
}


def test_qwen25_05b_config_builds_abstractly_with_494m_params(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))

    cfg = load_hf_config(tmp_path)
    _, params = split_model(abstract_model(cfg))

    leaves = jax.tree.leaves(params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert cfg.tie_embeddings and cfg.attention_bias and cfg.resolved_head_dim == 64
    assert param_count(cfg) == 494_032_768  # the published Qwen2.5-0.5B count
    # Training FLOPs/token: dominated by 6N (N counts the tied head's matmul too).
    assert 6 * 494e6 < flops_per_token(cfg, 2048) < 6 * 494e6 * 1.5


@pytest.mark.parametrize("cfg", [
    ModelConfig(arch="llama", rope_scaling="llama3", rope_scaling_factor=8.0,
                rope_theta=500000.0),
    ModelConfig(arch="llama", rope_scaling="linear", rope_scaling_factor=2.0),
    ModelConfig(arch="qwen2", attention_bias=True, tie_embeddings=True),
    ModelConfig(arch="qwen3", qk_norm=True, head_dim=32),
])
def test_model_config_round_trips_through_hf_config(cfg):
    assert model_config_from_hf(hf_config_from_model(cfg)) == cfg


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_keys_a_config_json_leaves_out_take_transformers_defaults_for_its_model_type(model_type):
    transformers = pytest.importorskip("transformers")
    # Only what every config.json must say; everything else from the model type's defaults.
    given = {"model_type": model_type, "vocab_size": 64, "hidden_size": 256,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 32}
    if model_type in ("qwen3_moe", "mixtral"):
        given["num_local_experts"] = 16  # refused when missing (two keys may name it)
    hf = transformers.AutoConfig.for_model(**given)

    cfg = model_config_from_hf(given)

    rope = getattr(hf, "rope_parameters", None) or {}
    want = {"rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
            "rms_norm_eps": hf.rms_norm_eps, "num_kv_heads": hf.num_key_value_heads,
            "resolved_head_dim": getattr(hf, "head_dim", None) or 256 // 32,
            "max_position_embeddings": hf.max_position_embeddings,
            "tie_embeddings": hf.tie_word_embeddings}
    if model_type in ("qwen3_moe", "mixtral"):
        want |= {"num_experts": 16, "num_experts_per_tok": hf.num_experts_per_tok}
    if model_type == "qwen3_moe":
        want |= {"norm_topk_prob": hf.norm_topk_prob,
                 "moe_intermediate_size": hf.moe_intermediate_size,
                 "decoder_sparse_step": hf.decoder_sparse_step}
    assert {k: getattr(cfg, k) for k in want} == want


def test_transformers_4_style_rope_scaling_is_read():
    hf = {**hf_config_from_model(ModelConfig(arch="llama")), "rope_parameters": None,
          "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}

    cfg = model_config_from_hf(hf)

    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor) == (500000.0, "linear",
                                                                          4.0)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_rope_scaling_added_beside_rope_parameters_is_applied_as_transformers_does(model_type):
    # A transformers-5 config.json (rope_parameters) with the rope_scaling key a model card says
    # to add for long context: transformers applies rope_scaling, theta from it, else the
    # top-level rope_theta, else the model type's default.
    transformers = pytest.importorskip("transformers")
    given = {"model_type": model_type, "vocab_size": 64, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e6},
             "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    hf = transformers.AutoConfig.for_model(**given).rope_parameters

    cfg = model_config_from_hf(given)

    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_theta) == (
        hf["rope_type"], hf["factor"], hf["rope_theta"])


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gpt2"}, "'gpt2'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),  # beside rope_parameters
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
     "quantization_config [(]quant_method = 'bitsandbytes'[)]"),
    ({"compression_config": {"quant_method": "compressed-tensors"}}, "compression_config"),
])
def test_unsupported_hf_config_fails_naming_the_field(change, named):
    hf = {**hf_config_from_model(ModelConfig(arch="llama")), **change}

    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        model_config_from_hf(hf)


def test_a_mixtral_sliding_window_is_refused_naming_its_own_key():
    hf = {**hf_config_from_model(ModelConfig(arch="mixtral", num_experts=4,
                                             num_experts_per_tok=2, router="topk_softmax",
                                             norm_topk_prob=True)),
          "sliding_window": 4096}

    with pytest.raises(ConfigError, match="HF config sliding_window = 4096: sliding-window"):
        model_config_from_hf(hf)
    assert model_config_from_hf({**hf, "sliding_window": None}).num_experts == 4


def test_missing_tensor_fails_naming_it(hf_checkpoint):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("qwen2_untied")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_checkpoint(path)


def test_wrong_tensor_shape_fails_naming_it(hf_checkpoint):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10]
    save_file(tensors, path / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_hf_checkpoint(path)


def test_a_tied_config_over_a_distinct_lm_head_fails_naming_both_tensors(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2_untied")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))

    with pytest.raises(CheckpointError, match=r"tie_word_embeddings = true.*lm_head\.weight "
                                              r"that differs from model\.embed_tokens\.weight"):
        load_hf_checkpoint(path)


def test_a_tied_checkpoint_holding_a_redundant_head_copy_loads_tied(hf_checkpoint):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("qwen2_untied")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))

    model = load_hf_checkpoint(path)

    assert model.cfg.tie_embeddings
