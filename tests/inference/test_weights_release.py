"""The sampler's weights freed with its KV cache (``rl.release_sampler_weights``): the buffers
are really deleted, nothing decodes until a handoff refills them, every sequence in flight
finishes with the tokens it would have had, and with LoRA the kept frozen base survives."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.test_lora_handoff import _adapters, _setup
from meshrl.tests.inference.test_weights import _sampler
from meshrl.tests.inference.tiny import TINY, make_sampler
from meshrl.utils.params import flat_params

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42, 43, 44, 45, 46], [7, 8], [88, 12, 19]]


@pytest.fixture(scope="module")
def tiny_params():
    return split_model(create_model(TINY, seed=0))[1]


def _drain(sampler) -> list:
    outs = []
    while sampler.has_work():
        outs += sampler.step()
    return outs


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_weights_released_mid_generation_are_deleted_and_the_handoff_finishes_every_sequence(
        tiny_params, kv_cache):
    kw = dict(kv_cache=kv_cache, page_size=4) if kv_cache == "paged" else {}
    want = make_sampler(tiny_params, **kw).generate(
        [Request(p, max_new_tokens=12) for p in PROMPTS])
    sampler = make_sampler(tiny_params, **kw)
    for i, p in enumerate(PROMPTS):
        sampler.submit(Request(p, max_new_tokens=12, id=i))
    finished = sampler.step() + sampler.step()  # a round read back, one still in flight
    weights = jax.tree.leaves(sampler.params)
    held = sum(x.nbytes for x in jax.live_arrays())

    sampler.release_cache(weights=True)
    freed = held - sum(x.nbytes for x in jax.live_arrays())
    deleted = sampler.params is None and all(x.is_deleted() for x in weights)
    sampler.update_weights(tiny_params, 1)  # the handoff refills them, then the cache
    sampler.restore_cache()
    got = sorted(finished + _drain(sampler), key=lambda c: c.request.id)

    assert deleted
    assert freed >= sum(x.nbytes for x in weights)  # the weights' bytes left the device
    assert [c.request.id for c in got] == list(range(len(PROMPTS)))
    assert [c.tokens for c in got] == [c.tokens for c in want]  # greedy: re-prefill is exact
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_a_sampler_with_released_weights_refuses_to_step_until_a_handoff(tiny_params):
    sampler = make_sampler(tiny_params)
    sampler.submit(Request(PROMPTS[0], max_new_tokens=4))
    sampler.release_cache(weights=True)
    sampler.restore_cache()  # the cache alone is not enough

    with pytest.raises(RuntimeError, match=r"^the sampler has no weights: call "
                                           r"update_weights/load_weights$"):
        sampler.step()
    sampler.update_weights(tiny_params, 1)
    assert len(_drain(sampler)) == 1


def test_async_weights_release_mid_generation_holds_decoding_until_the_handoff(tiny_params):
    engine = AsyncSampler(make_sampler(tiny_params, decode_chunk=2))
    want = make_sampler(tiny_params).generate([Request(p, max_new_tokens=20) for p in PROMPTS])

    async def main():
        tasks = [asyncio.create_task(engine.agenerate(Request(p, max_new_tokens=20)))
                 for p in PROMPTS]
        while not any(c is not None and len(c.tokens) >= 3 for c in engine.sampler.slots.out):
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.release_cache, True)
        released = engine.sampler.params is None
        await asyncio.sleep(0.02)  # requests keep arriving while nothing can decode
        await asyncio.to_thread(engine.update_weights, tiny_params, 1)
        engine.restore_cache()
        return released, await asyncio.gather(*tasks)
    try:
        released, outs = asyncio.run(main())
    finally:
        engine.shutdown()

    assert released
    assert [o.tokens for o in outs] == [w.tokens for w in want]


@pytest.mark.distributed
def test_lora_release_keeps_the_frozen_base_and_the_next_adapter_handoff_merges_into_it():
    setup, frozen = _setup("float32")
    sampler, make = _sampler("float32"), _adapters(setup)
    sampler.update_weights(setup.update(make(1), frozen, with_base=True), 1)
    base = jax.tree.leaves(sampler.weights.kept_base())
    merged = jax.tree.leaves(sampler.params)

    sampler.release_cache(weights=True)
    gone = sampler.params is None and all(x.is_deleted() for x in merged)
    sampler.update_weights(setup.update(make(2), frozen, with_base=False), 2)  # adapters only
    sampler.restore_cache()
    want = sampler.weights.handoff(setup.merged(frozen, make(2)))

    assert gone and base and not any(x.is_deleted() for x in base)
    assert sampler.version == 2
    got = flat_params(sampler.params)
    for name, w in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(w), rtol=1e-6, atol=1e-6,
                                   err_msg=name)
