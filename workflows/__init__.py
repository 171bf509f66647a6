"""Async rollout episodes (single-turn RLVR, multi-turn), staleness control, the rollout runner,
held-out evaluation, and the builder of the one ``RLTrainBatch`` that crosses to the trainer."""

from meshrl.workflows.batch import (
    Trajectory,
    build_rl_batch,
    pack_rows,
    rows_needed,
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
from meshrl.workflows.setup import episode_settings, make_rl_batch, make_runner
from meshrl.workflows.staleness import StalenessController

__all__ = [
    "SamplerClient", "EnvStep", "Environment", "EpisodeSettings", "PromptsExhaustedError",
    "RewardScorer", "RolloutFailedError", "RolloutRunner", "StalenessController",
    "Trajectory", "arun_episode", "arun_group", "build_rl_batch",
    "episode_settings", "group_episode_fn", "make_rl_batch", "make_runner", "pack_rows", "rows_needed",
]
