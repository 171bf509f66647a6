"""Tiny random transformers models saved as local HF checkpoints, for parity tests."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# kind -> (transformers config class name, model class name, extra config kwargs)
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM",
                   {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    # head_dim 32 != hidden / heads = 16, as in real Qwen3 checkpoints.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
}


def build_hf_model(kind: str, seed: int = 0) -> Any:
    """A tiny transformers model with every weight random (norms and biases included)."""
    cfg_name, model_name, extra = KINDS[kind]
    return random_hf_model(cfg_name, model_name, {**TINY, **extra}, seed)


def random_hf_model(cfg_name: str, model_name: str, config: dict[str, Any], seed: int = 0,
                    ) -> Any:
    """``transformers.<model_name>(<cfg_name>(**config))`` with every weight random: norms in
    [0.5, 1.5], the rest N(0, 0.1)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**config, attn_implementation="eager")
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model: Any, ids_BxL: np.ndarray, positions_BxL: np.ndarray | None = None,
              ) -> np.ndarray:
    import torch

    kwargs = {} if positions_BxL is None else {"position_ids": torch.tensor(positions_BxL)}
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids_BxL), **kwargs).logits.float().numpy()


@pytest.fixture
def hf_checkpoint(tmp_path: pathlib.Path) -> Callable[[str], tuple[pathlib.Path, Any]]:
    """Factory: kind -> (checkpoint dir, the torch model it holds)."""

    def make(kind: str) -> tuple[pathlib.Path, Any]:
        model = build_hf_model(kind)
        path = tmp_path / kind
        model.save_pretrained(path, safe_serialization=True)
        return path, model

    return make


def random_ids(batch: int, length: int, vocab: int = 128, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def byte_sft_config(**model: Any) -> Any:
    """A validated SFT ``Config`` of a tiny random decoder with the byte tokenizer (no
    tokenizer.json needed) on one device; ``model`` overrides ``model.*``."""
    from meshrl.configs import base_config, from_config_dict

    cfg = base_config("sft")
    cfg.mesh.data = 1
    cfg.model.tokenizer = "char"
    for key, value in {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                       "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, **model}.items():
        setattr(cfg.model, key, value)
    return from_config_dict(cfg)
