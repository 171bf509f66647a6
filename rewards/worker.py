"""The reward worker process: its resource limits and its task loop.

A worker resolves every configured reward before it reports ready, so a reward that cannot be
imported in a fresh process fails the pool at start-up (one clear error) instead of scoring a
counted 0 on every pair. Limits, set once in the worker and never in the JAX process:

* ``RLIMIT_AS`` (``memory_mb``): a reward that allocates more gets ``MemoryError``, which is a
  counted 0 like any other failure; the worker lives on. 0 leaves the address space unlimited.
* ``RLIMIT_CPU`` per pair: ``CPU_SECONDS_PER_TIMEOUT_SECOND x timeout_s + 1`` CPU seconds on top
  of what the worker has used so far. The pool's wall-clock timeout normally fires first; the CPU
  limit stops a worker whose pool is gone (its parent killed) from spinning on for good. The
  kernel terminates it with SIGXCPU, even inside a C call.
* ``RLIMIT_CORE`` 0: a worker killed by a limit writes no core file.

Each worker leads its own process group, which the pool kills with it (``WorkerHandle``, the
pool's side of a worker).
"""

from __future__ import annotations

import math
import numbers
import os
import resource
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from meshrl.rewards.registry import RewardFn, get

# CPU seconds a pair may use per second of its wall-clock timeout: a reward may run a few threads
# (numpy), and the wall-clock timeout, not this backstop, is the limit a scoring call meets.
CPU_SECONDS_PER_TIMEOUT_SECOND = 2.0
MIB = 1 << 20


def apply_limits(memory_mb: int) -> None:
    """The worker's lifetime limits: no core files, and ``memory_mb`` MiB of address space."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb > 0:
        limit = memory_mb * MIB
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        # The hard limit comes down too: a reward is trusted code, but nothing it calls should be
        # able to lift the cap again.
        hard = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _cpu_budget(timeout_s: float) -> None:
    """Allow the next pair ``CPU_SECONDS_PER_TIMEOUT_SECOND x timeout_s + 1`` CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + CPU_SECONDS_PER_TIMEOUT_SECOND * timeout_s)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft += 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def worker_main(conn: Connection, names: Sequence[str], memory_mb: int,
                timeout_s: float) -> None:
    """Report ``("ready", None)`` (or ``("failed", why)``), then answer each task
    ``(name, prompt, completion, fields)`` with ``("ok", value)`` or ``("error", why)``."""
    # The built-in rewards are registered: importing this module ran meshrl/rewards/__init__.py.
    # A process group of its own: the pool kills the group, so what a reward started (a
    # subprocess, a forked child) does not outlive a timeout or the pool.
    os.setsid()
    apply_limits(memory_mb)
    try:
        rewards: dict[str, RewardFn] = {name: get(name) for name in names}
    except BaseException as e:  # noqa: BLE001  (reported to the pool, which stops)
        conn.send(("failed", f"{type(e).__name__}: {e}"[:500]))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if task is None:
            return
        name, prompt, completion, fields = task
        _cpu_budget(timeout_s)
        try:
            value = rewards[name]([prompt], [completion], **{k: [v] for k, v in fields.items()})
            conn.send(("ok", _one_number(name, value)))
        except BaseException as e:  # noqa: BLE001  (any failure of a reward is a counted 0)
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


def _one_number(name: str, value: object) -> float:
    """The one score of a one-completion call: a real number, not a string or a bool that
    ``float`` would take, and not one of several (the rest silently dropped)."""
    items = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__array__") else []
    if (len(items) != 1 or isinstance(items[0], (bool, str, bytes))
            or not isinstance(items[0], numbers.Real)):
        raise TypeError(f"reward {name} returned {value!r:.80}: must be one number per "
                        f"completion")
    return float(items[0])


class WorkerHandle:
    """The pool's side of one worker process: its pipe, readiness and the task it holds."""

    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: Any = None  # the pool's task in hand (``pool._Task``), None when idle
        self.sent_at = 0.0

    def kill(self) -> None:
        """Kill the worker and its process group (what its rewards started, too; the group is
        the worker's pid once it has called setsid, and none before)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def shutdown_workers(workers: list[WorkerHandle]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        w.process.join(timeout=1)
        w.kill()
