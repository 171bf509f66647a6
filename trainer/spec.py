"""What one engine step is: the loss, the batch layout, how the pure step is built and how its
metrics are named. ``sft_spec`` and ``rl_spec`` are the two the jobs use; a new kind of step is
a new spec, not a new engine switch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from jax.sharding import Mesh

from meshrl.algorithms.batch import PreferenceBatch, RLTrainBatch, TrainBatch
from meshrl.algorithms.losses import LossFn, get_loss
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.algorithms.preference import NEEDS_REFERENCE, make_preference_loss_fn
from meshrl.algorithms.truncation import batch_fields
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.mesh import rules_for
from meshrl.trainer.reference import ref_fields
from meshrl.trainer.rl_step import make_rl_train_step, updates_per_step
from meshrl.trainer.step import StepBuilder, batch_shardings, make_train_step, row_buckets


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """``make_step(forward, loss_fn, tx, schedule)`` builds the pure step over batches laid out
    by ``batch_sh``; ``row_buckets``: compile one step per row count (packed RL batches) instead
    of one plain jitted step. Metric records name the step's metrics ``metric_prefix + name``;
    ``what`` names the loss in a non-finite error; ``updates_per_step``: optimizer updates per
    step (the learning-rate schedule then counts steps); ``trailing``: the dims after
    ``[rows, L]`` of the batch fields that have more (``{"routing": (layers, k)}``)."""

    loss_fn: LossFn
    batch_sh: TrainBatch
    make_step: StepBuilder
    row_buckets: tuple[int, ...] | None
    metric_prefix: str
    what: str
    updates_per_step: int
    trailing: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def rl_batch_size(config: Config) -> int:
    """Sequences per RL step: prompts (groups) times samples per prompt."""
    return config.rollout.prompts_per_step * config.rollout.group_size


def sft_spec(config: Config, mesh: Mesh) -> StepSpec:
    """SFT: ``TrainBatch``es of ``trainer.batch_size x trainer.seq_len``, the token-mean
    cross-entropy, ``trainer.microbatches`` gradient accumulation."""
    t = config.trainer
    return StepSpec(
        loss_fn=get_loss("sft"),
        batch_sh=batch_shardings(mesh, rules_for("train", config.mesh.fsdp), t.batch_size,
                                 t.seq_len),
        make_step=functools.partial(make_train_step, microbatches=t.microbatches),
        row_buckets=None, metric_prefix="", what="loss", updates_per_step=1)


def rl_spec(config: Config, mesh: Mesh, routing: tuple[int, int] | None = None) -> StepSpec:
    """RL: ``RLTrainBatch``es of ``rl_batch_size x trainer.seq_len`` (with ``ref_logprobs`` when
    the KL is in the loss; with ``routing``, the loaded model's ``(layers, k)`` when
    ``rl.routing_replay = 'rollout'``, the replayed experts), one compiled step per packed row
    bucket, ``rl.ppo_minibatches x rl.ppo_epochs`` updates a step, metrics as ``train/*``."""
    t = config.trainer
    B = rl_batch_size(config)
    replay = ("routing",) if routing is not None else ()
    batch_sh = batch_shardings(mesh, rules_for("train", config.mesh.fsdp), B, t.seq_len,
                               RLTrainBatch, *ref_fields(config.rl),
                               *batch_fields(config.sampler), *replay)
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
    T, cap = config.sampler.temperature, config.sampler.top_k
    return StepSpec(
        loss_fn=make_rl_loss_fn(config.rl, temperature=T, kept_cap=cap), batch_sh=batch_sh,
        make_step=functools.partial(make_rl_train_step, rl=config.rl, temperature=T,
                                    microbatches=t.microbatches, kept_cap=cap),
        row_buckets=buckets, metric_prefix="train/", what="RL loss",
        updates_per_step=updates_per_step(config.rl),
        trailing={} if routing is None else {"routing": routing})


def dpo_spec(config: Config, mesh: Mesh) -> StepSpec:
    """Preference training: ``PreferenceBatch``es of ``trainer.batch_size`` rows (``batch_size
    / 2`` (chosen, rejected) pairs in adjacent rows, see ``PreferenceBatch``) x
    ``trainer.seq_len``, with ``ref_logprobs`` when ``dpo.loss`` reads the reference; the loss
    of ``dpo.loss`` averaged over pairs. Strided microbatches would split the pairs, so the
    step takes the whole batch (``trainer.microbatches`` must be 1)."""
    t, d = config.trainer, config.dpo  # an even batch, no microbatches: configs/cross_section.py
    optional = ("ref_logprobs",) if d.loss in NEEDS_REFERENCE else ()
    return StepSpec(
        loss_fn=make_preference_loss_fn(d.loss, beta=d.beta, label_smoothing=d.label_smoothing,
                                        gamma=d.simpo_gamma),
        batch_sh=batch_shardings(mesh, rules_for("train", config.mesh.fsdp), t.batch_size,
                                 t.seq_len, PreferenceBatch, *optional),
        make_step=make_train_step, row_buckets=None, metric_prefix="", what="preference loss",
        updates_per_step=1)
