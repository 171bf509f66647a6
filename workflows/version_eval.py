"""Held-out evaluation of each weight version a run publishes, as the versions appear.

``VersionEvaluator`` puts one version at a time on an async sampler and scores it with the RL
job's own evaluation (``workflows.evaluate.aevaluate``); ``awatch`` lists
``<workdir>/weights`` until the run's final version is evaluated or the run has ended, and
raises ``EvaluateTimeoutError`` when neither happens for ``evaluate.timeout_s`` seconds. A
version published again after its evaluation (a resumed RL run redoes the steps after its
checkpoint) is evaluated again; its new metrics replace the old.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from meshrl.configs.schema import Config
from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.published import published_versions, version_stamp
from meshrl.inference.weights import WeightMismatchError
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.errors import UserError
from meshrl.workflows.setup import aevaluate_held_out

log = log_lib.get_logger("evaluate")
ACCURACY = "eval/greedy_accuracy"
STAMPS = "weight_stamps.json"  # under <workdir>/eval


class EvaluateTimeoutError(UserError, TimeoutError):
    """No new weight version and no end of the run for ``evaluate.timeout_s`` seconds."""


class RunEndedError(UserError, RuntimeError):
    """The RL run ended without publishing its final weight version."""


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


class VersionEvaluator:
    """The held-out set, tokenizer, reward pool and one async sampler that takes each version
    in turn. ``mismatch(version, error)`` turns weights that do not fit the sampler's model
    into the job's error."""

    def __init__(self, config: Config, workdir: epath.Path, engine: AsyncSampler, pool: Any,
                 examples: Sequence[Any], tokenizer: Any,
                 mismatch: Callable[[int, Exception], Exception]) -> None:
        self.config, self.workdir, self.engine, self.pool = config, workdir, engine, pool
        self.examples, self.tokenizer, self.mismatch = examples, tokenizer, mismatch
        # version -> the stamp (``version_stamp``) of the weights its metrics are of: a version
        # a resumed RL run publishes again is evaluated again.
        self._stamps_path = workdir / "eval" / STAMPS
        try:
            self.stamps = {int(k): int(v) for k, v in
                           json.loads(self._stamps_path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            self.stamps = {}
        self._loaded: int | None = None

    def republished(self, version: int) -> bool:
        """Whether ``version``'s weights changed since the evaluation of it on record."""
        old, now = self.stamps.get(version), version_stamp(self.workdir, version)
        return old is not None and now is not None and now != old

    def record(self, version: int) -> None:
        """Note the weights of the version just evaluated (after its metrics are written)."""
        if self._loaded is not None:
            self.stamps[version] = self._loaded
            paths.write_text_atomic(self._stamps_path, json.dumps(
                {str(k): v for k, v in sorted(self.stamps.items())}))

    def load(self, version: int) -> bool:
        """Put ``version`` on the sampler; False if it vanished (a resumed RL run replaces the
        versions after its checkpoint: it comes back under the same number; or the run's
        ``checkpoint.keep_versions`` retired it: it is then no longer listed)."""
        # Read first: weights replaced while loading get a newer stamp, evaluated again.
        self._loaded = version_stamp(self.workdir, version)
        try:
            self.engine.load_weights(version)
        except WeightMismatchError as e:
            raise self.mismatch(version, e) from None
        except FileNotFoundError as e:
            log.warning("weight version %d vanished while loading (%s); listing the versions "
                        "again", version, e)
            return False
        return True

    async def evaluate(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        # With agent.env its episodes go to <workdir>/eval/episodes.jsonl.
        out = await aevaluate_held_out(self.config, self.engine, self.pool, self.examples,
                                       self.tokenizer, version=version,
                                       workdir=self.workdir / "eval")
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


def _ended_without_final(config: Config, workdir: epath.Path, final: int) -> RunEndedError:
    return RunEndedError(
        f"{workdir / 'summary.json'}: the RL run ended with trainer.steps = "
        f"{config.trainer.steps}, but its final version {final} is not under "
        f"{workdir / 'weights'} (published: {published_versions(workdir)}): were "
        f"its weights deleted? Nothing more will be published to evaluate")


async def awatch(ev: VersionEvaluator, write: Callable[[int, dict[str, float]], None],
                 done: dict[int, dict[str, float]]) -> str:
    """Evaluate versions as they appear (``write(version, metrics)`` each) until the end rule
    holds; returns which one held: ``"final_version"`` (evaluated) or ``"run_ended"`` (a run
    that publishes none ended)."""
    config, workdir = ev.config, ev.workdir
    final, timeout = final_version(config), config.evaluate.timeout_s
    last = time.monotonic()
    while True:
        # The end marker before the listing: a run that had ended has published everything.
        ended = run_ended(workdir, config)
        listed = published_versions(workdir)
        for version in listed:
            if version in done and not ev.republished(version):
                continue
            if version in done:
                log.warning("version %d was published again since its evaluation (a resumed RL "
                            "run): evaluating it again; its new metrics replace the old", version)
            if not await asyncio.to_thread(ev.load, version):
                continue
            done[version] = await ev.evaluate(version)
            write(version, done[version])
            ev.record(version)
            log.info("version %d: %s", version,
                     ", ".join(f"{k} {v:.3f}" for k, v in done[version].items()))
            last = time.monotonic()
        # The final version's metrics count only while its weights are the ones evaluated: a
        # resumed RL run deletes the versions after its checkpoint and publishes them again.
        if final is not None and final in done and final in listed and not ev.republished(final):
            return "final_version"
        if ended:
            if final is not None:
                raise _ended_without_final(config, workdir, final)
            return "run_ended"
        waited = time.monotonic() - last
        if timeout and waited > timeout:
            raise _timeout_error(config, workdir, done)
        wait = config.evaluate.poll_s
        await asyncio.sleep(min(wait, timeout - waited) if timeout else wait)
