"""Admission by ``Request.priority``: a higher priority is admitted before every lower one still
queued, first come, first served among equals, on the dense and the paged cache; nothing
running is preempted, and what each request generates does not depend on when it ran."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.requests import Request, RequestQueue
from meshrl.tests.inference.tiny import make_sampler


def _requests(priorities: list[int]) -> list[Request]:
    rng = np.random.default_rng(3)
    return [Request(rng.integers(3, 96, size=6).tolist(), max_new_tokens=4, priority=p, id=i)
            for i, p in enumerate(priorities)]


def test_queue_pops_highest_priority_then_earliest():
    q = RequestQueue()
    for r in _requests([0, 2, 0, 2, 1]):
        q.append(r)

    assert len(q) == 5 and q.head().id == 1
    assert [q.popleft().id for _ in range(5)] == [1, 3, 4, 0, 2]
    assert not q


def test_numpy_integer_priorities_order_as_their_values():
    # Negating a numpy uint8 or int8 wraps around; the queue must order by the value.
    q = RequestQueue()
    for r in _requests([0, np.uint8(1), np.int8(-128), np.int64(2)]):
        q.append(r)

    assert [q.popleft().id for _ in range(4)] == [3, 1, 0, 2]


def _admission_order(sampler) -> list:
    order, prefill = [], sampler._run_prefill
    sampler._run_prefill = lambda seqs, slots, reqs, *a: order.extend(
        r.id for r in reqs) or prefill(seqs, slots, reqs, *a)
    return order


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_higher_priority_is_admitted_first_without_preempting_the_running(tiny_params, kv_cache):
    _, params = tiny_params
    kw = dict(slots=1, kv_cache=kv_cache, page_size=8)
    reqs = _requests([0, 0, 0, 5, 5, 1])
    want = make_sampler(params, **kw).generate(reqs, longest_first=False)
    sampler = make_sampler(params, **kw)
    order = _admission_order(sampler)

    sampler.submit(reqs[0])
    outs = sampler.step()  # request 0 takes the only slot
    for r in reqs[1:]:
        sampler.submit(r)
    while sampler.has_work():
        outs += sampler.step()

    assert order == [0, 3, 4, 5, 1, 2]
    got = sorted(outs, key=lambda c: c.request.id)
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_equal_priorities_keep_arrival_order(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, slots=1)
    order = _admission_order(sampler)

    sampler.generate(_requests([2, 2, 2]), longest_first=False)

    assert order == [0, 1, 2]


@pytest.mark.parametrize("priority", [1.5, True, None, "1"])
def test_a_priority_that_is_not_an_integer_is_rejected_before_queueing(tiny_params, priority):
    _, params = tiny_params
    sampler = make_sampler(params)

    with pytest.raises(ValueError, match=f"priority = {priority!r}: must be an integer"):
        sampler.submit(Request([5, 6], priority=priority))

    assert not sampler.has_work()


def test_the_async_facade_admits_by_priority(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, slots=1)
    order = _admission_order(sampler)
    engine = AsyncSampler(sampler)
    reqs = _requests([0, 0, 3, 1])

    async def main():
        engine.pause()  # every request is queued before the first admission
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        while len(engine._inbox) < len(reqs):
            await asyncio.sleep(0)
        engine.resume()
        return await asyncio.gather(*tasks)
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()

    assert [tagged[2] for tagged in order] == [2, 3, 0, 1]  # the facade's ("async", n, id)
    assert [o.request.id for o in outs] == [0, 1, 2, 3]
