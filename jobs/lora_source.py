"""The weights of a LoRA run's checkpoint: its adapters and the base they adapt.

A LoRA run's train state holds only the adapters; the base is what the run's saved config
names: ``model.hf_path`` (kind ``hf_path``), else for the RL job the final checkpoint of its
SFT warm start under ``<workdir>/sft`` (``warm_start``, when the run warm-started), else the
random init of its ``trainer.seed`` (``random``). Only an ``hf_path`` base is a Hugging Face
directory that a PEFT adapter can name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from meshrl.configs.fields import ConfigError
from meshrl.configs.lora_schema import LoraConfig
from meshrl.models.load import LoadedModel, with_weights
from meshrl.models.lora import Adapters, LoraSetup
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.trainer.engine import expand_prefix
from meshrl.utils import paths


@dataclasses.dataclass(frozen=True)
class LoraBase:
    """The base of a LoRA run: its ``kind``, the seed of a random one, the warm start's step."""

    kind: Literal["hf_path", "warm_start", "random"]
    seed: int
    step: int | None = None

    def describe(self, hf_path: str) -> str:
        if self.kind == "hf_path":
            return f"model.hf_path {hf_path}"
        if self.kind == "warm_start":
            return f"the SFT warm start's checkpoint step {self.step} under <workdir>/sft"
        return f"the random init of trainer.seed = {self.seed}"


def warm_start_dir(workdir: paths.PathLike) -> Any:
    return paths.as_path(workdir) / "sft" / "checkpoints"


def finished_warm_start(workdir: paths.PathLike) -> int | None:
    """The step of the RL run's SFT warm start's last verified checkpoint under ``workdir``
    (None: none): once RL has a checkpoint, the warm start it started from ended there."""
    reader = CheckpointReader(warm_start_dir(workdir))
    try:
        return reader.latest_step()
    finally:
        reader.close()


def base_of(run: dict[str, Any], workdir: paths.PathLike, where: str) -> LoraBase:
    """The base of the run whose saved config is ``run`` (``where``: its checkpoint, for the
    error line). An RL run without ``model.hf_path`` warm-starts when its warm start has steps
    (the rule of ``jobs.rl_setup.warm_start_steps``); that base must still be on disk."""
    seed = int(run.get("trainer", {}).get("seed", 0))
    if run.get("model", {}).get("hf_path"):
        return LoraBase("hf_path", seed)
    rl = run.get("rl") or {}
    steps = rl.get("warm_start_steps", 0)
    steps = run.get("trainer", {}).get("steps", 0) if steps == -1 else steps
    if run.get("job") != "rl" or not steps:
        return LoraBase("random", seed)
    step = finished_warm_start(workdir)
    if step is None:
        raise ConfigError(f"{where}: its LoRA adapters adapt the SFT warm start, and "
                          f"{warm_start_dir(workdir)} holds no verified checkpoint of it: "
                          f"pass the run's whole workdir as --workdir")
    return LoraBase("warm_start", seed, step)


@dataclasses.dataclass
class LoraWeights:
    """A LoRA checkpoint, placed: the base model, the setup bound to it, the adapters."""

    base: LoadedModel
    setup: LoraSetup
    adapters: Adapters

    def merged(self) -> Any:
        """The full params the run's sampler saw: the (possibly quantised) frozen base plus
        the scaled adapters, in the base's placement."""
        return self.setup.merged(self.setup.freeze(self.base.params), self.adapters)


def load_lora(workdir: paths.PathLike, step: int, lora: LoraConfig, base: LoraBase | None,
              target: LoadedModel) -> tuple[LoraWeights, int]:
    """(the adapters of checkpoint ``step`` with their ``base``, placed in ``target``'s
    shardings; the checkpoint's weight version). ``base = None``: the adapters alone (the
    returned base stays ``target``, abstract)."""
    loaded = target if base is None else _base_params(workdir, base, target)
    setup = LoraSetup(lora, loaded.graphdef, loaded.params,
                      expand_prefix(loaded.shardings, loaded.params))
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            setup.abstract_adapters(), setup.adapter_sh)
    reader = CheckpointReader(paths.as_path(workdir) / "checkpoints")
    try:
        adapters, version = reader.params(step, abstract)
    finally:
        reader.close()
    return LoraWeights(loaded, setup, adapters), version


def _base_params(workdir: paths.PathLike, base: LoraBase, target: LoadedModel) -> LoadedModel:
    if base.kind != "warm_start":
        return with_weights(target, base.seed)  # model.hf_path's weights, or the random init
    reader = CheckpointReader(warm_start_dir(workdir))
    try:
        params, _ = reader.params(base.step, target.params)
    finally:
        reader.close()
    return dataclasses.replace(target, params=params, abstract=False)


__all__ = ["LoraBase", "LoraWeights", "base_of", "load_lora"]
