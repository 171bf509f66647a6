"""The training engine the SFT and RL loops drive: init-or-restore, the compiled step, metrics
one step late, checkpoints and weight publication. It has no loop of its own.

The engine coordinates; the math lives in ``step.py``. The host never waits on the step it just
dispatched: it reads the *previous* step's scalar metrics while the current one runs, and step
dispatch runs under ``jax.transfer_guard("disallow")`` so an accidental host<->device copy in the
hot path fails loudly instead of silently stalling.

Life of an engine: ``TrainEngine(...)`` restores the newest verified checkpoint onto the
abstract state (``restored``, ``start_step``), ``start(params)`` takes the restored state or
initialises one on the state shardings, then per step ``dispatch`` (which returns the previous
step's metrics), ``read`` (the step just dispatched), ``log``, ``save`` and ``publish``;
``finish`` waits for pending saves, ``close`` releases all.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from meshrl.algorithms.batch import TrainBatch
from meshrl.configs.schema import Config
from meshrl.inference.published import publish_version, retire_versions_after
from meshrl.mesh import check_process_rows
from meshrl.models import LoadedModel, flops_per_token
from meshrl.models.lora import AdapterUpdate, LoraSetup
from meshrl.trainer.checkpoint import Checkpointer, Restored
from meshrl.trainer.metrics import MetricsWriter
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.profile import ProfileWindow
from meshrl.trainer.progress import Progress
from meshrl.trainer.resume_check import check_resume
from meshrl.trainer.spec import StepSpec
from meshrl.trainer.state import TrainState, abstract_state, init_state, state_shardings
from meshrl.trainer.step import BucketedStep, ForwardFn, decoder_forward, jit_leaf_step
from meshrl.trainer.wandb_sink import wandb_sink
from meshrl.utils import paths
from meshrl.utils.log import get_logger
from meshrl.utils.watchdog import Watchdog

_log = get_logger("trainer")
HISTORY_MAX = 10_000  # records in ``history``: bounded host memory; benchmarks read far fewer


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
    """What the engine trains: a pure forward over a params pytree and that pytree's placement."""

    forward: ForwardFn
    params: Any  # already placed with ``params_shardings``
    params_shardings: Any  # a prefix of ``params`` (e.g. one sharding per nnx Variable)
    flops_per_token: float  # training FLOPs per token (6N + attention)
    # With LoRA the state trains ``lora``'s adapters over a frozen copy of ``params``; ``forward``
    # and ``params`` stay the full model's (what a reference or an evaluation runs).
    lora: LoraSetup | None = None

    @classmethod
    def of(cls, loaded: LoadedModel, config: Config) -> Trainee:
        """The trainee of a model loaded for the train role (``models.load``)."""
        t = config.trainer
        lora = (LoraSetup(config.lora, loaded.graphdef, loaded.params,
                          expand_prefix(loaded.shardings, loaded.params))
                if config.lora.rank > 0 else None)
        return cls(forward=decoder_forward(loaded.graphdef, t.logits_chunk),
                   params=loaded.params, params_shardings=loaded.shardings,
                   flops_per_token=flops_per_token(loaded.arch, t.seq_len), lora=lora)



def expand_prefix(prefix_tree: Any, full_tree: Any) -> Any:
    """Repeat each leaf of ``prefix_tree`` over the matching subtree of ``full_tree`` (e.g. one
    sharding per nnx Variable -> the Variable's value), so both trees have one structure."""
    return jax.tree.map(lambda leaf, sub: jax.tree.map(lambda _: leaf, sub), prefix_tree,
                        full_tree)


def put_batch(host: TrainBatch, shardings: TrainBatch) -> TrainBatch:
    """Host batch (this process's rows) -> global arrays laid out by ``shardings`` (a batch of
    the same type and set fields)."""
    return jax.tree.map(lambda sh, x: jax.make_array_from_process_local_data(sh, np.asarray(x)),
                        shardings, host)


def _params_slice(state_sh: TrainState) -> tuple[Any, slice]:
    """The params' treedef and where their leaves sit among the state's leaves (found by
    marking them, so it never depends on how TrainState orders its fields)."""
    mark = lambda tree, m: jax.tree.map(lambda _: m, tree)  # noqa: E731
    marks = jax.tree.leaves(mark(state_sh, 0).replace(params=mark(state_sh.params, 1)))
    first, n = marks.index(1), marks.count(1)
    assert marks[first:first + n] == [1] * n, "the params' leaves are not contiguous"
    return jax.tree.structure(state_sh.params), slice(first, first + n)


@dataclasses.dataclass
class _Pending:
    step: int
    metrics: dict[str, jax.Array]


@dataclasses.dataclass
class StepResult:
    """A finished step's metrics on the host: ``values`` as the step returned them, ``record``
    the spec's prefixed names (without ``step`` and ``finite``), ``read_at`` when the read
    returned (``perf_counter``: the step had finished)."""

    step: int
    values: dict[str, float]
    record: dict[str, float]
    read_at: float


class TrainEngine:
    """Owns the state, the compiled step, the checkpointer and the metric sinks of one run;
    ``spec`` says what the step is (``trainer.spec``). The loops (``trainer.sft_loop``,
    ``trainer.rl_loop``) own the cadence, the timing and what a metric record holds."""

    def __init__(self, config: Config, workdir: paths.PathLike, mesh: Mesh,
                 trainee: Trainee, spec: StepSpec) -> None:
        t = config.trainer
        self.config, self.workdir, self.mesh, self.trainee = (config, paths.as_path(workdir), mesh,
                                                              trainee)
        self.spec = spec
        self.tx, self.schedule = make_optimizer(config.optimizer, t.learning_rate, t.steps,
                                                spec.updates_per_step)
        # A trainee may carry LoRA that this engine's config turns off (e.g. a full warm start).
        self.lora = trainee.lora if config.lora.rank > 0 else None
        self._frozen: list[jax.Array] | None = None
        self.params_sh = expand_prefix(trainee.params_shardings, trainee.params)  # full params
        # With LoRA the state's params are the adapters alone: no base grads or moments.
        trained = (trainee.params if self.lora is None else self.lora.abstract_adapters())
        self.state_sh = state_shardings(
            self.params_sh if self.lora is None else self.lora.adapter_sh, self.tx, mesh, trained)
        self.batch_sh = spec.batch_sh
        check_process_rows(self.batch_sh.input_ids, config.mesh)  # put_batch's contract
        # Armed during the restore (a hung read or collective), then from the loop to finish().
        d = config.distributed
        self.watchdog = Watchdog(d.step_timeout_s, d.first_step_timeout_s)
        self.watchdog.start()
        self.watchdog.launched("checkpoint restore")
        try:
            self.checkpointer = Checkpointer(self.workdir / "checkpoints", config.checkpoint,
                                             process_index=jax.process_index())
            target = abstract_state(self.state_sh, trained, self.tx, t.seed)
            try:
                self.restored: Restored | None = self.checkpointer.restore_latest(target)
            except BaseException:
                self.checkpointer.close()  # no orphaned Orbax threads when resume is refused
                raise
        finally:
            self.watchdog.stop()
        self.start_step = 0 if self.restored is None else int(self.restored.counters["step"])
        if self.restored is not None:
            try:
                check_resume(self.restored.config, config.to_dict(), self.start_step)
            except BaseException:
                self.checkpointer.close()
                raise
        step_fn = (spec.make_step(trainee.forward, spec.loss_fn, self.tx, self.schedule)
                   if self.lora is None else self.lora.step(
                       trainee.forward,
                       lambda fwd: spec.make_step(fwd, spec.loss_fn, self.tx, self.schedule)))
        # The step runs on the state's leaves; ``state`` is a view built when read.
        self._treedef = jax.tree.structure(self.state_sh)
        self._params_def, self._params_at = _params_slice(self.state_sh)
        self._leaves: list[jax.Array] | None = None
        self._view: TrainState | None = None
        state_sh = (self.state_sh if self.lora is None
                    else (self.state_sh, self.lora.frozen_sh))
        jitted = jit_leaf_step(step_fn, state_sh, self.batch_sh, mesh)
        self.step_fn: Callable[[list[jax.Array], TrainBatch], tuple[list[jax.Array], Any]] = (
            jitted if spec.row_buckets is None
            else BucketedStep(jitted, self.batch_sh, t.seq_len, spec.row_buckets,
                              spec.trailing))
        retire_versions_after(self.workdir, self.start_step)
        self.metrics = MetricsWriter(self.workdir, tensorboard=config.logging.tensorboard,
                                     process_index=jax.process_index(),
                                     resume_step=None if self.restored is None
                                     else self.start_step, wandb=wandb_sink(config, workdir))
        self.profile = ProfileWindow(config.logging.profile_steps, workdir, jax.process_index())
        self.data: DataIterator | None = None
        self.progress: Progress | None = None
        self.on_log: Callable[[int, dict[str, float]], None] | None = None
        self.history: list[dict[str, float]] = []  # the first and newest HISTORY_MAX - 1
        self._pending: _Pending | None = None
        self._read: StepResult | None = None

    def start(self, params: Any = None, data: DataIterator | None = None) -> None:
        """The restored state, else a fresh one from ``params`` (default: the trainee's),
        jitted onto the state shardings. A restored run sets ``data``'s iterator state."""
        self.data = data
        params = self.trainee.params if params is None else params
        if self.lora is not None:  # the base to adapt; fresh adapters unless restored
            self._frozen = jax.tree.leaves(self.lora.freeze(params))
            params = self.lora.adapters()
        if self.restored is None:
            seed = self.config.trainer.seed
            self.state = jax.jit(lambda p: init_state(p, self.tx, seed),
                                 out_shardings=self.state_sh)(params)
        else:
            self.state = self.restored.state
            if data is not None:
                data.set_state(self.restored.data)
            _log.info("resuming at step %d", self.start_step)
        self.trainee.params = None  # the state owns the params now (they get donated)

    @property
    def state(self) -> TrainState | None:
        """The train state: after a step, built from the step's output leaves when first read
        (its params and moments are the arrays the next step donates)."""
        if self._view is None and self._leaves is not None:
            self._view = jax.tree.unflatten(self._treedef, self._leaves)
        return self._view

    @property
    def params(self) -> Any:
        """``state.params`` without building the rest of the state (what a weight handoff
        reads every RL step); with LoRA the full params, base and adapters merged."""
        if self.lora is not None and self._leaves is not None:
            return self.lora.merged(self.frozen_base(), self.trained_params)
        return self.trained_params

    def adapter_update(self, with_base: bool) -> AdapterUpdate:
        """With LoRA: the adapter-only weight handoff of the current adapters (``with_base``:
        carrying the frozen base's full params, for a sampler that has none yet)."""
        assert self.lora is not None and self._frozen is not None, "adapter_update needs LoRA"
        return self.lora.update(self.trained_params, self.frozen_base(), with_base)

    @property
    def trained_params(self) -> Any:
        """The params the step trains (with LoRA: the adapters)."""
        if self._view is not None:
            return self._view.params
        if self._leaves is None:
            return None
        return jax.tree.unflatten(self._params_def, self._leaves[self._params_at])

    @state.setter
    def state(self, state: TrainState | None) -> None:
        leaves, treedef = jax.tree.flatten(state)
        if state is not None and treedef != self._treedef:
            raise ValueError(f"a train state of structure {treedef} does not fit this engine's "
                             f"step, compiled for {self._treedef}")
        self._leaves, self._view = (None, None) if state is None else (leaves, state)

    def precompile(self) -> None:
        """Compile a bucketed step for every row count now, not in the step that first needs
        it (a plain step compiles at its first dispatch)."""
        assert self._leaves is not None, "precompile() needs start()"
        if isinstance(self.step_fn, BucketedStep):
            self.step_fn.precompile(self._step_leaves())

    def open_progress(self, on_log: Callable[[int, dict[str, float]], None] | None = None
                      ) -> None:
        """The progress bar; with ``on_log``, ``on_log(step, record)`` runs at every metric
        write (the run's first step, then every ``trainer.log_every`` steps) on process 0 and
        replaces the bar's own every-10% log lines (the job writes its own step line)."""
        self.on_log = on_log if jax.process_index() == 0 else None
        self.watchdog.start()
        self.progress = Progress(self.config.trainer.steps, self.start_step,
                                 enabled=self.config.logging.progress_bar and
                                 jax.process_index() == 0, log_lines=on_log is None)

    # -- the step, its metrics one step late -------------------------------------------------

    def dispatch(self, step: int, batch: TrainBatch,
                 prepare: Callable[[Any], tuple[Any, dict[str, jax.Array]]] | None = None
                 ) -> StepResult | None:
        """Run step ``step`` on the device ``batch`` (``prepare(batch) -> (batch, metrics)``
        first, e.g. the KL reference); returns the previous step's metrics, read while this one
        runs (None when there is none left to read)."""
        self.profile.before(step)
        self.watchdog.launched(f"train step {step}")
        with jax.transfer_guard("disallow"):
            extra: dict[str, jax.Array] = {}
            if prepare is not None:
                batch, extra = prepare(batch)
            leaves, metrics = self.step_fn(self._step_leaves(), batch)
            self._leaves = leaves[:len(self._leaves)]
            if self._frozen is not None:  # donated in and aliased out, unchanged
                self._frozen = leaves[len(self._leaves):]
            self._view = None
        self.profile.after(step, self._leaves)
        previous = self.read()
        self._pending = _Pending(step, {**metrics, **extra})
        return previous

    def read(self) -> StepResult | None:
        """The dispatched step's metrics on the host (waiting for the step), checked for a
        non-finite loss; None when every dispatched step was read already."""
        if self._read is not None:
            result, self._read = self._read, None
            return result
        if self._pending is None:
            return None
        p, self._pending = self._pending, None
        values = read_step_metrics(p.metrics, p.step, self.config.trainer.on_nonfinite,
                                   self.spec.what)
        self.watchdog.completed(p.step)
        record = {f"{self.spec.metric_prefix}{k}": v for k, v in values.items()
                  if k not in ("step", "finite")}
        return StepResult(p.step, values, record, time.perf_counter())

    def log(self, result: StepResult, rate: float) -> None:
        """Record ``result.record`` (what the loop put in it) in ``history``; write it to the
        metric sinks on the run's first step, every ``trainer.log_every`` steps and the last;
        move the progress line (``rate``: its tokens/s)."""
        step, record = result.step, result.record
        self.history.append({"step": step, **record})
        if len(self.history) > HISTORY_MAX:
            del self.history[1]
        # The first step of a run is written too: the console shows the run is training (and
        # how long its start took) without waiting log_every steps.
        t = self.config.trainer
        if step % t.log_every == 0 or step == t.steps or step == self.start_step + 1:
            self.metrics.write(step, record)
            if self.on_log is not None:
                self.on_log(step, record)
        if self.progress is not None:
            self.progress.update(step, result.values["loss"], rate)

    # -- checkpoints and weights -------------------------------------------------------------

    def save(self, step: int, data_state: dict[str, Any] | None = None,
             counters: dict[str, Any] | None = None) -> None:
        """Checkpoint the state, the data iterator's state (default: ``start``'s iterator),
        ``counters`` (``step`` set to ``step``) and the config."""
        if self._pending is not None:  # a checkpoint never holds an unchecked update
            self._read = self.read()
        if data_state is None:
            assert self.data is not None, "save() needs data_state or start(data=...)"
            data_state = self.data.get_state()
        self.watchdog.launched(f"checkpoint save of step {step}")
        self.checkpointer.save(step, self.state, data_state, self.config.to_dict(),
                               {**(counters or {}), "step": step})

    def _step_leaves(self) -> list[jax.Array]:
        """The step's input: the state's leaves, then (LoRA) the frozen base's."""
        assert self._leaves is not None
        return self._leaves if self._frozen is None else self._leaves + self._frozen

    def frozen_base(self) -> Any:
        """With LoRA: the frozen base as the step holds it now (its buffers change each step:
        the step donates the base and returns it)."""
        return jax.tree.unflatten(jax.tree.structure(self.lora.frozen_sh), self._frozen)

    def publish(self, version: int) -> None:
        """Orbax weight version ``<workdir>/weights/<version>`` (replacing a killed run's
        leftover of that version), keeping the newest ``checkpoint.keep_versions``."""
        self.watchdog.launched(f"publish of weight version {version}")
        publish_version(self.params, self.workdir, version, self.config.checkpoint.keep_versions)

    def finish(self) -> None:
        """Wait for pending checkpoint writes; close the progress line; disarm the watchdog."""
        self.watchdog.launched("wait for checkpoint writes")
        self.checkpointer.wait()
        self.watchdog.stop()
        if self.progress is not None:
            self.progress.close()

    def close(self) -> None:
        self.profile.close()
        self.watchdog.stop()
        self.checkpointer.close()
        self.metrics.close()
