"""The async rollout runner: keeps the staleness controller's capacity full with groups from a
prompt iterator and hands finished groups to the trainer side via ``await get_batch(version)``.

It runs on the caller's event loop and never blocks it: episodes await the engine and the reward
pool, and the (possibly file-backed) prompt iterator is advanced in a worker thread.

A group that raises is logged, counted (``errored_groups``) and skipped, but the run does not spin
on a cause that fails every group: a ``UserError`` from a group (a broken reward pool) or
``max_failed_groups`` failures in a row with no group finishing in between ends the stream, and
``get_batch`` raises a ``UserError`` naming the cause. So does a reward that scores every sample
alike (``watch.RolloutWatch``); while the trainer waits, a line every ``status_every_s`` says what
the rollout is doing.

A group dropped as stale at hand-over has its prompt generated again, never skipped; the work not
yet trained on is saved and restored with ``rollout_state`` (``workflows.rollout_state``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from meshrl.inference.async_sampler import SamplerShutdownError
from meshrl.utils.errors import UserError, one_line
from meshrl.utils.log import get_logger
from meshrl.workflows.batch import Trajectory
from meshrl.workflows.episode import SamplerClient, arun_group
from meshrl.workflows.rollout_state import decode_group, encode_group, encode_item
from meshrl.workflows.staleness import StalenessController
from meshrl.workflows.watch import RolloutWatch, waiting_line

log = get_logger("workflows")

# Errors every later group would meet too: the run stops at the first (a user's mistake, or a
# sampler whose decode loop is gone; the sampler logged its own traceback).
FATAL = (UserError, SamplerShutdownError)

Group = list[Trajectory]
GroupFn = Callable[[dict, int], Awaitable[Group | None]]  # (item, group_id) -> group or None


class PromptsExhaustedError(RuntimeError):
    """The prompt iterator ran out and every accepted group has been handed over."""


class RolloutFailedError(UserError, RuntimeError):
    """Every recent group failed: the run cannot make progress until the cause is fixed."""


def group_episode_fn(engine: SamplerClient, *, group_size: int, filter_equal: bool = True,
                     counters: collections.Counter[str] | None = None,
                     watch: RolloutWatch | None = None, **episode_kwargs: Any) -> GroupFn:
    """``arun_group`` bound to an engine and settings, in the runner's ``(item, group_id)`` form;
    ``watch`` sees every scored group, the filtered ones too."""
    if watch is None:
        async def plain(item: dict, group_id: int) -> Group | None:
            return await arun_group(engine, item, group_size=group_size, group_id=group_id,
                                    filter_equal=filter_equal, counters=counters,
                                    **episode_kwargs)
        return plain
    counts = counters if counters is not None else collections.Counter()

    async def watched(item: dict, group_id: int) -> Group | None:
        # Filtered here, not in arun_group: the watch needs a filtered group's rewards too.
        group = await arun_group(engine, item, group_size=group_size, group_id=group_id,
                                 filter_equal=False, counters=(own := collections.Counter()),
                                 **episode_kwargs)
        rewards = [t.reward for t in group] if group is not None else []
        keep = group is not None and not (filter_equal and group_size > 1
                                          and len(set(rewards)) == 1)
        if group is not None:
            watch.on_scored(rewards, keep)
            own = collections.Counter({"accepted_groups" if keep else "filtered_equal_groups": 1})
        counts.update(own)
        return group if keep else None
    return watched


class RolloutRunner:
    """Usage (inside a running event loop)::

        runner = RolloutRunner(group_fn, prompts, controller)
        runner.start()
        groups = await runner.get_batch(version)   # controller.batch_size groups
        ...
        await runner.stop()

    ``prompts`` yields example dicts or lists of them (``make_prompt_iterator`` batches).
    """

    def __init__(self, group_fn: GroupFn, prompts: Iterator[Any],
                 controller: StalenessController, *, first_group_id: int = 0,
                 counters: collections.Counter[str] | None = None,
                 max_failed_groups: int = 64, watch: RolloutWatch | None = None,
                 status_every_s: float = 30.0, track_prompts_state: bool = False,
                 metric_sources: Sequence[Callable[[], dict[str, float]]] = ()) -> None:
        self.group_fn, self.prompts, self.controller = group_fn, prompts, controller
        self.max_failed_groups = max_failed_groups
        # ``prompts.get_state()`` after each read (for ``rollout_state``); off for iterators
        # without one.
        self.track_prompts_state = track_prompts_state
        self.watch, self.status_every_s = watch, status_every_s
        self.metric_sources = tuple(metric_sources)  # more metrics, e.g. agent episodes' counts
        self._failed_in_row = 0
        # Share one Counter with group_episode_fn so filtering counts reach metrics/state_dict.
        self.counters = counters if counters is not None else collections.Counter()
        self._next_group_id = first_group_id
        self._items: collections.deque[dict] = collections.deque()
        # Finished groups, oldest generated token first (earliest staleness deadline first);
        # ties in arrival order. Entries: (oldest version, arrival, group or None = end).
        self._queue: asyncio.PriorityQueue[tuple[float, int, Group | None]] = (
            asyncio.PriorityQueue())
        self._arrival = itertools.count()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._filler: asyncio.Task | None = None
        self._exhausted = False
        # Whether an end marker for the current end of the prompts is in the queue. Groups in
        # flight are ``controller.running`` (the task set lags a finished group by a loop turn).
        self._ended = False
        self._error: BaseException | None = None
        # Rollout state (``rollout_state``): every started group's item until the trainer takes
        # it, the finished ones' groups, and the prompts that ended untrained since the last
        # ``take_record``. ``_prompts_state`` is the iterator's state after the last whole
        # read, so it always agrees with the items the runner holds.
        self._open: dict[int, dict] = {}
        self._finished: dict[int, Group] = {}
        self._skipped: list[tuple[dict, str]] = []
        self._taken: list[dict] = []
        self._prompts_state: Any = None

    def start(self) -> None:
        if self._filler is None:
            if self.track_prompts_state and self._prompts_state is None:
                self._prompts_state = self.prompts.get_state()  # before any read starts
            self._filler = asyncio.get_running_loop().create_task(self._fill())

    def _read(self, n: int) -> tuple[list[Any], Any]:
        """(up to ``n`` items' worth of the iterator's batches (fewer only at its end), the
        iterator's state after them when tracked)."""
        out, got = [], 0
        while got < n:
            batch = next(self.prompts, None)
            if batch is None:
                break
            out.append(batch)
            got += 1 if isinstance(batch, dict) else len(batch)
        return out, self.prompts.get_state() if self.track_prompts_state else None

    async def _next_items(self, n: int) -> list[dict]:
        """The next ``n`` items (fewer only at the end of the prompts)."""
        if len(self._items) < n and not self._exhausted:
            # A file-backed iterator may read from disk: keep that off the event loop, and read
            # all ``n`` in one worker-thread call, so the episodes of a whole batch reach the
            # sampler together (one thread hop per prompt let it start on the first group).
            batches, state = await asyncio.to_thread(self._read, n - len(self._items))
            for batch in batches:
                self._items.extend([batch] if isinstance(batch, dict) else batch)
            if self.track_prompts_state:  # with the items, on the loop: a save sees both
                self._prompts_state = state
        return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    async def _fill(self) -> None:
        try:
            while True:
                self._wake.clear()
                while self.controller.can_admit():
                    want = self.controller.capacity()
                    items = await self._next_items(want)
                    for item in items:
                        self._admit(item)
                    if len(items) < want:
                        self._exhausted = True
                        break
                # Alive past the end of the prompts: a group dropped as stale later puts its
                # item back, and only this loop admits it again.
                if self._exhausted and not (self.controller.running or self._items or self._ended):
                    self._ended = True
                    self._put(None)  # end of stream (sorts last): wakes a waiting get_batch
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except UserError as e:  # bad input (an over-long prompt): get_batch raises it as it is
            self._error = e
        except BaseException as e:  # noqa: BLE001  (surface to the consumer, do not hang it)
            log.exception("rollout filler failed")
            self._error = e
        self._put(None)

    def _admit(self, item: dict) -> None:
        self.controller.on_submit()
        self._open[self._next_group_id] = item
        task = asyncio.create_task(self._run_group(item, self._next_group_id))
        self._next_group_id += 1
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, item: dict, group_id: int) -> None:
        try:
            group = await self.group_fn(item, group_id)
        except asyncio.CancelledError:
            self.controller.on_reject()
            raise
        except Exception as e:  # noqa: BLE001  (one bad episode must not stop the pipeline)
            if isinstance(e, FATAL):  # stops the run: its one line says all
                log.error("rollout group %d failed: %s", group_id, one_line(e))
            else:
                log.exception("rollout group %d failed; counted in errored_groups", group_id)
            self.counters["errored_groups"] += 1
            self._failed_in_row += 1
            self._stop_if_failing(e)
            group = None
        else:
            self._failed_in_row = 0
            if self.watch is not None and self.watch.error is not None and self._error is None:
                self._end_stream(self.watch.error)
        if group is None:
            self.controller.on_reject()
            item = self._open.pop(group_id, None)
            if item is not None:
                self._skipped.append((item, "errored" if self._failed_in_row else "filtered"))
        else:
            self.controller.on_accept()
            self._finished[group_id] = group
            self._put(group)
        self._wake.set()

    def _stop_if_failing(self, error: Exception) -> None:
        """End the stream (``get_batch`` raises) when ``error`` will fail every group."""
        if self._error is not None:
            return
        if isinstance(error, FATAL):
            self._error = error
        elif self._failed_in_row >= self.max_failed_groups:
            self._error = RolloutFailedError(
                f"rollout: {self._failed_in_row} groups in a row failed "
                f"(rollout.max_failed_groups = {self.max_failed_groups}), the last with "
                f"{type(error).__name__}: {one_line(error)}: fix its cause (the log holds each "
                f"traceback)")
            self._error.__cause__ = error
        else:
            return
        self._end_stream(self._error)

    def _end_stream(self, error: BaseException) -> None:
        """Admit no more groups; ``get_batch`` raises ``error`` once the queue is drained."""
        if self._error is None:
            self._error = error
        if self._filler is not None:
            self._filler.cancel()  # admit no more groups
        self._put(None)

    def _put(self, group: Group | None) -> None:
        oldest = math.inf if group is None else min(t.oldest_version for t in group)
        self._queue.put_nowait((oldest, next(self._arrival), group))

    async def get_batch(self, version: int) -> list[Group]:
        """``controller.batch_size`` groups, none staler than allowed at ``version`` (stale ones
        are dropped and counted). Raises PromptsExhaustedError at the end of the prompts.

        Waiting groups are taken oldest token first, not in completion order: a long-tailed
        group finishes late with old tokens, and taking it before fresher ones that can still
        wait a version keeps it from going stale (earliest deadline first)."""
        self.controller.set_version(version)
        self._wake.set()  # a new version opens capacity
        out: list[Group] = []
        ticker = asyncio.get_running_loop().create_task(self._report_waiting(version, out))
        try:
            groups = await self._gather(out)
        except (asyncio.CancelledError, PromptsExhaustedError):
            # Not trained: a partial batch at the end of the prompts is not consumed either.
            self._hand_back(out)
            raise
        finally:
            ticker.cancel()
        # Taken only now: a get_batch cancelled half-way (a stop request) handed its groups
        # back, and the rollout state a checkpoint then saves still holds them.
        for group in groups:
            gid = group[0].group_id
            self._finished.pop(gid, None)
            if (item := self._open.pop(gid, None)) is not None:
                self._taken.append(item)
        return groups

    def _hand_back(self, out: list[Group]) -> None:
        """Undo the consumption of a cancelled ``get_batch``'s groups: back in the queue."""
        for group in out:
            self.controller.unconsume(group)
            self._put(group)

    async def _report_waiting(self, version: int, out: list[Group]) -> None:
        """Every ``status_every_s`` while a batch is awaited: what the rollout has done."""
        if self.watch is None:
            return
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(self.status_every_s)
            log.info(waiting_line(self.watch.window, version=version,
                                  ready=len(out) + self._queue.qsize(),
                                  batch_size=self.controller.batch_size,
                                  in_flight=self.controller.running,
                                  waited_s=time.monotonic() - t0))

    async def _gather(self, out: list[Group]) -> list[Group]:
        while len(out) < self.controller.batch_size:
            entry = await self._queue.get()
            group = entry[2]
            if group is None:
                if self._error is None and (self.controller.running or self._items):
                    # Work put back or still running after the marker was queued (a stale
                    # group's prompt): the filler queues a new marker when it is done.
                    self._ended = False
                    self._wake.set()
                    continue
                self._queue.put_nowait(entry)  # keep the end marker for later calls
                if isinstance(self._error, FATAL):
                    raise self._error
                if self._error is not None:
                    raise RuntimeError("the rollout filler failed") from self._error
                raise PromptsExhaustedError(
                    f"prompts exhausted with {len(out)} of {self.controller.batch_size} groups")
            if self.controller.consume(group):
                out.append(group)
            else:
                gid = group[0].group_id
                self._finished.pop(gid, None)
                if (item := self._open.pop(gid, None)) is not None:  # generated again
                    self._items.appendleft(item)
                    self.counters["requeued_stale_groups"] += 1
                self._wake.set()  # the dropped group's slot is free again
        return out

    def take_record(self) -> tuple[list[dict], list[tuple[dict, str]]]:
        """(the items of the groups handed over since the last call, the items whose groups
        ended untrained since then with the reason); both cleared."""
        taken, skipped = self._taken, self._skipped
        self._taken, self._skipped = [], []
        return taken, skipped

    def rollout_state(self) -> dict[str, Any]:
        """The untrained work (see ``workflows.rollout_state``) and the prompt iterator's
        state that goes with it; call between ``take_record`` and the next ``get_batch``."""
        started = sorted(self._open)
        return {"prompts": self._prompts_state,
                "finished": [encode_group(self._open[g], self._finished[g])
                             for g in started if g in self._finished],
                "pending": [encode_item(self._open[g]) for g in started
                            if g not in self._finished] + [encode_item(i) for i in self._items],
                "skipped": [[encode_item(i), why] for i, why in self._skipped]}

    def load_rollout_state(self, state: dict[str, Any]) -> None:
        """Restore ``rollout_state()``'s untrained work (before ``start``); the controller's
        state must be loaded first."""
        for entry in state["finished"]:
            item, group = decode_group(entry)
            gid = group[0].group_id
            self._open[gid], self._finished[gid] = item, group
            self.controller.accepted += 1
            self._put(group)
        self._items.extend(state["pending"])
        self._skipped = [(i, why) for i, why in state["skipped"]]

    async def stop(self) -> None:
        """Cancel the filler and every running group (they count as rejected)."""
        tasks = ([self._filler] if self._filler is not None else []) + list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._filler = None

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict(), "next_group_id": self._next_group_id,
                "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state["controller"])
        self._next_group_id = int(state["next_group_id"])
        self.counters.clear()
        self.counters.update(state["counters"])

    def metrics(self) -> dict[str, float]:
        out = {**self.controller.metrics(),
               **{f"rollout/{k}": float(v) for k, v in self.counters.items()}}
        for source in self.metric_sources:
            out.update(source())
        return out
