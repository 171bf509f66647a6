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

import asyncio
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
from meshrl.inference.weights import WeightMismatchError, published_versions
from meshrl.jobs import weights_source
from meshrl.mesh import create_mesh
from meshrl.models import load
from meshrl.rewards import RewardPool
from meshrl.trainer.curves import read_metrics
from meshrl.trainer.metrics import MetricsWriter
from meshrl.trainer.rl_loop import publishes_at
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.aio import run_sync
from meshrl.utils.errors import UserError
from meshrl.workflows.evaluate import aevaluate

__all__ = ["EvaluateTimeoutError", "RunEndedError", "evaluated_versions", "final_version",
           "rl_versions", "run", "run_ended"]

log = log_lib.get_logger("evaluate")
ACCURACY = "eval/greedy_accuracy"


class EvaluateTimeoutError(UserError, TimeoutError):
    """No new weight version and no end of the run for ``evaluate.timeout_s`` seconds."""


class RunEndedError(UserError, RuntimeError):
    """The RL run ended without publishing its final weight version."""


def rl_versions(config: Config) -> list[int]:
    """The versions a fresh RL run of ``config`` publishes (``trainer.rl_loop.publishes_at``)."""
    return [s for s in range(1, config.trainer.steps + 1) if publishes_at(config, s)]


def final_version(config: Config) -> int | None:
    """The run's last weight version, ``trainer.steps``; None when the run publishes none."""
    return config.trainer.steps or None


def run_ended(workdir: paths.PathLike, config: Config) -> bool:
    """Whether the RL run of ``config`` in ``workdir`` finished: its ``summary.json`` (written
    after its last publication) records ``steps = trainer.steps``. The summary of an earlier,
    shorter run in the same workdir (``trainer.steps`` raised since) does not count."""
    path = paths.as_path(workdir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being written
        return False
    return summary.get("job") == "rl" and summary.get("steps") == config.trainer.steps


def evaluated_versions(eval_dir: epath.Path) -> dict[int, dict[str, float]]:
    """The versions ``<eval_dir>/metrics.jsonl`` holds an evaluation of, with their metrics."""
    return {v: m for v, m in read_metrics(eval_dir / "metrics.jsonl").items() if ACCURACY in m}


class _Evaluator:
    """The held-out set, tokenizer, reward pool and one sampler (behind the async engine) that
    takes each version in turn."""

    def __init__(self, config: Config, workdir: epath.Path) -> None:
        self.config, self.workdir = config, workdir
        # The model of this config (not the run's saved one): weights that do not fit it are an
        # error naming the version, never a silent switch of architecture.
        target = load(config, create_mesh(config.mesh), "sample", abstract=True)
        self.tokenizer = target.tokenizer
        self.examples = eval_examples(config.data, self.tokenizer)
        if not self.examples:
            d = config.data
            raise ConfigError(f"data.eval_examples = {d.eval_examples}, data.eval_path = "
                              f"{d.eval_path!r}: the held-out set is empty: the evaluate job "
                              f"needs held-out examples (set data.eval_path for file sources)")
        sampler = Sampler(target.arch, config.sampler, target.mesh, workdir=str(workdir),
                          rules=target.rules)
        self.engine = AsyncSampler(sampler)
        self.pool = RewardPool.from_config(config.reward)

    def load(self, version: int) -> bool:
        """Put ``version`` on the sampler; False if it vanished (a resumed RL run replaces the
        versions after its checkpoint: it comes back under the same number; or the run's
        ``checkpoint.keep_versions`` retired it: it is then no longer listed)."""
        # TODO(meshrl): a version a resumed RL run replaces after it was evaluated keeps the
        # old weights' metrics; the trainer publishes no marker that would tell them apart.
        try:
            self.engine.load_weights(version)
        except WeightMismatchError as e:
            raise weights_source.mismatch_error(self.workdir, version, "this config", e) from None
        except FileNotFoundError as e:
            log.warning("weight version %d vanished while loading (%s); listing the versions "
                        "again", version, e)
            return False
        return True

    async def evaluate(self, version: int) -> dict[str, float]:
        c = self.config
        t0 = time.perf_counter()
        out = await aevaluate(self.engine, self.pool, self.examples, version=version,
                              decode=self.tokenizer.decode, eos_id=self.tokenizer.eos_id,
                              max_new_tokens=c.sampler.max_new_tokens, n=c.rollout.group_size,
                              temperature=c.sampler.temperature, seed=c.trainer.seed)
        return {**out, "perf/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.engine.shutdown()
        self.pool.close()


def _timeout_error(config: Config, workdir: epath.Path, done: dict[int, Any]
                   ) -> EvaluateTimeoutError:
    t = config.evaluate.timeout_s
    return EvaluateTimeoutError(
        f"evaluate.timeout_s = {t}: no new weight version under {workdir / 'weights'} and no "
        f"end of the RL run ({workdir / 'summary.json'}) for {t:g} s; evaluated "
        f"{sorted(done)}, waiting for the final version {final_version(config)} "
        f"(trainer.steps): is the RL job running with this --workdir and config? Raise "
        f"evaluate.timeout_s, or set it to 0 to wait forever")


async def _watch(ev: _Evaluator, writer: MetricsWriter, done: dict[int, dict[str, float]]
                 ) -> str:
    """Evaluate versions as they appear until the end rule holds; returns which one held:
    ``"final_version"`` (evaluated) or ``"run_ended"`` (a run that publishes none ended)."""
    config, workdir = ev.config, ev.workdir
    final, timeout = final_version(config), config.evaluate.timeout_s
    last = time.monotonic()
    while True:
        # The end marker before the listing: a run that had ended has published everything.
        ended = run_ended(workdir, config)
        for version in [v for v in published_versions(workdir) if v not in done]:
            if not await asyncio.to_thread(ev.load, version):
                continue
            done[version] = await ev.evaluate(version)
            writer.write(version, done[version])
            log.info("version %d: %s", version,
                     ", ".join(f"{k} {v:.3f}" for k, v in done[version].items()))
            last = time.monotonic()
        if final is not None and final in done:
            return "final_version"
        if ended:
            if final is not None:
                raise RunEndedError(
                    f"{workdir / 'summary.json'}: the RL run ended with trainer.steps = "
                    f"{config.trainer.steps}, but its final version {final} is not under "
                    f"{workdir / 'weights'} (published: {published_versions(workdir)}): were "
                    f"its weights deleted? Nothing more will be published to evaluate")
            return "run_ended"
        waited = time.monotonic() - last
        if timeout and waited > timeout:
            raise _timeout_error(config, workdir, done)
        wait = config.evaluate.poll_s
        await asyncio.sleep(min(wait, timeout - waited) if timeout else wait)


def _summary(config: Config, done: dict[int, dict[str, float]], reason: str,
             wall: float) -> dict[str, Any]:
    versions = sorted(done)
    last = done[versions[-1]] if versions else {}
    return {"job": "evaluate", "versions": versions, "final_version": final_version(config),
            "exit": reason, "accuracy_first": done[versions[0]][ACCURACY] if versions
            else None, "accuracy_final": last.get(ACCURACY), "eval_final": last,
            "not_evaluated": sorted(set(rl_versions(config)) - set(done)), "wall_s": wall}


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Evaluate the RL run's published versions until its final one; ``summary.json``."""
    if jax.process_count() > 1:
        # TODO(meshrl): a multi-host evaluator must agree on the versions it lists first.
        raise NotImplementedError("the evaluate job runs on one process in this build")
    t0 = time.perf_counter()
    root = paths.as_path(workdir)
    eval_dir = root / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    done = evaluated_versions(eval_dir)
    if done:
        log.info("already evaluated versions %s (%s): skipping them", sorted(done),
                 eval_dir / "metrics.jsonl")
    ev = _Evaluator(config, root)
    writer = MetricsWriter(eval_dir, tensorboard=config.logging.tensorboard,
                           process_index=jax.process_index(),
                           resume_step=max(done) if done else None)
    try:
        log.info("watching %s for weight versions up to %s (trainer.steps)", root / "weights",
                 final_version(config))
        reason = run_sync(_watch(ev, writer, done))
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
