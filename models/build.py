"""The one model builder every job uses (SFT, RL, sample, export): ``model.*`` in, ``Decoder`` out.

``model.hf_path`` empty: a random init of ``model.*``. Set: the architecture comes from
``<hf_path>/config.json`` (the ``model.*`` architecture fields are not read; a non-default one
that disagrees with the checkpoint is logged), the weights from its safetensors, and every
runtime field (``param_dtype``, ``compute_dtype``, ``remat``, ``scan_layers``, ``tokenizer``)
from ``model.*``. A runtime field the built model does not carry is an error naming it, never
dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules
from meshrl.models.decoder import Decoder, create_model
from meshrl.models.hf import load_hf_checkpoint
from meshrl.models.hf_config import load_hf_config, read_hf_config
from meshrl.models.tokenizer import Tokenizer, resolve_tokenizer_spec, tokenizer_for
from meshrl.utils.log import get_logger

# Fields of ModelConfig that say how to run the weights, not what they are: with model.hf_path
# they come from model.*, every other field from the checkpoint's config.json.
RUNTIME_FIELDS = ("param_dtype", "compute_dtype", "attention", "remat", "scan_layers", "mlp_chunk",
                  "tokenizer", "moe_impl", "capacity_factor", "router_aux_loss_coef",
                  "router_z_loss_coef", "context_attention", "context_balance")
_NOT_ARCH = (*RUNTIME_FIELDS, "hf_path")


def resolve_model_config(model: ModelConfig, hf: dict[str, Any] | None = None) -> ModelConfig:
    """The config ``build_model(model)`` builds: ``model`` itself when ``model.hf_path`` is
    empty, else the architecture of ``<hf_path>/config.json`` with ``model``'s runtime fields.

    Reads only config.json (not at all when ``hf`` holds its dict). Raises ``MissingFileError`` / ``CheckpointError`` (no or unreadable
    config.json) and ``ConfigError`` (an unsupported architecture), each naming the file.
    """
    if not model.hf_path:
        return model
    runtime = {name: getattr(model, name) for name in RUNTIME_FIELDS}
    resolved = load_hf_config(model.hf_path, hf, **runtime)
    default = ModelConfig()
    ignored = [f"model.{f.name} = {getattr(model, f.name)!r} (checkpoint: "
               f"{getattr(resolved, f.name)!r})"
               for f in dataclasses.fields(ModelConfig) if f.name not in _NOT_ARCH
               and getattr(model, f.name) != getattr(default, f.name)
               and getattr(model, f.name) != getattr(resolved, f.name)]
    if ignored:
        get_logger("models").warning(
            "model.hf_path = %r decides the architecture; not used: %s", model.hf_path,
            ", ".join(ignored))
    return resolved


@dataclasses.dataclass(frozen=True)
class EffectiveModel:
    """What a run of ``model.*`` builds and reads: ``config`` is ``resolve_model_config``'s,
    ``from_checkpoint`` the fields of it read from ``<hf_path>/config.json`` (empty without
    ``hf_path``), ``tokenizer`` the loaded tokenizer of ``tokenizer_spec``."""

    config: ModelConfig
    from_checkpoint: tuple[str, ...]
    tokenizer_spec: str
    tokenizer: Tokenizer
    checkpoint_dtype: str | None = None  # config.json's dtype: how the weights are stored


def effective_model(model: ModelConfig) -> EffectiveModel:
    """The model and tokenizer every job of ``model.*`` uses, resolved and loaded by the same
    functions the jobs call (``resolve_model_config``, ``tokenizer_for``), so a dry run that
    passes this and prints it shows, and has checked, what the run will use. Reads config.json
    and the tokenizer files, never the weights."""
    hf = read_hf_config(model.hf_path) if model.hf_path else None  # the one read
    resolved = resolve_model_config(model, hf)
    tokenizer = tokenizer_for(model, resolved.vocab_size)
    from_checkpoint = tuple(f.name for f in dataclasses.fields(ModelConfig)
                            if model.hf_path and f.name not in _NOT_ARCH)
    stored = (hf.get("dtype") or hf.get("torch_dtype")) if hf is not None else None
    return EffectiveModel(resolved, from_checkpoint, resolve_tokenizer_spec(model), tokenizer,
                          stored)


def build_model(model: ModelConfig, *, mesh: Mesh | None = None, rules: Rules | None = None,
                seed: int = 0, resolved: ModelConfig | None = None) -> Decoder:
    """The model of ``model.*`` (see the module docstring), each param placed in its sharding
    under ``rules`` on ``mesh``. ``built.cfg`` is ``resolve_model_config(model)``; pass it as
    ``resolved`` when already known, and config.json is not read again."""
    resolved = resolved if resolved is not None else resolve_model_config(model)
    if not model.hf_path:
        built = create_model(resolved, mesh=mesh, rules=rules, seed=seed)
    else:
        built = load_hf_checkpoint(model.hf_path, mesh=mesh, rules=rules,
                                   dtype=jnp.dtype(model.param_dtype), cfg=resolved)
    for name in RUNTIME_FIELDS:
        if getattr(built.cfg, name) != getattr(model, name):
            raise ConfigError(f"model.{name} = {getattr(model, name)!r}: the built model has "
                              f"{getattr(built.cfg, name)!r}; this build cannot honour it")
    return built
