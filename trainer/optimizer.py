"""Optimizer and learning-rate schedule built from ``OptimizerConfig`` with optax.

Every optimizer is one optax chain: global-norm clipping, the update rule, decoupled weight decay
masked off norms and biases, then the scheduled learning rate. The schedule is returned too, so the
train step can report the rate it applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from meshrl.configs.schema import OptimizerConfig
from meshrl.utils.params import path_name

Schedule = Callable[[Any], Any]
_NO_DECAY_NAMES = ("norm", "bias", "scale", "ln_")


def make_schedule(cfg: OptimizerConfig, learning_rate: float, total_steps: int) -> Schedule:
    """Linear warmup from 0 to ``learning_rate`` over ``cfg.warmup_steps``, then ``cfg.schedule``
    down to ``cfg.min_lr_ratio * learning_rate`` at ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    end = learning_rate * cfg.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(learning_rate)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, decay_steps,
                                            alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(learning_rate, end, decay_steps)
    else:  # the schema's Literal makes this unreachable; keep the error explicit anyway
        raise ValueError(f"optimizer.schedule = {cfg.schedule!r}: unknown")
    if warmup == 0:
        return after
    return optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: matrices (ndim >= 2) whose path names no norm or bias.

    Norm scales and biases are vectors, so ndim alone mostly decides; the name check also catches
    e.g. stacked (scanned) per-layer norm scales, which are 2-D.
    """
    def keep(path: tuple[Any, ...], x: Any) -> bool:
        name = path_name(path).lower()
        return x.ndim >= 2 and not any(n in name for n in _NO_DECAY_NAMES)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig, learning_rate: float, total_steps: int,
                   updates_per_step: int = 1) -> tuple[optax.GradientTransformation, Schedule]:
    """``(tx, schedule)`` for ``cfg``; ``tx.update`` needs ``params`` (weight decay).

    ``schedule`` is indexed by train step. With ``updates_per_step > 1`` (the RL job's PPO
    minibatches x epochs) every update of a train step applies that step's rate, as in verl:
    warmup and decay count train steps (rollout batches), not updates."""
    if updates_per_step < 1:
        raise ValueError(f"updates_per_step = {updates_per_step}: must be >= 1")
    schedule = make_schedule(cfg, learning_rate, total_steps)
    # optax counts applied updates; 1 keeps the schedule itself (bitwise the old optimizer).
    by_update = schedule if updates_per_step == 1 else (
        lambda count: schedule(count // updates_per_step))
    parts: list[optax.GradientTransformation] = []
    if cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    if cfg.name == "adamw":
        parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    elif cfg.name == "sgd":
        if cfg.momentum > 0:
            parts.append(optax.trace(decay=cfg.momentum))
    elif cfg.name == "adafactor":
        # Relative step sizes off: the schedule above is the one learning rate of the run.
        parts.append(optax.scale_by_factored_rms(decay_rate=0.8, epsilon=1e-30))
        parts.append(optax.clip_by_block_rms(1.0))
    else:
        raise ValueError(f"optimizer.name = {cfg.name!r}: unknown")
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    parts.append(optax.scale_by_learning_rate(by_update))
    return optax.chain(*parts), schedule
