"""The training engine: train state, optimizer, the jitted train step, checkpoints, metrics."""

from meshrl.trainer.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    Restored,
    verify_step_dir,
)
from meshrl.trainer.engine import (
    NonFiniteLossError,
    Trainee,
    TrainEngine,
    expand_prefix,
    put_batch,
)
from meshrl.trainer.optimizer import decay_mask, make_optimizer, make_schedule
from meshrl.trainer.state import TrainState, abstract_state, init_state, state_shardings
from meshrl.trainer.step import (
    batch_shardings,
    decoder_forward,
    jit_leaf_step,
    jit_train_step,
    make_train_step,
)

__all__ = [
    "CheckpointMismatchError", "Checkpointer", "NonFiniteLossError", "Restored",
    "TrainEngine", "TrainState", "Trainee", "abstract_state",
    "batch_shardings", "decay_mask", "decoder_forward", "expand_prefix",
    "init_state", "jit_leaf_step", "jit_train_step", "make_optimizer", "make_schedule",
    "make_train_step", "put_batch", "state_shardings", "verify_step_dir",
]
