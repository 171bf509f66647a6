"""The ``evaluate`` job: held-out evaluation of every weight version an RL run publishes, in a
process (or on a host) of its own, while the run goes on or after it ended.

  python main.py --config configs/default.py --workdir RUN --config.job=evaluate

Contract:
* Config: the RL run's own config file (and overrides), with ``--config.job=evaluate`` and
  the run's ``--workdir``. The evaluation is the RL job's own (``workflows.evaluate.aevaluate``):
  the ``data.eval_*`` held-out set, greedy accuracy, and pass@1 / pass@k from
  ``k = rollout.group_size`` samples at ``sampler.temperature``, ``sampler.max_new_tokens``
  new tokens, seeded by ``trainer.seed``; so its numbers for a version are the RL job's.
* Weights: each version listed under ``<workdir>/weights`` (complete once listed: Orbax renames
  a finished write into place) is restored onto a sampler of ``model.*`` / ``sampler.*`` on
  ``mesh.*`` through the sampler's Orbax path (``Sampler.load_weights``), in ascending order;
  weights that do not fit ``model.*`` (``models.load`` of this config, sample role) are a
  ``ConfigError`` (``jobs.weights_source.mismatch_error``). Every token must come from the
  version evaluated (``EvalVersionError`` otherwise). A version the run's
  ``checkpoint.keep_versions`` deletes first is skipped (the summary's ``not_evaluated``):
  give the RL job ``checkpoint.keep_versions = 0`` (or enough) to evaluate every one.
* Output: ``<workdir>/eval/metrics.jsonl`` and tensorboard events under ``<workdir>/eval/tb``,
  step = weight version; ``<workdir>/eval/summary.json`` at the end. A rerun skips the versions
  already in ``metrics.jsonl``.
* End: the run's final version is ``trainer.steps`` (``jobs/rl.py`` publishes its last step
  always; none for ``trainer.steps = 0``). The job exits 0 once that version is evaluated, or
  once the run has ended (its ``<workdir>/summary.json``, written after the last publication,
  records ``steps = trainer.steps``) and every version published by then is; a run that ended
  without its final version is a ``UserError``. No new version and no end for
  ``evaluate.timeout_s`` seconds is an ``EvaluateTimeoutError``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
from etils import epath

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples
from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Sampler
from meshrl.jobs import weights_source
from meshrl.mesh import create_mesh
from meshrl.models import load
from meshrl.rewards import RewardPool
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.trainer.curves import read_metrics
from meshrl.trainer.metrics import MetricsWriter
from meshrl.trainer.rl_loop import publishes_at
from meshrl.trainer.wandb_sink import wandb_sink
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.aio import run_sync
from meshrl.workflows.setup import prompt_room
from meshrl.workflows.version_eval import (
    ACCURACY,
    EvaluateTimeoutError,
    RunEndedError,
    VersionEvaluator,
    awatch,
    final_version,
    run_ended,
)

__all__ = ["EvaluateTimeoutError", "RunEndedError", "evaluated_versions", "final_version",
           "rl_versions", "run", "run_ended"]

log = log_lib.get_logger("evaluate")


def rl_versions(config: Config) -> list[int]:
    """The versions a fresh RL run of ``config`` publishes (``trainer.rl_loop.publishes_at``)."""
    return [s for s in range(1, config.trainer.steps + 1) if publishes_at(config, s)]


def evaluated_versions(eval_dir: epath.Path) -> dict[int, dict[str, float]]:
    """The versions ``<eval_dir>/metrics.jsonl`` holds an evaluation of, with their metrics."""
    return {v: m for v, m in read_metrics(eval_dir / "metrics.jsonl").items() if ACCURACY in m}


def _evaluator(config: Config, workdir: epath.Path) -> VersionEvaluator:
    # The model of this config (not the run's saved one): weights that do not fit it are an
    # error naming the version, never a silent switch of architecture.
    target = load(config, create_mesh(config.mesh), "sample", abstract=True)
    examples = eval_examples(config.data, target.tokenizer,
                             prompt_room=prompt_room(config))
    if not examples:
        d = config.data
        raise ConfigError(f"data.eval_examples = {d.eval_examples}, data.eval_path = "
                          f"{d.eval_path!r}: the held-out set is empty: the evaluate job "
                          f"needs held-out examples (set data.eval_path for file sources)")
    sampler = Sampler(target.arch, config.sampler, target.mesh, workdir=str(workdir),
                      rules=target.rules)
    return VersionEvaluator(
        config, workdir, AsyncSampler(sampler), RewardPool.from_config(config.reward), examples,
        target.tokenizer,
        lambda v, e: weights_source.mismatch_error(workdir, v, "this config", e))


def _summary(config: Config, done: dict[int, dict[str, float]], reason: str,
             wall: float) -> dict[str, Any]:
    versions = sorted(done)
    last = done[versions[-1]] if versions else {}
    return {"job": "evaluate", "versions": versions, "final_version": final_version(config),
            "exit": reason, "accuracy_first": done[versions[0]][ACCURACY] if versions
            else None, "accuracy_final": last.get(ACCURACY), "eval_final": last,
            "not_evaluated": sorted(set(rl_versions(config)) - set(done)), "wall_s": wall}


def _eval_run_named(config: Config, root: Any) -> Config:
    """``config`` with the W&B run name of the evaluator beside the run it evaluates."""
    name = f"{config.logging.wandb_run_name or root.name}-eval"
    return dataclasses.replace(config, logging=dataclasses.replace(config.logging,
                                                                   wandb_run_name=name))


def _warn_other_steps(config: Config, root: epath.Path) -> None:
    """Warn when the run's newest checkpoint was written with another ``trainer.steps``: the
    final version this job waits for is its own ``trainer.steps`` (a run resumed with a new
    value writes it at its next checkpoint, so this is a warning, not a refusal)."""
    if not (root / "checkpoints").is_dir():
        return
    reader = CheckpointReader(root / "checkpoints")
    try:
        steps = reader.steps()
        saved = reader.config(steps[-1]).get("trainer", {}).get("steps") if steps else None
    except Exception:  # noqa: BLE001 (a diagnostic: a checkpoint being written is no error)
        saved = None
    finally:
        reader.close()
    if saved is not None and saved != config.trainer.steps:
        log.warning("the run's newest checkpoint (step %d) was written with trainer.steps = %d, "
                    "this job has %d: it waits for version %d; pass the run's own overrides",
                    steps[-1], saved, config.trainer.steps, config.trainer.steps)


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Evaluate the RL run's published versions until its final one; ``summary.json``; with
    ``logging.wandb_project``, a W&B run of its own named ``<run>-eval``."""
    if jax.process_count() > 1:
        # Processes that poll the workdir on their own could list other versions, and every
        # process must run the same programs in the same order.
        raise ConfigError(f"job = 'evaluate' on {jax.process_count()} processes: it runs on "
                          f"one; start main.py once (not through launch/local.py or a pod "
                          f"launcher), on a host that reads the run's workdir")
    t0 = time.perf_counter()
    root = paths.as_path(workdir)
    eval_dir = root / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    done = evaluated_versions(eval_dir)
    if done:
        log.info("already evaluated versions %s (%s): skipping them", sorted(done),
                 eval_dir / "metrics.jsonl")
    _warn_other_steps(config, root)
    ev = _evaluator(config, root)
    writer = MetricsWriter(eval_dir, tensorboard=config.logging.tensorboard,
                           process_index=jax.process_index(),
                           resume_step=max(done) if done else None,
                           wandb=wandb_sink(_eval_run_named(config, root), eval_dir))
    try:
        log.info("watching %s for weight versions up to %s (trainer.steps)", root / "weights",
                 final_version(config))
        reason = run_sync(awatch(ev, writer.write, done))
    finally:
        writer.close()
        ev.close()
    summary = _summary(config, done, reason, time.perf_counter() - t0)
    paths.write_text_atomic(eval_dir / "summary.json", json.dumps(summary, indent=2))
    if summary["not_evaluated"]:
        log.warning("versions %s of the run's schedule were never published, or were deleted "
                    "before they were evaluated (the run's checkpoint.keep_versions): not "
                    "evaluated", summary["not_evaluated"])
    log.info("evaluated versions %s; greedy accuracy %s -> %s; %s", summary["versions"],
             summary["accuracy_first"], summary["accuracy_final"], eval_dir / "summary.json")
    return summary
