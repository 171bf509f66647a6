"""Run rewards in worker processes with a per-call timeout, and compose them by weight.

Each (reward, completion) pair is one call in a worker. A call that raises, returns anything
but one finite number, outlives ``timeout_s`` or kills its worker scores 0.0 and increments
``errors`` or ``timeouts``; a hung worker is killed and replaced with its process group (what the
reward started dies too), so the RL loop never stalls on one bad completion. Workers come from a forkserver (spawn where unavailable), never a fork of the JAX
process, whose threads and device handles must not be duplicated.

Concurrent callers share the workers: every call's (reward, completion) pairs join one queue that
a dispatcher thread feeds to whichever worker is free, so the groups of an async RL run are scored
side by side instead of one group after another. The dispatcher runs only while there is work.

Bounds on hostile work: workers run under the limits of ``rewards/worker.py`` (address space,
CPU time per pair). A call's pairs still queued ``deadline_s`` after it was submitted (counted
from the first worker's start) score 0.0 and increment ``deadline_zeros``, so k bad completions
delay a step by at most ``deadline_s + timeout_s``, not ``k x timeout_s / num_workers``.
Per-pool ``constants`` (the format template) win over a data column of the same name (ignored,
one warning per name). A pool that cannot score at all (a worker dead, or not ready within
``startup_timeout_s``, at start-up; or closed) raises ``RewardPoolError`` from every call.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from meshrl.configs.schema import RewardConfig
from meshrl.rewards.registry import get
from meshrl.rewards.worker import WorkerHandle, shutdown_workers
from meshrl.utils.errors import UserError, one_line
from meshrl.utils.log import get_logger

log = get_logger("rewards")

STARTUP_TIMEOUT_S = 120.0  # importing sympy and meshrl in a fresh worker; not a reward's time


# Replacement workers that may die in a row before one is ready (start-up deaths: none).
MAX_START_FAILURES = 3


class RewardPoolError(UserError, RuntimeError):
    """The pool cannot score at all (a worker died or hung at start-up, or it was closed)."""


class _Call:
    """One scoring call: its results, how many are still out, and how its waiter is told.

    ``notify`` (if given) runs once, on the dispatcher thread, when the call is done or has
    failed: ``ascore`` uses it to wake its event loop directly instead of parking a thread on
    ``done``."""

    def __init__(self, num_rewards: int, n: int,
                 notify: Callable[[], None] | None = None) -> None:
        self.submitted = time.monotonic()
        self.results = [[0.0] * n for _ in range(num_rewards)]
        self.left = num_rewards * n
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._notify = notify

    def put(self, r: int, i: int, value: float) -> None:
        self.results[r][i] = value
        self.left -= 1
        if self.left == 0:
            self.finish()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finish()

    def finish(self) -> None:
        self.done.set()
        if self._notify is not None:
            self._notify()


# One queued pair: (its call, reward index, example index, the message a worker receives).
_Task = tuple[_Call, int, int, tuple[str, str, str, dict[str, Any]]]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # the awaiting task may have been cancelled meanwhile
        fut.set_result(None)


def _wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` on its loop, from the dispatcher thread."""
    try:
        loop.call_soon_threadsafe(_resolve, fut)
    except RuntimeError:
        # The loop closed after its awaiting task was cancelled: nobody waits for the result,
        # and raising here would mark the whole pool broken.
        pass


class RewardPool:
    """Scores completions with ``sum_i weights[i] * reward_i`` computed in worker processes.

    ``score`` is synchronous and thread-safe (concurrent calls share the workers); ``ascore``
    awaits the same work without blocking its event loop or holding a thread while it waits.
    ``metrics()`` returns the counters.
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None, *,
                 timeout_s: float = 5.0, num_workers: int = 2,
                 constants: dict[str, Any] | None = None, deadline_s: float = 0.0,
                 memory_mb: int = 0, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.names = list(names)
        self.weights = [1.0] * len(self.names) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.names) or not self.names:
            raise ValueError(f"rewards {self.names} need one weight each, got {self.weights}")
        for name in self.names:
            get(name)  # fail at construction on a typo, not inside a worker
        self.timeout_s, self.num_workers = float(timeout_s), int(num_workers)
        self.deadline_s, self.startup_timeout_s = float(deadline_s), float(startup_timeout_s)
        self._worker_args = (tuple(self.names), int(memory_mb), self.timeout_s)
        # Per-pool settings handed to every reward call, e.g. the format template.
        self.constants = dict(constants or {})
        self._warned_columns: set[str] = set()
        self._first_ready: float | None = None  # when a worker first reported ready
        self._start_failures = 0  # replacement workers dead before ready, since the last ready
        self.counters = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0,
                         "deadline_zeros": 0}
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self._ctx.get_start_method() == "forkserver":
            # Import once in the fork server (no-op if it already runs), so a replacement worker
            # is ready in milliseconds instead of re-importing sympy.
            self._ctx.set_forkserver_preload(["meshrl.rewards"])
        self._workers: list[WorkerHandle] = []
        self._lock = threading.Lock()
        self._pending: deque[_Task] = deque()
        self._dispatcher: threading.Thread | None = None
        self._broken: BaseException | None = None
        # A caller queueing work wakes the dispatcher out of its wait on the worker pipes.
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, shutdown_workers, self._workers)

    @classmethod
    def from_config(cls, config: RewardConfig, **kwargs: Any) -> RewardPool:
        constants = {"format_template": config.format_template, **kwargs.pop("constants", {})}
        return cls(config.names, config.weights, timeout_s=config.timeout_s,
                   num_workers=config.num_workers, constants=constants,
                   deadline_s=config.deadline_s, memory_mb=config.worker_memory_mb, **kwargs)

    def metrics(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        """Fail calls still waiting, stop the dispatcher and the workers."""
        with self._lock:
            if self._broken is None:
                self._broken = RewardPoolError(f"reward pool {self.names}: closed")
            dispatcher = self._dispatcher
        if dispatcher is not None:
            self._wake_w.send_bytes(b"")
            dispatcher.join(timeout=10)
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def score_components(self, prompts: Sequence[str], completions: Sequence[str],
                         **fields: Sequence[Any]) -> dict[str, list[float]]:
        """Unweighted reward per name, each aligned with ``completions``."""
        call = self._submit(prompts, completions, fields)
        call.done.wait()
        return self._components(call)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              **fields: Sequence[Any]) -> list[float]:
        return self._weighted(self.score_components(prompts, completions, **fields),
                              len(completions))

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]:
        """``score`` for asyncio code. The dispatcher thread resolves the awaited future
        itself: an RL run awaits one call per sample, and a thread per waiting call would cap
        the calls in flight at the event loop's executor size (min(32, cores + 4))."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        call = self._submit(prompts, completions, fields, lambda: _wake(loop, fut))
        await fut
        return self._weighted(self._components(call), len(completions))

    def _submit(self, prompts: Sequence[str], completions: Sequence[str],
                fields: dict[str, Sequence[Any]],
                notify: Callable[[], None] | None = None) -> _Call:
        """Queue every (reward, completion) pair of one call for the workers."""
        n = len(completions)
        if len(prompts) != n or any(len(v) != n for v in fields.values()):
            raise ValueError(f"prompts, completions and every field need {n} entries")
        call = _Call(len(self.names), n, notify)
        if n == 0:
            call.finish()
            return call
        fields = self._without_constants(fields)
        tasks = [(call, r, i, (name, prompts[i], completions[i],
                               {**{k: v[i] for k, v in fields.items()}, **self.constants}))
                 for r, name in enumerate(self.names) for i in range(n)]
        with self._lock:
            if self._broken is not None:
                raise RewardPoolError(f"reward pool {self.names}: broken, it scores nothing: "
                                      f"{one_line(self._broken)}") from self._broken
            self._pending.extend(tasks)
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                    name="meshrl-rewards")
                self._dispatcher.start()
        self._wake_w.send_bytes(b"")
        return call

    def _without_constants(self, fields: dict[str, Sequence[Any]]) -> dict[str, Sequence[Any]]:
        """``fields`` less the columns that name a pool constant (the constant wins)."""
        clash = sorted(fields.keys() & self.constants.keys())
        for name in clash:
            if name not in self._warned_columns:
                self._warned_columns.add(name)
                log.warning("reward field %r comes from the data and is also a reward-pool "
                            "constant; the pool's value is used and the column ignored", name)
        return {k: v for k, v in fields.items() if k not in self.constants} if clash else fields

    def _components(self, call: _Call) -> dict[str, list[float]]:
        if call.error is not None:
            raise call.error
        return {name: call.results[r] for r, name in enumerate(self.names)}

    def _weighted(self, components: dict[str, list[float]], n: int) -> list[float]:
        return [sum(w * components[name][i] for name, w in zip(self.names, self.weights))
                for i in range(n)]

    # ---- the dispatcher thread (the only one touching workers) ---------------------------

    def _dispatch(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001  (every waiting caller gets the error)
            with self._lock:
                self._broken, self._dispatcher = e, None
                calls = {t[0] for t in self._pending} | {w.task[0] for w in self._workers
                                                        if w.task is not None}
                self._pending.clear()
            for call in calls:
                call.fail(e)

    def _step(self) -> bool:
        """Hand queued pairs to free workers, then wait for a result, a timeout or new work.
        Returns False (and the thread ends) once nothing is queued or running."""
        with self._lock:
            if self._broken is not None:  # closed: _dispatch fails whatever is still waiting
                raise self._broken
            running = any(w.task is not None for w in self._workers)
            if not self._pending and not running:
                self._dispatcher = None
                return False
            while len(self._workers) < self.num_workers:
                self._workers.append(WorkerHandle(self._ctx, self._worker_args))
            for w in self._workers:
                if w.ready and w.task is None and self._pending:
                    self._send(w, self._pending.popleft())
        now = time.monotonic()
        deadlines = [w.sent_at + self.timeout_s if w.task else w.started + self.startup_timeout_s
                     for w in self._workers if w.task or not w.ready]
        if (due := self._queue_deadline()) is not None:
            deadlines.append(due)
        wait_s = max(0.0, min(deadlines) - now) if deadlines else None
        for conn in wait([w.conn for w in self._workers] + [self._wake_r], timeout=wait_s):
            if conn is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
                continue
            self._receive(next(w for w in self._workers if w.conn is conn))
        self._expire(time.monotonic())
        return True

    def _send(self, w: WorkerHandle, task: _Task) -> None:
        try:
            w.conn.send(task[3])
        except (OSError, ValueError):  # worker died while idle
            self._pending.appendleft(task)
            self._replace(w)
            return
        w.task, w.sent_at = task, time.monotonic()

    def _receive(self, w: WorkerHandle) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            kind, payload = "error", "worker exited"
        if kind == "ready":
            w.ready, self._start_failures = True, 0
            if self._first_ready is None:
                self._first_ready = time.monotonic()
            return
        if kind == "failed":
            raise RewardPoolError(f"reward pool {self.names}: a worker could not load the "
                                  f"rewards ({payload}): check that they import in a fresh "
                                  f"process")
        if w.task is None:  # a dead idle worker
            if not w.ready:
                w.process.join(timeout=5)
                self._start_failures += 1
                # Before any worker was ready, dying is an import/config bug (restarting would
                # loop); a replacement killed from outside starts again, a few times in a row.
                if self._first_ready is None or self._start_failures > MAX_START_FAILURES:
                    raise RewardPoolError(f"reward pool {self.names}: a worker exited during "
                                          f"start-up (exit code {w.process.exitcode}): check "
                                          f"that the rewards import in a fresh process and "
                                          f"that reward.worker_memory_mb leaves room for them")
                log.warning("a reward worker exited before it was ready (exit code %s); "
                            "starting another", w.process.exitcode)
            self._replace(w)
            return
        call, r, i, _ = w.task
        w.task = None
        self.counters["calls"] += 1
        if kind == "ok" and math.isfinite(payload):
            call.put(r, i, payload)
        else:
            self.counters["errors"] += 1
            log.warning("reward %s raised on example %d: %s", self.names[r], i,
                        payload if kind != "ok" else f"non-finite {payload}")
            call.put(r, i, 0.0)
        if payload == "worker exited":
            self._replace(w)

    def _queue_deadline(self) -> float | None:
        """When the oldest queued pair's call runs out of time (None: no deadline applies).
        The queue is in submission order (a re-queued pair goes back to its head), so its head
        is the oldest call."""
        if self.deadline_s <= 0 or self._first_ready is None or not self._pending:
            return None
        return max(self._pending[0][0].submitted, self._first_ready) + self.deadline_s

    def _expire_queued(self, now: float) -> None:
        """Score 0.0 (counted in ``deadline_zeros``) for queued pairs past their deadline."""
        with self._lock:
            expired = []
            while (due := self._queue_deadline()) is not None and now >= due:
                expired.append(self._pending.popleft())
        for call, r, i, _ in expired:
            call.put(r, i, 0.0)
        if expired:
            self.counters["deadline_zeros"] += len(expired)
            log.warning("%d reward pairs still queued after reward.deadline_s = %.1fs scored 0 "
                        "(counted in reward/deadline_zeros)", len(expired), self.deadline_s)

    def _expire(self, now: float) -> None:
        self._expire_queued(now)
        for w in list(self._workers):
            if w.task is not None and now - w.sent_at > self.timeout_s:
                call, r, i, _ = w.task
                w.task = None
                self.counters["calls"] += 1
                self.counters["timeouts"] += 1
                log.warning("reward %s timed out after %.2fs on example %d; replacing its "
                            "worker", self.names[r], self.timeout_s, i)
                self._replace(w)
                call.put(r, i, 0.0)
            elif not w.ready and now - w.started > self.startup_timeout_s:
                raise RewardPoolError(f"reward pool {self.names}: a worker was not ready "
                                      f"{self.startup_timeout_s:g}s after it started: check "
                                      f"that the rewards import quickly in a fresh process")

    def _replace(self, worker: WorkerHandle) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = WorkerHandle(self._ctx, self._worker_args)
        self.counters["worker_restarts"] += 1
