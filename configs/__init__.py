"""Config files (``get_config(arg)``) and the one typed schema.

Contract: ``from_config_dict`` (or ``load_config_file``) is the way from a ConfigDict to the
frozen ``Config``; a ``Config`` that exists has passed every rule that needs only the config
(field types and ranges in each section, cross-section rules in ``cross_section.py``), and a
broken rule is a ``ConfigError`` naming the field, the value and the rule. Rules that need files
or devices run in the jobs and in ``jobs.dispatch.dry_run``. Design: docs/architecture.md,
"Config validation".
"""

from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import base_config, from_config_dict, load_config_file, to_config_dict
from meshrl.configs.schema import (
    DCN_DATA_AXIS,
    MESH_AXES,
    CheckpointConfig,
    CompileConfig,
    Config,
    DataConfig,
    DistributedConfig,
    EvaluateConfig,
    ExportConfig,
    GenerateConfig,
    Job,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    RuntimeConfig,
    SamplerConfig,
    TrainerConfig,
)

__all__ = [
    "DCN_DATA_AXIS", "MESH_AXES", "CheckpointConfig", "CompileConfig", "Config", "ConfigError", "DataConfig", "DistributedConfig",
    "EvaluateConfig", "ExportConfig", "Job", "LoggingConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "RewardConfig",
    "RolloutConfig", "RuntimeConfig", "GenerateConfig", "SamplerConfig", "TrainerConfig", "base_config",
    "from_config_dict", "load_config_file", "to_config_dict",
]
