"""Setup of the RL job: batch size, the SFT warm start that gives RL a mediocre rather than a
random policy (``docs/rl.md``), and the training engine of the RL step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from etils import epath

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.losses import get_loss
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config, Job
from meshrl.datasets import make_sft_iterator
from meshrl.mesh import rules_for
from meshrl.trainer.engine import Trainee, TrainEngine
from meshrl.trainer.reference import ref_fields
from meshrl.trainer.rl_step import make_rl_train_step, updates_per_step
from meshrl.trainer.step import batch_shardings, row_buckets
from meshrl.trainer.stop import stop_hook
from meshrl.utils import log as log_lib

log = log_lib.get_logger("rl")


def rl_batch_size(config: Config) -> int:
    """Sequences per optimizer step: prompts (groups) times samples per prompt."""
    return config.rollout.prompts_per_step * config.rollout.group_size


def warm_start_steps(config: Config) -> int:
    """SFT steps before RL: none for a pretrained model (``model.hf_path``), else
    ``rl.warm_start_steps`` with -1 meaning as many as ``trainer.steps``."""
    if config.model.hf_path:
        return 0
    n = config.rl.warm_start_steps
    return config.trainer.steps if n == -1 else n


def warm_start_config(config: Config, steps: int) -> Config:
    """The SFT config of the warm start: ``steps`` steps of AdamW at peak rate
    ``rl.warm_start_lr``, no held-out evaluation, no Weights & Biases run (the RL run is the
    one a user follows there; the warm start's curves stay in <workdir>/sft) and no profiler
    trace (``logging.profile_steps`` names RL steps); every other field as in ``config``."""
    t = config.trainer
    return dataclasses.replace(
        config, job=Job.SFT,
        trainer=dataclasses.replace(t, steps=steps, eval_every=0,
                                    learning_rate=config.rl.warm_start_lr),
        optimizer=dataclasses.replace(config.optimizer, name="adamw"),
        logging=dataclasses.replace(config.logging, wandb_project="", profile_steps=()))


def run_warm_start(config: Config, workdir: epath.Path, mesh: Any, trainee: Trainee,
                   tokenizer: Any, steps: int) -> Any:
    """``steps`` of SFT under ``<workdir>/sft`` (resumable; a finished one is only restored);
    returns the final params."""
    t = config.trainer
    sft = warm_start_config(config, steps)
    data = make_sft_iterator(config.data, tokenizer, batch_size=t.batch_size, seq_len=t.seq_len,
                             seed=t.seed, process_index=jax.process_index(),
                             process_count=jax.process_count(), pack=config.data.pack)
    (workdir / "sft").mkdir(parents=True, exist_ok=True)
    log.info("SFT warm start: %d steps of %d x %d tokens under %s", steps, t.batch_size,
             t.seq_len, workdir / "sft")
    engine = TrainEngine(sft, workdir / "sft", mesh, trainee, get_loss("sft"))
    try:
        engine.start(data=data)
        engine.run_sft(hooks=[stop_hook])
        return engine.params
    finally:
        engine.close()


def rl_engine(config: Config, workdir: epath.Path, mesh: Any, trainee: Trainee
              ) -> TrainEngine:
    """The engine of the RL step: ``RLTrainBatch``es of ``rl_batch_size x trainer.seq_len`` (with
    ``ref_logprobs`` when the KL is in the loss), one compiled step per packed row bucket,
    metrics as ``train/*`` (the job adds ``rollout/*``, ``perf/*``)."""
    t = config.trainer
    B = rl_batch_size(config)
    batch_sh = batch_shardings(mesh, rules_for("train", config.mesh.fsdp), B, t.seq_len,
                               RLTrainBatch, *ref_fields(config.rl))
    rows_per_shard = batch_sh.input_ids.shard_shape((B, t.seq_len))[0]
    # Every bucket splits into rl.ppo_minibatches minibatches of trainer.microbatches
    # microbatches, each spread over all data shards.
    split = t.microbatches * config.rl.ppo_minibatches
    buckets = (row_buckets(B, B // rows_per_shard * split)
               if config.rl.pack_sequences else (B,))
    if bad := [r for r in buckets if r % split]:  # the cross-section rule makes this unreachable
        raise ConfigError(f"rl.ppo_minibatches = {config.rl.ppo_minibatches}: packed row "
                          f"buckets {bad} are not divisible by rl.ppo_minibatches * "
                          f"trainer.microbatches = {split}")
    T = config.sampler.temperature
    return TrainEngine(config, workdir, mesh, trainee, make_rl_loss_fn(config.rl, temperature=T),
                       batch_sh=batch_sh, row_buckets=buckets, metric_prefix="train/",
                       step_timing=False, rate_key="perf/tokens_per_s", what="RL loss",
                       make_step=functools.partial(make_rl_train_step, rl=config.rl,
                                                   temperature=T, microbatches=t.microbatches),
                       updates_per_step=updates_per_step(config.rl))
