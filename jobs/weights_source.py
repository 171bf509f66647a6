"""Where a job's existing weights come from: one resolver for the sample, export and evaluate
jobs.

A source is one of ``model.hf_path`` (its safetensors), ``random`` (an init of ``model.*``), a
``checkpoint`` step of the run under ``--workdir`` (params only, with the model section the run
saved beside it; a LoRA run's checkpoint: its adapters merged into the base it names,
``jobs.lora_source``) or a published weight ``version`` ``<workdir>/weights/<V>`` (with the model
section of the run's newest checkpoint, or of this config when the run has none).

``resolve`` checks that the source exists and finds its model section without reading any
weights, so a bad source fails before anything compiles; ``skeleton`` (``models.load``,
abstract) gives the architecture, tokenizer and shardings for a role, and ``fill`` places the
weights in them (``load_source`` does both). Every problem is one ``ConfigError`` line naming
the config field, its value and the fix. This lives in ``jobs``, not ``models``: it reads the
trainer's checkpoints and the sampler's published versions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.lora_schema import LoraConfig
from meshrl.configs.schema import Config, ModelConfig
from meshrl.inference.published import published_versions, weights_dir
from meshrl.inference.weights import WeightMismatchError, restore_weights
from meshrl.jobs.lora_source import LoraBase, LoraWeights, base_of, load_lora
from meshrl.mesh.rules import Role
from meshrl.models.load import LoadedModel, load, with_weights
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.utils import paths
from meshrl.utils.params import flat_params

Kind = Literal["hf_path", "random", "checkpoint", "version"]
NEWEST = -1


@dataclasses.dataclass(frozen=True)
class Wording:
    """How a job's error lines name its choice: ``source`` what chose the kind
    (``"generate.source = 'version'"``), ``step`` / ``version`` the fields holding a step or
    version (``"export.step"``; empty for a job that always takes the newest step),
    ``instead`` the other choice a line offers."""

    source: str
    step: str
    version: str
    instead: str


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """Resolved weights: ``model`` is the model section they belong to (the run's saved one for
    run sources), ``step`` the checkpoint step (kind checkpoint; kind version: the checkpoint
    whose config gave ``model``, or None), ``version`` the published version (kind version);
    a LoRA run's checkpoint: ``lora`` its section and ``base`` the base its adapters adapt."""

    kind: Kind
    model: ModelConfig
    step: int | None = None
    version: int | None = None
    lora: LoraConfig | None = None
    base: LoraBase | None = None

    def describe(self, workdir: paths.PathLike, version: int) -> str:
        """One phrase naming these weights and their weight ``version``, for the job's log."""
        if self.kind == "random":
            return (f"a random {self.model.num_layers}-layer model of model.* (weight version "
                    f"{version})")
        if self.kind == "hf_path":
            return f"model.hf_path {self.model.hf_path} (weight version {version})"
        if self.kind == "checkpoint" and self.base is not None:
            return (f"checkpoint step {self.step} (weight version {version}) of {workdir}: LoRA "
                    f"adapters merged into {self.base.describe(self.model.hf_path)}")
        if self.kind == "checkpoint":
            return f"checkpoint step {self.step} (weight version {version}) of {workdir}"
        return f"weight version {version} of {workdir}"


def _run_model(reader: CheckpointReader, step: int) -> ModelConfig:
    """The model section of the config the run saved with ``step``."""
    try:
        return ModelConfig.from_mapping(reader.config(step)["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise ConfigError(f"{reader.directory / str(step)}: its saved config has no usable model "
                          f"section ({e}): was it written by meshrl? pass that run's workdir as "
                          f"--workdir") from None


def _checkpoint(reader: CheckpointReader, step: int, words: Wording) -> WeightSource:
    steps = reader.steps()
    if not steps:
        raise ConfigError(f"{words.source}: no verified checkpoint under {reader.directory}: "
                          f"pass the run's workdir as --workdir, or {words.instead}")
    chosen = steps[-1] if step == NEWEST else step
    if chosen not in steps:
        raise ConfigError(f"{words.step} = {step}: no verified checkpoint of that step under "
                          f"{reader.directory} (verified: {steps}): pick one of them, or -1 for "
                          f"the newest")
    saved = reader.config(chosen)
    model = _run_model(reader, chosen)
    if not (saved.get("lora") or {}).get("rank", 0):
        return WeightSource("checkpoint", model, step=chosen)
    # A LoRA run's train state holds the adapters only; they are merged into its base.
    lora = LoraConfig.from_mapping(saved["lora"])
    base = base_of(saved, reader.directory.parent,
                   f"{words.source}: checkpoint step {chosen} under {reader.directory}")
    return WeightSource("checkpoint", model, step=chosen, lora=lora, base=base)


def _version(config: Config, workdir: paths.PathLike, reader: CheckpointReader, version: int,
             words: Wording) -> WeightSource:
    versions = published_versions(workdir)
    where = weights_dir(workdir, 0).parent
    if version != NEWEST and version not in versions:
        raise ConfigError(f"{words.version} = {version}: not published under {where} "
                          f"(published: {versions}): pick one of them, or {words.instead}")
    if not versions:
        raise ConfigError(f"{words.source}: no published weights under {where}: pass the run's "
                          f"workdir as --workdir, or {words.instead}")
    step = reader.latest_step()
    model = config.model if step is None else _run_model(reader, step)
    return WeightSource("version", model, step=step,
                        version=versions[-1] if version == NEWEST else version)


def resolve(config: Config, workdir: paths.PathLike, kind: Kind, words: Wording, *,
            step: int = NEWEST, version: int = NEWEST) -> WeightSource:
    """The source of ``kind`` (``step`` / ``version``: -1 the newest), checked to exist; reads
    config files (the run's saved config, ``<hf_path>/config.json``'s presence), no weights."""
    if kind == "random":
        return WeightSource("random", config.model)
    if kind == "hf_path":
        hf = config.model.hf_path
        if not hf or not (paths.as_path(hf) / "config.json").is_file():
            raise ConfigError(f"model.hf_path = {hf!r}: no config.json there ({words.source}): "
                              f"point it at a local Hugging Face checkpoint directory")
        return WeightSource("hf_path", config.model)
    reader = CheckpointReader(paths.as_path(workdir) / "checkpoints")
    try:
        if kind == "checkpoint":
            return _checkpoint(reader, step, words)
        return _version(config, workdir, reader, version, words)
    finally:
        reader.close()


def mismatch_error(workdir: paths.PathLike, version: int, whose: str,
                   error: WeightMismatchError) -> ConfigError:
    """The line for published weights that do not fit the model they are restored into."""
    return ConfigError(f"{weights_dir(workdir, version)}: weight version {version} does not fit "
                       f"model.* of {whose} ({error}): pass the config the run was trained with")


def _restore_version(workdir: paths.PathLike, source: WeightSource, target: Any) -> Any:
    """Published ``source.version`` restored onto ``target``'s (abstract params) shardings."""
    assert source.version is not None, source
    expected = flat_params(target)
    shardings = {k: v.sharding for k, v in expected.items()}
    try:
        flat = restore_weights(workdir, source.version, expected, shardings)
    except WeightMismatchError as e:
        whose = "this config" if source.step is None else "the run's checkpoint config"
        raise mismatch_error(workdir, source.version, whose, e) from None
    return jax.tree.unflatten(jax.tree.structure(target), [flat[k] for k in expected])


def load_source(config: Config, workdir: paths.PathLike, source: WeightSource, mesh: Mesh,
                role: Role, *, fsdp: bool | None = None) -> tuple[LoadedModel, int]:
    """(the model of ``source`` for ``role`` on ``mesh`` holding its weights, their weight
    version); ``skeleton`` + ``fill`` in one call."""
    return fill(config, workdir, source, skeleton(config, source, mesh, role, fsdp=fsdp))


def skeleton(config: Config, source: WeightSource, mesh: Mesh, role: Role, *,
             fsdp: bool | None = None) -> LoadedModel:
    """The abstract model of ``source`` for ``role``: architecture, tokenizer, shardings; no
    weights yet, so a job may check its inputs against the tokenizer before reading any."""
    return load(config, mesh, role, model=source.model, abstract=True, fsdp=fsdp)


def fill(config: Config, workdir: paths.PathLike, source: WeightSource, target: LoadedModel
         ) -> tuple[LoadedModel, int]:
    """(``target`` holding ``source``'s weights, their weight version): 0 for hf_path and
    random, the checkpoint state's, or the published version."""
    if source.kind in ("hf_path", "random"):
        return with_weights(target, config.trainer.seed), 0
    if source.kind == "checkpoint" and source.lora is not None:
        weights, version = lora_weights(workdir, source, target)
        return dataclasses.replace(target, params=weights.merged(), abstract=False), version
    if source.kind == "checkpoint":
        assert source.step is not None, source
        reader = CheckpointReader(paths.as_path(workdir) / "checkpoints")
        try:
            params, version = reader.params(source.step, target.params)
        finally:
            reader.close()
    else:
        params, version = _restore_version(workdir, source, target.params), source.version
    return dataclasses.replace(target, params=params, abstract=False), int(version)


def lora_weights(workdir: paths.PathLike, source: WeightSource, target: LoadedModel, *,
                 with_base: bool = True) -> tuple[LoraWeights, int]:
    """The adapters of a LoRA run's checkpoint ``source`` (``with_base``: and its base),
    placed like ``target``."""
    assert source.step is not None and source.lora is not None and source.base is not None
    return load_lora(workdir, source.step, source.lora, source.base if with_base else None,
                     target)


__all__ = ["Kind", "NEWEST", "WeightSource", "Wording", "fill", "load_source", "lora_weights",
           "mismatch_error", "resolve", "skeleton"]
