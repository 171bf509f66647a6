"""The training engine: train state, optimizer, the jitted train step, checkpoints, metrics."""

from meshrl.trainer.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    Restored,
    verify_step_dir,
)
from meshrl.trainer.loop import (
    BATCH_KEYS,
    Loop,
    NonFiniteLossError,
    Trainee,
    expand_prefix,
    put_batch,
)
from meshrl.trainer.optimizer import decay_mask, make_optimizer, make_schedule
from meshrl.trainer.state import TrainState, abstract_state, init_state, state_shardings
from meshrl.trainer.step import batch_shardings, jit_train_step, make_train_step

__all__ = [
    "BATCH_KEYS", "CheckpointMismatchError", "Checkpointer", "Loop", "NonFiniteLossError",
    "Restored", "Trainee", "TrainState", "abstract_state", "batch_shardings", "decay_mask",
    "expand_prefix", "init_state", "jit_train_step", "make_optimizer", "make_schedule",
    "make_train_step", "put_batch", "state_shardings", "verify_step_dir",
]
