"""The asyncio facade: concurrent awaits, pause/update/resume, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshrl.inference.async_sampler import AsyncSampler, SamplerShutdownError
from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler

PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45], [7], [88, 12, 19], [3, 4, 5], [60, 61]]


def test_concurrent_agenerate_equals_synchronous_generate(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    expected = sampler.generate([Request(p, max_new_tokens=6) for p in PROMPTS])
    engine = AsyncSampler(sampler)

    async def main():
        return await asyncio.gather(*(engine.agenerate(Request(p, max_new_tokens=6, id=f"r{i}"))
                                      for i, p in enumerate(PROMPTS)))
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()

    assert [o.tokens for o in outs] == [e.tokens for e in expected]
    assert [o.request.id for o in outs] == [f"r{i}" for i in range(len(PROMPTS))]
    assert not engine._thread.is_alive()


def test_update_while_requests_run_tags_both_versions(tiny_params):
    _, params = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    engine = AsyncSampler(make_sampler(params, max_len=64, decode_chunk=2))

    async def main():
        tasks = [asyncio.create_task(engine.agenerate(Request(p, max_new_tokens=40)))
                 for p in PROMPTS[:4]]
        while engine.sampler.version == 0 and not any(t.done() for t in tasks):
            if any(c is not None and len(c.tokens) >= 3 for c in engine.sampler.slots.out):
                await asyncio.to_thread(engine.update_weights, new, 1)
            await asyncio.sleep(0.001)
        return await asyncio.gather(*tasks)
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()

    for o in outs:
        assert o.versions[0] == 0 and o.versions[-1] == 1
        assert o.versions == sorted(o.versions)  # never back to the old version


def test_shutdown_fails_pending_requests_and_rejects_new_ones(tiny_params):
    _, params = tiny_params
    engine = AsyncSampler(make_sampler(params))
    engine.pause()

    async def main():
        task = asyncio.create_task(engine.agenerate(Request([5, 6, 7])))
        await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(SamplerShutdownError):
            await task
        with pytest.raises(SamplerShutdownError):
            await engine.agenerate(Request([5, 6, 7]))
    asyncio.run(main())


def test_decoding_goes_on_while_an_update_waits_for_its_weights(tiny_params, monkeypatch):
    # The trainer's step computes the new params while update_weights waits for them; the
    # sampler must keep decoding with the old version meanwhile and pause only for the swap.
    _, params = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    engine = AsyncSampler(make_sampler(params, max_len=64, decode_chunk=2))
    sampler = engine.sampler
    release, chunks = threading.Event(), []
    prepare, decode = sampler.prepare_weights, sampler._dispatch_chunk

    def slow_prepare(p):
        release.wait(timeout=30)
        return prepare(p)

    def counting_decode(*args):
        chunks.append(sampler.version)
        return decode(*args)
    monkeypatch.setattr(sampler, "prepare_weights", slow_prepare)
    monkeypatch.setattr(sampler, "_dispatch_chunk", counting_decode)

    async def main():
        task = asyncio.create_task(engine.agenerate(Request(PROMPTS[0], max_new_tokens=40)))
        update = asyncio.create_task(asyncio.to_thread(engine.update_weights, new, 1))
        while len(chunks) < 4:  # decoding continues while the update waits for its weights
            await asyncio.sleep(0.001)
        before = len(chunks)
        release.set()
        await update
        return await task, before
    try:
        out, before = asyncio.run(main())
    finally:
        engine.shutdown()

    assert before >= 4 and chunks[:before] == [0] * before
    assert out.versions[0] == 0 and out.versions[-1] == 1


def test_a_cancelled_request_still_waiting_for_a_slot_is_withdrawn(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, slots=1, max_len=64)
    finished: list[object] = []
    step = sampler.step

    def recording_step():
        out = step()
        finished.extend(c.request.id for c in out)
        return out

    sampler.step = recording_step
    engine = AsyncSampler(sampler)

    async def main():
        long = asyncio.create_task(engine.agenerate(Request([5, 9], max_new_tokens=40)))
        waiting = [asyncio.create_task(engine.agenerate(Request(p, max_new_tokens=40)))
                   for p in PROMPTS[:3]]
        await asyncio.sleep(0.05)  # the first holds the one slot, the others queue
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        done = await long  # a request already decoding runs to its end
        for _ in range(200):  # the loop thread drops the withdrawn ones at its next turn
            if not engine.sampler.has_work():
                break
            await asyncio.sleep(0.01)
        return done

    try:
        done = asyncio.run(main())
        left = len(engine.sampler._queue)
    finally:
        engine.shutdown()

    assert len(done.tokens) == 40 and left == 0 and not engine._futures
    assert len(finished) == 1  # only the request that was decoding: none withdrawn ran
