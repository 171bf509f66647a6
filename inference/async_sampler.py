"""Async facade over the sampler: ``await engine.agenerate(request)`` from asyncio code.

The decode loop runs in its own thread, so workflows never block the event loop on device
work; results come back through ``loop.call_soon_threadsafe``. ``pause()`` returns once no chunk
is running (a safe point for weight updates); ``resume()`` restarts the loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
from typing import Any

from meshrl.inference.sampler import Completion, Request, Sampler
from meshrl.utils.errors import one_line
from meshrl.utils.log import get_logger

log = get_logger("inference")


class SamplerShutdownError(RuntimeError):
    """The engine was shut down before the request finished."""


class SamplerFailedError(SamplerShutdownError):
    """The decode loop failed (a device out of memory, say): the engine is shut down, and this
    request, every one in flight and every later one fail with the cause."""


class AsyncSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._cv = threading.Condition()
        self._inbox: collections.deque[Request] = collections.deque()
        self._withdrawn: list[Any] = []  # cancelled requests to drop from the sampler's queue
        self._futures: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._paused = self._stepping = self._shutdown = self._released = False
        self._failure: SamplerFailedError | None = None  # why the decode loop stopped
        self._thread = threading.Thread(target=self._run, name="meshrl-sampler", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self.sampler.version

    async def agenerate(self, request: Request) -> Completion:
        """Generate one completion; many may be awaited concurrently (continuous batching)."""
        self.sampler.validate(request)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        request = dataclasses.replace(request, id=("async", next(self._ids), request.id))
        with self._cv:
            if self._failure is not None:
                raise SamplerFailedError(str(self._failure)) from self._failure.__cause__
            if self._shutdown:
                raise SamplerShutdownError("the engine is shut down")
            self._futures[request.id] = (loop, fut)
            self._inbox.append(request)
            self._cv.notify_all()
        try:
            out: Completion = await fut
        except asyncio.CancelledError:
            self._withdraw(request.id)
            raise
        # Hand the caller back the request it passed in (its own id).
        return dataclasses.replace(out, request=dataclasses.replace(out.request,
                                                                    id=request.id[2]))

    def _withdraw(self, request_id: Any) -> None:
        """A cancelled caller's request: out of the inbox, or out of the sampler's queue at
        the loop thread's next turn (the event loop never waits for a decode chunk); one
        already decoding runs to its end, its result dropped."""
        with self._cv:
            self._futures.pop(request_id, None)
            kept = [r for r in self._inbox if r.id != request_id]
            if len(kept) < len(self._inbox):
                self._inbox = collections.deque(kept)
            else:
                self._withdrawn.append(request_id)
                self._cv.notify_all()

    def pause(self) -> None:
        """Stop after the current chunk; returns when no chunk is running."""
        with self._cv:
            self._paused = True
            self._cv.wait_for(lambda: not self._stepping)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def release_cache(self, weights: bool = False) -> None:
        """Free the sampler's KV cache (and with ``weights`` its params, until the next
        ``update_weights``) after the current chunk; the loop stays stopped, across pauses and
        weight updates, until ``restore_cache`` (sequences in flight are kept)."""
        with self._cv:
            self._released = True
            self._cv.wait_for(lambda: not self._stepping)
        # Outside the condition: it waits for the device, and agenerate takes the condition
        # on the event loop; the loop thread stays stopped while ``_released``.
        self.sampler.release_cache(weights)

    def restore_cache(self) -> None:
        with self._cv:
            self.sampler.restore_cache()
            self._released = False
            self._cv.notify_all()

    def update_weights(self, params: Any, version: int) -> None:
        """Copy and cast the weights while decoding goes on, then pause, swap them in
        (in-flight sequences are re-prefilled) and resume.

        The copy waits for the computation producing ``params`` (the trainer's step); pausing
        only for the swap keeps the sampler decoding with the old version meanwhile."""
        flat = self.sampler.prepare_weights(params)
        self.pause()
        try:
            self.sampler.install_weights(flat, version)
        finally:
            self.resume()

    def load_weights(self, version: int) -> None:
        self.pause()
        try:
            self.sampler.load_weights(version)
        finally:
            self.resume()

    def shutdown(self) -> None:
        """Stop the loop thread; pending requests fail with SamplerShutdownError."""
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()
        self._thread.join()
        for loop, fut in self._futures.values():
            loop.call_soon_threadsafe(_fail, fut, SamplerShutdownError("the engine was shut down"))
        self._futures.clear()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._shutdown or (
                    not (self._paused or self._released)
                    and bool(self._inbox or self.sampler.has_work())))
                if self._shutdown:
                    return
                while self._withdrawn:
                    self.sampler.withdraw(self._withdrawn.pop())
                while self._inbox:
                    self.sampler.submit(self._inbox.popleft())
                self._stepping = True
            try:
                done = self.sampler.step()
            except Exception as e:  # surface to every waiter instead of dying silently
                log.exception("sampler step failed")
                failure = SamplerFailedError(f"the sampler's decode loop failed: "
                                             f"{type(e).__name__}: {one_line(e)}")
                failure.__cause__ = e
                with self._cv:
                    waiters, self._futures = self._futures, {}
                    self._shutdown = True
                    self._failure = failure
                    self._stepping = False
                    self._cv.notify_all()
                for loop, fut in waiters.values():
                    loop.call_soon_threadsafe(_fail, fut, failure)
                return
            with self._cv:
                self._stepping = False
                self._cv.notify_all()
                resolved = [(self._futures.pop(c.request.id), c) for c in done
                            if c.request.id in self._futures]
            for (loop, fut), c in resolved:
                loop.call_soon_threadsafe(_resolve, fut, c)


def _resolve(fut: asyncio.Future, value: Completion) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
