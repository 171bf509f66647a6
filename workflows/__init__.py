"""Async rollout episodes (single-turn RLVR, multi-turn), staleness control, the rollout runner
and the one ``RolloutBatch`` struct that crosses to the trainer."""

from meshrl.workflows.batch import (
    RolloutBatch,
    Trajectory,
    bucket_length,
    build_rollout_batch,
    pack_rows,
)
from meshrl.workflows.episode import (
    Environment,
    EnvStep,
    EpisodeSettings,
    RewardScorer,
    SamplerClient,
    arun_episode,
    arun_group,
)
from meshrl.workflows.runner import (
    PromptsExhaustedError,
    RolloutFailedError,
    RolloutRunner,
    group_episode_fn,
)
from meshrl.workflows.setup import episode_settings, make_rollout_batch, make_runner
from meshrl.workflows.staleness import StalenessController

__all__ = [
    "SamplerClient", "EnvStep", "Environment", "EpisodeSettings", "PromptsExhaustedError",
    "RewardScorer", "RolloutBatch", "RolloutFailedError", "RolloutRunner", "StalenessController",
    "Trajectory", "arun_episode", "arun_group", "bucket_length", "build_rollout_batch",
    "episode_settings", "group_episode_fn", "make_rollout_batch", "make_runner", "pack_rows",
]
