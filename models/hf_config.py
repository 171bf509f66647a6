"""Hugging Face ``config.json`` <-> ``ModelConfig`` for Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE
and Mixtral: reading one (unsupported features raise ``ConfigError`` naming the field; keys it
leaves out take transformers' defaults for its model type) and writing one transformers loads.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.utils.errors import MissingFileError, UserError
from meshrl.utils.log import get_logger

log = get_logger("models")

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_QK_NORM = ("qwen3", "qwen3_moe")
_ROPE_TYPES = {None: "none", "default": "none", "linear": "linear", "llama3": "llama3"}
# What transformers' config class of each model type uses for a key config.json leaves out
# (tests/models/test_hf_config.py checks them against the installed transformers): a
# hand-written config.json must give the model transformers runs, not meshrl's own defaults.
_ROPE = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}
_QWEN = {**_ROPE, "max_position_embeddings": 32768}
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_ROPE, "max_position_embeddings": 2048},
    "qwen2": {**_QWEN, "num_key_value_heads": 32},
    "qwen3": {**_QWEN, "num_key_value_heads": 32, "head_dim": 128},
    # The expert count is not defaulted (two keys name it): a config.json without it is refused.
    "qwen3_moe": {**_QWEN, "num_key_value_heads": 4, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "num_experts_per_tok": 2},
}


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot be read (no weights, unreadable config.json, a missing
    or misshapen tensor); names the directory and the file or tensor."""


# ---- config ---------------------------------------------------------------------------------


def model_config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from a HF ``config.json`` dict; unsupported features raise ConfigError.

    ``overrides`` sets runtime-only fields (param_dtype, compute_dtype, remat, hf_path, ...).
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCHS:
        raise ConfigError(f"HF config model_type = {model_type!r}: unsupported; supported: "
                          f"{sorted(_ARCHS)}")
    hf = {**_HF_DEFAULTS[model_type], **hf}  # a key given as null keeps its own meaning
    archs = hf.get("architectures") or [_ARCHS[model_type]]
    if archs != [_ARCHS[model_type]]:
        raise ConfigError(f"HF config architectures = {archs}: unsupported; for model_type "
                          f"{model_type!r} only {[_ARCHS[model_type]]} is supported")
    for key in ("quantization_config", "compression_config"):
        if hf.get(key):
            method = (hf[key].get("quant_method") if isinstance(hf[key], dict) else None)
            raise ConfigError(f"HF config {key} (quant_method = {method!r}): quantized "
                              f"checkpoints are unsupported: use the model's bf16/fp16/fp32 "
                              f"release (lora.base_dtype quantizes a base for QLoRA)")
    moe = _moe_fields(hf, model_type)
    # Qwen's switch is use_sliding_window (sliding_window is set either way); Mixtral's is a
    # non-null sliding_window.
    window_key = "sliding_window" if model_type == "mixtral" else "use_sliding_window"
    if hf.get(window_key):
        raise ConfigError(f"HF config {window_key} = {hf[window_key]!r}: sliding-window "
                          f"attention is unsupported")
    if hf.get("attention_dropout"):
        raise ConfigError(f"HF config attention_dropout = {hf['attention_dropout']}: "
                          f"unsupported (only 0: training applies no attention dropout)")
    bad_layers = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if bad_layers:
        raise ConfigError(f"HF config layer_types contains {bad_layers}: only full_attention is "
                          f"supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF config hidden_act = {hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("mlp_bias"):
        raise ConfigError("HF config mlp_bias = True: unsupported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        # Llama/Qwen3 put the bias on o_proj too; we only model q/k/v biases (Qwen2).
        raise ConfigError(f"HF config attention_bias = True for model_type {model_type!r}: "
                          f"unsupported (o_proj bias)")
    rope = _rope_fields(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 0
    if head_dim * heads == hf["hidden_size"]:
        head_dim = 0  # canonical: 0 means hidden_size // num_heads
    values: dict[str, Any] = dict(
        arch=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2", qk_norm=model_type in _QK_NORM, **rope, **moe)
    values.update(overrides)
    return ModelConfig(**values)


def _moe_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE or Mixtral config.json; any other config naming experts
    (DeepSeek's n_routed_experts, say) is refused."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if model_type not in ("qwen3_moe", "mixtral"):
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if hf.get(key):
                raise ConfigError(f"HF config {key} = {hf[key]}: experts are supported for "
                                  f"model_type qwen3_moe and mixtral only, not {model_type!r}")
        return {}
    if not experts:
        raise ConfigError(f"HF config model_type = {model_type!r} has no num_experts / "
                          f"num_local_experts")
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"HF config router_jitter_noise = {hf['router_jitter_noise']}: "
                          f"unsupported (only 0)")
    out: dict[str, Any] = dict(num_experts=int(experts),
                               num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)))
    if model_type == "mixtral":
        out.update(router="topk_softmax", norm_topk_prob=True)
    else:
        out.update(router="softmax_topk", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                   mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))
    return out


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters (theta inside); 4.x wrote rope_theta + rope_scaling.
    # A non-empty rope_scaling (what model cards say to add for long context) is what both
    # apply: 4.x never reads rope_parameters, 5.x replaces it with rope_scaling, theta from
    # rope_scaling, else the top-level rope_theta, else the model type's default.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    spec = scaling or params
    theta = spec.get("rope_theta", hf.get("rope_theta", 10000.0))
    if scaling and params and params.get("rope_theta", theta) != theta:
        log.warning("HF config: rope_scaling %s replaces rope_parameters %s (as transformers "
                    "does), so rope_theta is %s, not rope_parameters' %s", scaling, params,
                    theta, params["rope_theta"])
    rope_type = spec.get("rope_type", spec.get("type"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"HF config rope_scaling type = {rope_type!r}: unsupported; supported: "
                          f"{[k for k in _ROPE_TYPES if k]}")
    out: dict[str, Any] = dict(rope_theta=float(theta), rope_scaling=_ROPE_TYPES[rope_type])
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in spec]
    if missing:
        raise ConfigError(f"HF config rope_scaling type {rope_type!r} is missing {missing}")
    if rope_type in ("linear", "llama3"):
        out["rope_scaling_factor"] = float(spec["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(spec["low_freq_factor"]),
                   rope_high_freq_factor=float(spec["high_freq_factor"]),
                   rope_original_max_position=int(spec["original_max_position_embeddings"]))
    return out


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A HF ``config.json`` dict for ``cfg`` (read by transformers 4.x and 5.x)."""
    if cfg.arch == "qwen2" and not cfg.attention_bias:
        raise ConfigError("model.attention_bias = False: HF Qwen2 always has q/k/v biases")
    if cfg.arch != "qwen2" and cfg.attention_bias:
        raise ConfigError(f"model.attention_bias = True with model.arch = {cfg.arch!r}: HF "
                          f"{_ARCHS[cfg.arch]} would also need an o_proj bias")
    if cfg.qk_norm != (cfg.arch in _QK_NORM):
        raise ConfigError(f"model.qk_norm = {cfg.qk_norm}: HF {_ARCHS[cfg.arch]} requires "
                          f"{cfg.arch in _QK_NORM}")
    if cfg.arch == "mixtral" and (cfg.router != "topk_softmax" or not cfg.norm_topk_prob):
        raise ConfigError(f"model.router = {cfg.router!r}, model.norm_topk_prob = "
                          f"{cfg.norm_topk_prob}: HF Mixtral requires 'topk_softmax' and True")
    if cfg.arch == "qwen3_moe" and cfg.router != "softmax_topk":
        raise ConfigError(f"model.router = {cfg.router!r}: HF Qwen3-MoE requires "
                          f"'softmax_topk'")
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none"
                            else cfg.rope_scaling}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    out: dict[str, Any] = {
        "architectures": [_ARCHS[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else dict(rope),
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
    }
    if cfg.arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.arch in _QK_NORM:
        out["attention_bias"] = False
    if cfg.arch in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
    if cfg.arch == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.resolved_moe_intermediate_size, sliding_window=None,
                   router_jitter_noise=0.0, router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.arch == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.resolved_moe_intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                   mlp_only_layers=list(cfg.mlp_only_layers),
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    return out


def read_hf_config(path: str | pathlib.Path) -> dict[str, Any]:
    """``<path>/config.json`` as a dict; a missing or unreadable file raises the error naming it."""
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise MissingFileError(f"{file}: not found: a Hugging Face checkpoint directory needs "
                               f"config.json next to its *.safetensors")
    try:
        hf = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}): restore the file from the "
                              f"model's original release") from None
    return hf


def load_hf_config(path: str | pathlib.Path, hf: dict[str, Any] | None = None,
                   **overrides: Any) -> ModelConfig:
    """The ModelConfig of ``<path>/config.json`` (``hf``: its already-read dict)."""
    file = pathlib.Path(path) / "config.json"
    hf = read_hf_config(path) if hf is None else hf
    try:
        return model_config_from_hf(hf, hf_path=str(path), **overrides)
    except KeyError as e:
        raise CheckpointError(f"{file}: has no {e} entry: not a decoder config.json that meshrl "
                              f"can read") from None
    except ConfigError as e:  # name the file: the message names only the HF field
        raise ConfigError(f"{file}: {e}") from e
