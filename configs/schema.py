"""The canonical, typed config schema of meshrl: the ``Job`` enum and the whole ``Config``.

Config files (``configs/*.py``) return an ``ml_collections.ConfigDict``; ``from_config_dict``
turns it into the frozen ``Config`` below and validates it (each section in its
``__post_init__``; rules across sections in ``Config.__post_init__``, see ``cross_section.py``).
The sections live by subsystem: ``mesh_schema`` (mesh, distributed), ``model_schema``,
``train_schema`` (optimizer, trainer, checkpoint, logging), ``sampler_schema``, ``rl_schema``
(rl, rollout, reward), ``data_schema``, ``runtime_schema``, and one module per job's own
section (``generate``, ``export``, ``evaluate``, ``compile``, ``dpo``) and ``distill_schema``
(on-policy distillation in the RL job). Every section is a frozen
dataclass whose fields are ordered: required, common optional, rare optional, internal; each
field carries its documentation and constraint in ``metadata``, from which
``scripts/gen_config_docs.py`` renders ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from meshrl.configs.agent_schema import AgentConfig, check_agent
from meshrl.configs.compile_schema import CompileConfig
from meshrl.configs.cross_section import validate_config
from meshrl.configs.data_schema import DataConfig
from meshrl.configs.distill_schema import DistillConfig, check_distill
from meshrl.configs.dpo_schema import DPOConfig
from meshrl.configs.evaluate_schema import EvaluateConfig
from meshrl.configs.export_schema import ExportConfig
from meshrl.configs.fields import ConfigError, Section
from meshrl.configs.generate_schema import GenerateConfig
from meshrl.configs.lora_schema import LoraConfig
from meshrl.configs.mesh_schema import DCN_DATA_AXIS, MESH_AXES, DistributedConfig, MeshConfig
from meshrl.configs.model_schema import DType, ModelConfig
from meshrl.configs.rl_schema import RewardConfig, RLConfig, RolloutConfig
from meshrl.configs.runtime_schema import RuntimeConfig
from meshrl.configs.sampler_schema import SamplerConfig
from meshrl.configs.train_schema import (
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    TrainerConfig,
)

# Re-exported: every section and constant is importable from here.
__all__ = [
    "DCN_DATA_AXIS", "MESH_AXES", "SECTIONS", "AgentConfig", "CheckpointConfig",
    "CompileConfig", "Config",
    "ConfigError", "DPOConfig", "DType", "DataConfig", "DistillConfig", "DistributedConfig",
    "EvaluateConfig", "ExportConfig", "Job", "LoggingConfig", "LoraConfig", "MeshConfig", "ModelConfig",
    "OptimizerConfig", "RLConfig", "RewardConfig", "RolloutConfig", "RuntimeConfig",
    "GenerateConfig", "SamplerConfig", "Section", "TrainerConfig",
]


class Job(str, enum.Enum):
    """What ``main.py`` runs."""

    SFT = "sft"  # supervised fine-tuning with masked next-token cross-entropy
    RL = "rl"  # asynchronous RL (GRPO/PPO family) with an in-process sampler (rl.placement)
    GENERATE = "generate"  # sample completions for prompts from a file
    EXPORT = "export"  # write a run's checkpoint or weight version as a HF checkpoint
    EVALUATE = "evaluate"  # evaluate each weight version an RL run publishes, as it appears
    COMPILE = "compile"  # compile compile.job's programs for a TPU topology or the local devices
    DPO = "dpo"  # preference training (DPO, IPO, SimPO) on (chosen, rejected) pairs


SECTIONS: dict[str, type[Section]] = {
    cls._section: cls
    for cls in (MeshConfig, ModelConfig, OptimizerConfig, TrainerConfig, SamplerConfig,
                RolloutConfig, RLConfig, RewardConfig, DataConfig, CheckpointConfig, LoggingConfig,
                DistributedConfig, RuntimeConfig, GenerateConfig, ExportConfig, EvaluateConfig,
                CompileConfig, DPOConfig, DistillConfig, AgentConfig, LoraConfig)
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole resolved config; build it with ``from_config_dict``."""

    job: Job
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    generate: GenerateConfig = dataclasses.field(default_factory=GenerateConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = dataclasses.field(default_factory=EvaluateConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        validate_config(self)  # the rules that span sections (configs/cross_section.py)
        check_distill(self)  # distill's rules with rl, rollout, model (configs/distill_schema.py)
        check_agent(self)  # agent's rules with rollout, sampler (configs/agent_schema.py)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job.value}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out
