"""The SFT loop: data -> sharded batch -> step -> metrics one step late -> periodic checkpoints
and hooks (evaluation, a stop request), the step clock, and the run's summary. The RL job's
warm start runs this same loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from meshrl.trainer.clock import StepClock, Stopwatch
from meshrl.trainer.engine import StepResult, TrainEngine, put_batch
from meshrl.trainer.metrics import peak_flops_per_device
from meshrl.trainer.state import params_checksum
from meshrl.trainer.stop import stop_hook
from meshrl.trainer.summary import data_stats, first_logged, logged_history
from meshrl.utils import interrupt
from meshrl.utils.log import get_logger

_log = get_logger("trainer.sft")
Hook = Callable[[int, TrainEngine], None]
Evaluate = Callable[[Any], dict[str, float]]
Prepare = Callable[[Any], tuple[Any, dict[str, jax.Array]]]


def run_sft(engine: TrainEngine, hooks: Sequence[Hook] = (), prepare: Prepare | None = None
            ) -> list[dict[str, float]]:
    """Steps ``start_step + 1 .. trainer.steps`` over ``engine.data``, a checkpoint every
    ``checkpoint.every_steps`` and always at the last step, ``hook(step, engine)`` after each
    step and before its checkpoint (its time is not the step's), then a requested stop
    (``trainer.stop.stop_hook``); returns the engine's history. Needs
    ``engine.start(data=...)``. ``prepare(batch) -> (batch, metrics)`` runs on the device
    batch before each step (``engine.dispatch``), e.g. to add a frozen reference's logprobs:
    the data then fills only the fields ``prepare`` does not."""
    cfg = engine.config.trainer
    assert engine.data is not None and engine.state is not None, "run_sft() needs start(data=)"
    peak = peak_flops_per_device(cfg.peak_flops,
                                 compute_dtype=engine.config.model.compute_dtype)
    clock = StepClock(engine.trainee.flops_per_token, peak,
                      int(engine.mesh.devices.size))
    tokens = cfg.batch_size * cfg.seq_len

    def log(result: StepResult | None) -> None:
        if result is not None:
            result.record.update(clock.lap(tokens, at=result.read_at))
            engine.log(result, result.record["tokens_per_s"])

    every = engine.config.checkpoint.every_steps
    engine.open_progress()
    it: Iterator[dict[str, np.ndarray]] = engine.data
    batch_type = type(engine.batch_sh)
    clock.start()
    for step in range(engine.start_step + 1, cfg.steps + 1):
        rows = batch_type.from_mapping(next(it))
        batch = put_batch(rows, engine.batch_sh.like(rows))
        log(engine.dispatch(step, batch, prepare))
        save = every and step % every == 0 and step != cfg.steps
        evals = cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps
        if save or evals:
            # The step's own wait is step time; the save's or the evaluation's (which waits
            # for the step's params first) is not.
            log(engine.read())
        with Stopwatch() as host:
            try:
                # The hooks (the evaluation) first: a checkpoint never becomes durable before
                # its step's evaluation row is written, so a kill between the two cannot leave a
                # run that resumes past a step it never evaluated.
                for hook in hooks:
                    hook(step, engine)
                if save:
                    engine.save(step)
                stop_hook(step, engine)  # relies on the save above
            except interrupt.Stopped:
                # The stop's save read the step's metrics; the resumed run starts after it.
                log(engine.read())
                raise
        clock.exclude(host.wall_s, host.cpu_s)
    log(engine.read())
    if cfg.steps > engine.start_step or not engine.checkpointer.all_steps():
        engine.save(cfg.steps)
    engine.finish()
    return engine.history


def periodic_eval(evaluate: Evaluate) -> Hook:
    """The hook that evaluates every ``trainer.eval_every`` steps (not the last: the run
    evaluates after training) and writes the metrics at that step."""
    def hook(step: int, engine: TrainEngine) -> None:
        every, steps = engine.config.trainer.eval_every, engine.config.trainer.steps
        if every and step % every == 0 and step != steps:
            ev = evaluate(engine.params)
            _log.info("eval at step %d: %s", step, ev)
            engine.metrics.write(step, ev)
    return hook


def sft_summary(engine: TrainEngine, history: list[dict[str, float]], ev: dict[str, float],
                wall: float, n_params: int) -> dict[str, Any]:
    """The SFT run's summary: losses, median steady throughput and MFU (the first step, which
    compiles, left out), skipped steps, the final evaluation and the params' checksum (a
    collective: every process calls this). A run that trained nothing (run again after it
    finished) takes its figures from ``metrics.jsonl`` (``logged_history``)."""
    history = history or logged_history(engine, "loss")
    steady = history[1:] or history
    return {
        "job": engine.config.job.value, "steps": engine.config.trainer.steps,
        "start_step": engine.start_step,
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": first_logged(engine, "loss"),
        "tokens_per_s": float(np.median([h["tokens_per_s"] for h in steady]))
        if steady and all("tokens_per_s" in h for h in steady) else None,
        "mfu": float(np.median([h["mfu"] for h in history[1:]]))
        if len(history) > 1 and all("mfu" in h for h in history[1:]) else None,
        "skipped_steps": int(history[-1].get("skipped", 0)) if history else 0,
        "params": n_params, "wall_s": wall, "devices": int(engine.mesh.devices.size),
        "processes": jax.process_count(), "params_checksum": params_checksum(engine.params),
        "data": data_stats(engine.data), **ev,
    }


def train_and_evaluate(engine: TrainEngine, evaluate: Evaluate, n_params: int, t0: float,
                       prepare: Prepare | None = None,
                       ) -> tuple[dict[str, Any], list[dict[str, float]], dict[str, float]]:
    """``run_sft`` with ``evaluate`` every ``trainer.eval_every`` steps and a stop request
    honoured, then the final evaluation written at the last step: (``sft_summary`` with the
    wall time since ``t0``, the history, the final evaluation)."""
    history = run_sft(engine, hooks=[periodic_eval(evaluate)], prepare=prepare)
    wall = time.perf_counter() - t0
    after = evaluate(engine.params)
    if after:
        engine.metrics.write(engine.config.trainer.steps, after)
    return sft_summary(engine, history, after, wall, n_params), history, after
