"""``load(config, mesh, role)``: the one way a job gets a model for a role.

It resolves the architecture once (``model.hf_path``'s config.json read once, or ``model.*``),
loads the tokenizer before any weights (a missing tokenizer fails fast), and builds the params
placed in the shardings of the role's rules (``mesh.rules``: ``train`` may shard over ``data``
with ``mesh.fsdp``; ``sample`` keeps params tensor-parallel), or only their shapes when asked
(``abstract=True``: nothing is allocated, no safetensors read), as the restore target of a
checkpoint or a published weight version.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config, ModelConfig
from meshrl.mesh.rules import Role, Rules, rules_for
from meshrl.models.build import build_model, resolve_model_config
from meshrl.models.decoder import abstract_model, split_model
from meshrl.models.sharding import param_shardings
from meshrl.models.tokenizer import Tokenizer, tokenizer_for


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model for one role: ``nnx.merge(graphdef, params)`` is the Decoder.

    ``params`` hold arrays placed in ``shardings``, or with ``abstract`` ``ShapeDtypeStruct``
    leaves carrying those shardings. ``shardings`` has one sharding per param Variable (a
    pytree prefix of ``params``, what ``jax.jit`` in/out shardings take). ``arch`` is the
    resolved architecture (``resolve_model_config``), ``model`` the section it came from
    (hf_path, tokenizer); ``mesh`` and ``rules`` (the role's) place the params.
    """

    graphdef: nnx.GraphDef
    params: Any
    arch: ModelConfig
    model: ModelConfig
    tokenizer: Tokenizer
    shardings: Any
    mesh: Mesh
    rules: Rules
    role: Role
    abstract: bool


def role_rules(config: Config, role: Role, fsdp: bool | None = None) -> Rules:
    """The rules of ``role``: the train role shards over ``data`` when ``fsdp`` (default
    ``mesh.fsdp``); the sample role never does."""
    return rules_for(role, config.mesh.fsdp if fsdp is None else fsdp)


def abstract_params(arch: ModelConfig, mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, Any, Any]:
    """(graphdef, params as ``ShapeDtypeStruct`` leaves on ``mesh`` under ``rules``, the
    per-Variable shardings); allocates nothing."""
    graphdef, abstract = split_model(abstract_model(arch, mesh=mesh, rules=rules))
    shardings = param_shardings(abstract, mesh, rules)
    # One sharding per param Variable, spread over the Variable's value.
    params = jax.tree.map(lambda sh, var: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), var), shardings, abstract)
    return graphdef, params, shardings


def load(config: Config, mesh: Mesh, role: Role, *, model: ModelConfig | None = None,
         abstract: bool = False, fsdp: bool | None = None) -> LoadedModel:
    """The model of ``model`` (default ``config.model``) for ``role`` on ``mesh``.

    Weights: ``model.hf_path``'s safetensors when set, else a random init seeded by
    ``trainer.seed``; with ``abstract`` neither (shapes and shardings only: ``with_weights``
    adds them later, after checks that need no weights). ``fsdp`` overrides ``mesh.fsdp`` for
    the train role. Errors: ``MissingFileError`` / ``CheckpointError`` / ``ConfigError`` naming
    the file or field; a bad config.json or tokenizer fails before any weights are read.
    """
    model = config.model if model is None else model
    rules = role_rules(config, role, fsdp)
    arch = resolve_model_config(model)  # the one read of config.json
    check_positions(config, arch, role)
    tokenizer = tokenizer_for(model, arch.vocab_size)
    graphdef, params, shardings = abstract_params(arch, mesh, rules)
    skeleton = LoadedModel(graphdef=graphdef, params=params, arch=arch, model=model,
                           tokenizer=tokenizer, shardings=shardings, mesh=mesh, rules=rules,
                           role=role, abstract=True)
    return skeleton if abstract else with_weights(skeleton, config.trainer.seed)


def check_positions(config: Config, arch: ModelConfig, role: Role) -> None:
    """The sequences ``role`` runs fit the model's ``max_position_embeddings`` (a checkpoint's
    config.json, or ``model.*``): positions past it were never trained."""
    field, length = (("trainer.seq_len", config.trainer.seq_len) if role == "train"
                     else ("sampler.max_len", config.sampler.max_len))
    if length > arch.max_position_embeddings:
        fix = ("its checkpoint was not trained past it" if arch.hf_path
               else "or raise model.max_position_embeddings")
        raise ConfigError(f"{field} = {length}: longer than the model's max_position_embeddings"
                          f" = {arch.max_position_embeddings}: lower {field} ({fix})")


def with_weights(skeleton: LoadedModel, seed: int) -> LoadedModel:
    """``skeleton`` (an abstract ``load``) holding its weights, placed in its shardings:
    ``model.hf_path``'s safetensors, else a random init from ``seed``. config.json is not read
    again."""
    built = build_model(skeleton.model, mesh=skeleton.mesh, rules=skeleton.rules, seed=seed,
                        resolved=skeleton.arch)
    graphdef, params = split_model(built)
    return dataclasses.replace(skeleton, graphdef=graphdef, params=params, abstract=False)


__all__ = ["LoadedModel", "abstract_params", "load", "role_rules", "with_weights"]
