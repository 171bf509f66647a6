"""Run rewards in worker processes with a per-call timeout, and compose them by weight.

Each (reward, completion) pair is one call in a worker. A call that raises, returns a non-finite
value, outlives ``timeout_s`` or kills its worker scores 0.0 and increments ``errors`` or
``timeouts``; a hung worker is killed and replaced, so the RL loop never stalls on one bad
completion. Workers come from a forkserver (spawn where unavailable), never a fork of the JAX
process, whose threads and device handles must not be duplicated.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from meshrl.configs.schema import RewardConfig
from meshrl.rewards.registry import get
from meshrl.utils.log import get_logger

log = get_logger("rewards")

STARTUP_TIMEOUT_S = 120.0  # importing sympy and meshrl in a fresh worker; not a reward's time


def _worker_main(conn: Connection) -> None:
    import meshrl.rewards  # noqa: F401  (registers the built-in rewards)

    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if task is None:
            return
        name, prompt, completion, fields = task
        try:
            value = get(name)([prompt], [completion], **{k: [v] for k, v in fields.items()})[0]
            conn.send(("ok", float(value)))
        except BaseException as e:  # noqa: BLE001  (any failure of a reward is a counted 0)
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, int] | None = None  # (reward index, example index)
        self.sent_at = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        w.process.join(timeout=1)
        w.kill()


class RewardPool:
    """Scores completions with ``sum_i weights[i] * reward_i`` computed in worker processes.

    ``score`` is synchronous; ``ascore`` runs it in a thread so an event loop keeps running.
    Calls are serialised (one batch at a time); ``metrics()`` returns the counters.
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None, *,
                 timeout_s: float = 5.0, num_workers: int = 2,
                 constants: dict[str, Any] | None = None) -> None:
        self.names = list(names)
        self.weights = [1.0] * len(self.names) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.names) or not self.names:
            raise ValueError(f"rewards {self.names} need one weight each, got {self.weights}")
        for name in self.names:
            get(name)  # fail at construction on a typo, not inside a worker
        self.timeout_s, self.num_workers = float(timeout_s), int(num_workers)
        # Per-pool settings handed to every reward call, e.g. the format template.
        self.constants = dict(constants or {})
        self.counters = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self._ctx.get_start_method() == "forkserver":
            # Import once in the fork server (no-op if it already runs), so a replacement worker
            # is ready in milliseconds instead of re-importing sympy.
            self._ctx.set_forkserver_preload(["meshrl.rewards"])
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    @classmethod
    def from_config(cls, config: RewardConfig, **kwargs: Any) -> RewardPool:
        constants = {"format_template": config.format_template, **kwargs.pop("constants", {})}
        return cls(config.names, config.weights, timeout_s=config.timeout_s,
                   num_workers=config.num_workers, constants=constants, **kwargs)

    def metrics(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx)
        self.counters["worker_restarts"] += 1

    def score_components(self, prompts: Sequence[str], completions: Sequence[str],
                         **fields: Sequence[Any]) -> dict[str, list[float]]:
        """Unweighted reward per name, each aligned with ``completions``."""
        n = len(completions)
        if len(prompts) != n or any(len(v) != n for v in fields.values()):
            raise ValueError(f"prompts, completions and every field need {n} entries")
        if n == 0:
            return {name: [] for name in self.names}
        with self._lock:
            return self._run(list(prompts), list(completions), fields)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              **fields: Sequence[Any]) -> list[float]:
        components = self.score_components(prompts, completions, **fields)
        return [sum(w * components[name][i] for name, w in zip(self.names, self.weights))
                for i in range(len(completions))]

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]:
        return await asyncio.to_thread(self.score, prompts, completions, **fields)

    def _run(self, prompts: list[str], completions: list[str],
             fields: dict[str, Sequence[Any]]) -> dict[str, list[float]]:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx))
        results = [[0.0] * len(completions) for _ in self.names]
        pending = deque((r, i) for r in range(len(self.names)) for i in range(len(completions)))
        running = 0
        while pending or running:
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    w.task = pending.popleft()
                    r, i = w.task
                    example = {k: v[i] for k, v in fields.items()}
                    try:
                        w.conn.send((self.names[r], prompts[i], completions[i],
                                     {**self.constants, **example}))
                    except (OSError, ValueError):  # worker died while idle
                        pending.appendleft(w.task)
                        w.task = None
                        self._replace(w)
                        continue
                    w.sent_at, running = now, running + 1
            deadlines = [w.sent_at + self.timeout_s if w.task else w.started + STARTUP_TIMEOUT_S
                         for w in self._workers if w.task or not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
            for conn in wait([w.conn for w in self._workers], timeout=wait_s):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "error", "worker exited"
                if kind == "ready":
                    w.ready = True
                    continue
                if w.task is None:  # a dead idle worker
                    if not w.ready:
                        # Dying before "ready" is an import/config bug; restarting would loop.
                        raise RuntimeError(f"reward worker exited during start-up "
                                           f"(exit code {w.process.exitcode}); check that "
                                           f"{self.names} import in a fresh process")
                    self._replace(w)
                    continue
                r, i = w.task
                w.task, running = None, running - 1
                self.counters["calls"] += 1
                if kind == "ok" and math.isfinite(payload):
                    results[r][i] = payload
                else:
                    self.counters["errors"] += 1
                    log.warning("reward %s raised on example %d: %s", self.names[r], i,
                                payload if kind != "ok" else f"non-finite {payload}")
                if payload == "worker exited":
                    self._replace(w)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now - w.sent_at > self.timeout_s:
                    r, i = w.task
                    running -= 1
                    self.counters["calls"] += 1
                    self.counters["timeouts"] += 1
                    log.warning("reward %s timed out after %.2fs on example %d; replacing its "
                                "worker", self.names[r], self.timeout_s, i)
                    self._replace(w)  # results[r][i] stays 0.0
                elif not w.ready and now - w.started > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"reward worker did not start within "
                                       f"{STARTUP_TIMEOUT_S}s")
        return {name: results[r] for r, name in enumerate(self.names)}
