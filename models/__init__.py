"""Flax NNX decoders (Llama 3.x, Qwen2/2.5, Qwen3), KV cache, and HF safetensors import/export."""

from meshrl.models.build import RUNTIME_FIELDS, build_model, resolve_model_config
from meshrl.models.decoder import (
    Decoder,
    abstract_model,
    apply_head,
    create_model,
    flops_per_token,
    forward,
    forward_hidden,
    param_count,
    split_model,
)
from meshrl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from meshrl.models.hf_config import (
    CheckpointError,
    hf_config_from_model,
    load_hf_config,
    model_config_from_hf,
)
from meshrl.models.kv_cache import K_CACHE_AXES, V_CACHE_AXES, KVCache
from meshrl.models.load import LoadedModel, load
from meshrl.models.sharding import ShardingContext, logical_axes, param_shardings

__all__ = [
    "RUNTIME_FIELDS", "build_model", "resolve_model_config", "LoadedModel", "load",
    "CheckpointError", "Decoder", "K_CACHE_AXES", "KVCache", "V_CACHE_AXES", "ShardingContext", "abstract_model",
    "apply_head", "create_model", "flops_per_token", "forward", "forward_hidden", "hf_config_from_model", "load_hf_checkpoint", "load_hf_config",
    "logical_axes", "model_config_from_hf", "param_count", "param_shardings", "save_hf_checkpoint",
    "split_model",
]
