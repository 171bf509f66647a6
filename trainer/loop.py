"""The training loop: data -> sharded batch -> jitted step -> metrics one step late -> checkpoints.

The loop coordinates; the math lives in ``step.py``. The host never waits on the step it just
dispatched: it reads the *previous* step's scalar metrics while the current one runs, and step
dispatch runs under ``jax.transfer_guard("disallow")`` so an accidental host<->device copy in the
hot path fails loudly instead of silently stalling.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshrl.algorithms.losses import LossFn
from meshrl.configs.schema import Config
from meshrl.mesh import rules_for
from meshrl.trainer.checkpoint import Checkpointer
from meshrl.trainer.metrics import MetricsWriter, peak_flops_per_device
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.progress import Progress
from meshrl.trainer.state import TrainState, abstract_state, init_state, state_shardings
from meshrl.trainer.step import ForwardFn, batch_shardings, jit_train_step, make_train_step
from meshrl.utils.log import get_logger

_log = get_logger("trainer")
BATCH_KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")


class NonFiniteLossError(FloatingPointError):
    """A step produced a non-finite loss or gradient norm with ``trainer.on_nonfinite="raise"``."""


def read_step_metrics(metrics: dict[str, jax.Array], step: int, on_nonfinite: str,
                      what: str = "loss") -> dict[str, float]:
    """Fetch a finished step's metrics to the host and act on a non-finite step: raise
    ``NonFiniteLossError`` (``on_nonfinite == "raise"``) or log that the update was skipped.
    The step itself never applied a non-finite update (see ``trainer.step``)."""
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not values["finite"]:
        if on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"non-finite {what} at step {step}: loss={values['loss']}, "
                f"grad_norm={values['grad_norm']} (the update was not applied; set "
                f"trainer.on_nonfinite='skip' to skip such steps)")
        _log.warning("non-finite %s at step %d: update skipped (%d skipped so far)", what, step,
                     int(values["skipped"]))
    return values


class DataIterator(Protocol):
    def __next__(self) -> dict[str, np.ndarray]: ...
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class Trainee:
    """What the loop trains: a pure forward over a params pytree and that pytree's placement."""

    forward: ForwardFn
    params: Any  # already placed with ``params_shardings``
    params_shardings: Any  # a prefix of ``params`` (e.g. one sharding per nnx Variable)
    flops_per_token: float  # training FLOPs per token (6N + attention)


Hook = Callable[[int, "Loop"], None]


def expand_prefix(prefix_tree: Any, full_tree: Any) -> Any:
    """Repeat each leaf of ``prefix_tree`` over the matching subtree of ``full_tree`` (e.g. one
    sharding per nnx Variable -> the Variable's value), so both trees have one structure."""
    return jax.tree.map(lambda leaf, sub: jax.tree.map(lambda _: leaf, sub), prefix_tree,
                        full_tree)


def put_batch(batch_np: dict[str, np.ndarray], shardings: dict[str, NamedSharding]
              ) -> dict[str, jax.Array]:
    """Host batch (this process's rows) -> global arrays laid out by ``shardings``."""
    return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(batch_np[k]))
            for k in shardings}


@dataclasses.dataclass
class Loop:
    """Owns the compiled step, the state, the checkpointer and the metric sinks of one run."""

    config: Config
    workdir: pathlib.Path
    mesh: Mesh
    trainee: Trainee
    data: DataIterator
    loss_fn: LossFn
    state: TrainState = dataclasses.field(init=False)
    start_step: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.workdir = pathlib.Path(self.workdir)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.trainer.learning_rate,
                                                cfg.trainer.steps)
        params_sh = expand_prefix(self.trainee.params_shardings, self.trainee.params)
        self.state_sh = state_shardings(params_sh, self.tx, self.mesh, self.trainee.params)
        rules = rules_for("train", cfg.mesh.fsdp)
        self.batch_sh = batch_shardings(self.mesh, rules, cfg.trainer.batch_size,
                                        cfg.trainer.seq_len, BATCH_KEYS)
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", cfg.checkpoint,
                                         process_index=jax.process_index())
        target = abstract_state(self.state_sh, self.trainee.params, self.tx, cfg.trainer.seed)
        try:
            restored = self.checkpointer.restore_latest(target)
        except BaseException:
            self.checkpointer.close()  # no orphaned Orbax threads when resume is refused
            raise
        if restored is None:
            self.state = jax.jit(lambda p: init_state(p, self.tx, cfg.trainer.seed),
                                 out_shardings=self.state_sh)(self.trainee.params)
            self.start_step = 0
        else:
            self.state = restored.state
            self.data.set_state(restored.data)
            self.start_step = int(restored.counters["step"])
            _log.info("resuming at step %d", self.start_step)
        self.trainee.params = None  # the state owns the params now (they get donated)
        step_fn = make_train_step(self.trainee.forward, self.loss_fn, self.tx, self.schedule,
                                  microbatches=cfg.trainer.microbatches)
        self.step_fn = jit_train_step(step_fn, self.state_sh, self.batch_sh, self.mesh)
        self.metrics = MetricsWriter(self.workdir, tensorboard=cfg.logging.tensorboard,
                                     process_index=jax.process_index(),
                                     resume_step=None if restored is None else self.start_step)
        self.history: list[dict[str, float]] = []
        self._pending: tuple[int, dict[str, jax.Array], float] | None = None
        self._last_done: float | None = None
        self._excluded = 0.0
        self._peak = 0.0
        self._tokens_per_step = cfg.trainer.batch_size * cfg.trainer.seq_len

    # -- metrics, one step late ------------------------------------------------------------

    def _flush(self) -> None:
        """Read the pending step's metrics (it has finished or is about to), check, record."""
        if self._pending is None:
            return
        step, metrics, dispatched = self._pending
        self._pending = None
        values = read_step_metrics(metrics, step, self.config.trainer.on_nonfinite)
        now = time.perf_counter()
        # Steady-state step time is the gap between completions; the first step after (re)start
        # is timed from its dispatch and includes compilation.
        step_time = now - (self._last_done if self._last_done is not None else dispatched)
        # Host work between steps (checkpoint starts, eval hooks) is not the step's time.
        step_time = max(step_time - self._excluded, 1e-9)
        self._last_done, self._excluded = now, 0.0
        tok_s = self._tokens_per_step / max(step_time, 1e-9)
        flops_s = self.trainee.flops_per_token * tok_s
        mfu = flops_s / (self._peak * self.mesh.devices.size) if self._peak else 0.0
        record = {**{k: v for k, v in values.items() if k not in ("step", "finite")},
                  "step_time_s": step_time, "tokens_per_s": tok_s, "model_flops_per_s": flops_s,
                  "mfu": mfu}
        self.history.append({"step": step, **record})
        if step % self.config.trainer.log_every == 0 or step == self.config.trainer.steps:
            self.metrics.write(step, record)
        self.progress.update(step, values["loss"], tok_s)

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, step: int) -> None:
        self._flush()  # a checkpoint never holds an update whose metrics were not checked
        t0 = time.perf_counter()
        self.checkpointer.save(step, self.state, self.data.get_state(), self.config.to_dict(),
                               {"step": step})
        self._excluded += time.perf_counter() - t0

    # -- the loop ----------------------------------------------------------------------------

    def run(self, hooks: Sequence[Hook] = ()) -> list[dict[str, float]]:
        cfg = self.config.trainer
        self._peak = peak_flops_per_device(cfg.peak_flops)
        every = self.config.checkpoint.every_steps
        self.progress = Progress(cfg.steps, self.start_step,
                                 enabled=self.config.logging.progress_bar and
                                 jax.process_index() == 0)
        it: Iterator[dict[str, np.ndarray]] = self.data
        for step in range(self.start_step + 1, cfg.steps + 1):
            batch = put_batch(next(it), self.batch_sh)
            dispatched = time.perf_counter()
            with jax.transfer_guard("disallow"):
                self.state, metrics = self.step_fn(self.state, batch)
            self._flush()  # the previous step's metrics, while this one runs
            self._pending = (step, metrics, dispatched)
            if every and step % every == 0 and step != cfg.steps:
                self.save(step)
            t_hooks = time.perf_counter()
            for hook in hooks:
                hook(step, self)
            self._excluded += time.perf_counter() - t_hooks
        self._flush()
        if cfg.steps > self.start_step or not self.checkpointer.all_steps():
            self.save(cfg.steps)
        self.checkpointer.wait()
        self.progress.close()
        return self.history

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
