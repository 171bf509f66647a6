"""The training sections every training job reads: the optimizer, the trainer loop
(``trainer``), checkpoints and logging."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
    in_unit_interval,
)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    _section = "optimizer"
    name: Literal["adamw", "sgd", "adafactor"] = field("adamw", "Optimizer.")
    schedule: Literal["constant", "cosine", "linear"] = field(
        "cosine", "Learning-rate decay after warmup.")
    warmup_steps: int = field(0, "Linear warmup steps from 0 to trainer.learning_rate "
                                 "(a run of fewer trainer.steps warms up over all of them).",
                              at_least(0))
    weight_decay: float = field(0.0, "Decoupled weight decay (never applied to norms or biases).",
                                at_least(0.0))
    grad_clip_norm: float = field(1.0, "Global-norm gradient clipping; 0 disables.", at_least(0.0))
    b1: float = field(0.9, "Adam beta1.", in_unit_interval())
    b2: float = field(0.95, "Adam beta2.", in_unit_interval())
    eps: float = field(1e-8, "Adam epsilon.", at_least(0.0))
    momentum: float = field(0.0, "SGD momentum; 0 is plain SGD.", in_unit_interval())
    min_lr_ratio: float = field(0.0, "Final learning rate as a fraction of the peak.",
                                at_least(0.0))


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    _section = "trainer"
    learning_rate: float = field(1e-3, "Peak learning rate.", at_least(0.0))
    steps: int = field(100, "Optimizer steps to run.", at_least(0))
    batch_size: int = field(8, "Global sequences per optimizer step of job = sft, dpo; job = rl "
                                "reads rollout.* and rl.warm_start_batch_size instead and needs "
                                "the default.", at_least(1))
    seq_len: int = field(128, "Training sequence length (tokens).", at_least(2))
    seed: int = field(0, "Seed of params init, dropout-free RNG stream and data order.")
    microbatches: int = field(1, "Gradient-accumulation microbatches per step; must divide "
                                 "the step's batch.", at_least(1))
    log_every: int = field(10, "Steps between metric writes (and RL console step lines); a "
                               "run's first step is written too.",
                           at_least(1))
    eval_every: int = field(0, "Steps between held-out evaluations; 0 disables.", at_least(0))
    on_nonfinite: Literal["raise", "skip"] = field(
        "raise", "A non-finite loss raises, or skips the update and counts it.")
    peak_flops: float = field(0.0, "Peak FLOP/s per device for MFU; 0 looks up the device "
                                   "kind's spec-sheet peak at model.compute_dtype (measures an "
                                   "f32 matmul on a CPU).",
                              at_least(0.0))
    logits_chunk: int = field(
        1024, "Tokens (rows x positions, whole microbatch) whose float32 logits the loss, "
              "the KL reference and the eval compute at a time; the backward pass recomputes "
              "each chunk's logits instead of keeping them. 0: all at once (full [B, L, V] "
              "float32 logits). See docs/memory.md.", at_least(0))



@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    _section = "checkpoint"
    every_steps: int = field(50, "Steps between checkpoints; 0 saves only at the end.",
                             at_least(0))
    keep: int = field(3, "Checkpoints kept.", at_least(1))
    async_save: bool = field(True, "Write checkpoints in the background.")
    publish_every: int = field(10, "Steps between Orbax weight versions for the sampler.",
                               at_least(1))
    keep_versions: int = field(
        3, "Published weight versions kept under <workdir>/weights: the newest ones up to the "
           "version just published; older ones are renamed aside and deleted once the new one "
           "is complete. 0 keeps all (an evaluate job that may fall behind needs 0 or enough).",
        at_least(0))
    on_unverified: Literal["stop", "restart"] = field(
        "stop", "When checkpoints exist but none matches its manifest: stop (nothing moved or "
                "deleted) or restart (move them all aside as corrupt.<step>.<ns> and train from "
                "scratch in this workdir).")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    _section = "logging"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = field("INFO", "Log level.")
    tensorboard: bool = field(True, "Write tensorboardX events under <workdir>/tb (process 0).")
    progress_bar: bool = field(True, "Show a progress bar on process 0.")
    profile_steps: tuple[int, ...] = field(
        (), "(first, last): write a jax.profiler trace of training steps first..last "
            "(inclusive; for RL its own steps, not the warm start) under "
            "<workdir>/profile/process_<i> (TensorBoard's profile plugin, Perfetto); (): none.")
    wandb_project: str = field("", "Also log metrics to this Weights & Biases project from "
                                   "process 0 (needs the wandb extra); empty: off.")
    wandb_run_name: str = field("", "The Weights & Biases run name; empty: the workdir's name.")

    def validate(self) -> None:
        p = self.profile_steps
        if p and (len(p) != 2 or not 1 <= p[0] <= p[1]):
            raise ConfigError(f"logging.profile_steps = {p}: must be () or (first, last) with "
                              f"1 <= first <= last")
