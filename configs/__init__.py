"""Config files (``get_config(arg)``) and the canonical typed schema."""

from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import base_config, from_config_dict, load_config_file, to_config_dict
from meshrl.configs.schema import (
    MESH_AXES,
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    Job,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    SampleConfig,
    SamplerConfig,
    TrainerConfig,
)

__all__ = [
    "MESH_AXES", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistributedConfig",
    "Job", "LoggingConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "RewardConfig",
    "RolloutConfig", "SampleConfig", "SamplerConfig", "TrainerConfig", "base_config",
    "from_config_dict", "load_config_file", "to_config_dict",
]
