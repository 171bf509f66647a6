"""The sampler's KV cache, and with ``rl.release_sampler_weights`` its weights, freed across a
colocated RL run's train step: nothing is lost (every completion, every token), the buffers are
really deleted while the step runs, the handoff refills the weights, and a run with the release
trains on the same tokens with the same losses and params as one without."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import jax
import numpy as np
import pytest

from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.tests.trees import assert_trees_close

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42, 43, 44, 45, 46], [7, 8], [88, 12, 19]]


@pytest.fixture(scope="module")
def tiny_params():
    return split_model(create_model(TINY, seed=0))


def _drain(sampler) -> list:
    outs = []
    while sampler.has_work():
        outs += sampler.step()
    return sorted(outs, key=lambda c: c.request.id)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_release_with_sequences_in_flight_keeps_every_completion_and_its_tokens(
        tiny_params, kv_cache):
    _, params = tiny_params
    kw = dict(kv_cache=kv_cache, page_size=4) if kv_cache == "paged" else {}
    want = make_sampler(params, **kw).generate([Request(p, max_new_tokens=12) for p in PROMPTS])
    sampler = make_sampler(params, **kw)
    for i, p in enumerate(PROMPTS):
        sampler.submit(Request(p, max_new_tokens=12, id=i))
    finished = sampler.step() + sampler.step()  # a round read back, one still in flight
    leaves = jax.tree.leaves(sampler.cache)

    sampler.release_cache()
    released = all(leaf.is_deleted() for leaf in leaves) and sampler.cache is None
    sampler.restore_cache()
    got = sorted(finished + _drain(sampler), key=lambda c: c.request.id)

    assert released
    assert [c.request.id for c in got] == list(range(len(PROMPTS)))
    assert [c.tokens for c in got] == [c.tokens for c in want]  # greedy: re-prefill is exact
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_a_released_sampler_refuses_to_step_until_restored(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    sampler.submit(Request(PROMPTS[0], max_new_tokens=4))
    sampler.release_cache()

    with pytest.raises(RuntimeError, match=r"KV cache is released: call restore_cache\(\)"):
        sampler.step()
    sampler.restore_cache()
    assert len(_drain(sampler)) == 1


def test_async_release_mid_generation_holds_decoding_and_resolves_every_request(tiny_params):
    _, params = tiny_params
    engine = AsyncSampler(make_sampler(params, decode_chunk=2))
    want = make_sampler(params).generate([Request(p, max_new_tokens=20) for p in PROMPTS])
    held: list[int] = []

    async def main():
        tasks = [asyncio.create_task(engine.agenerate(Request(p, max_new_tokens=20)))
                 for p in PROMPTS]
        while not any(c is not None and len(c.tokens) >= 3 for c in engine.sampler.slots.out):
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.release_cache)
        before = sum(len(c.tokens) for c in engine.sampler.slots.out if c is not None)
        await asyncio.to_thread(engine.update_weights, params, 1)  # resumes: still held
        await asyncio.sleep(0.05)
        held.append(sum(len(c.tokens) for c in engine.sampler.slots.out if c is not None)
                    - before)
        engine.restore_cache()
        return await asyncio.gather(*tasks)
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()

    assert held == [0]  # nothing decoded while the cache was released
    assert [o.tokens for o in outs] == [w.tokens for w in want]


def _record(loop: Any, held: str) -> dict[str, list]:
    """Wrap the loop's sampler and engine to record, for each release, the leaves of the
    sampler's ``held`` ("cache" or "params") and their bytes, and for each train step
    dispatched whether those leaves were deleted, gone from the live arrays and unset then."""
    seen: dict[str, list] = {"released": [], "deleted_at_step": [], "bytes": []}
    sampler, engine = loop.sampler, loop.engine
    release, dispatch = sampler.release_cache, engine.dispatch

    def release_cache(weights: bool = False) -> None:
        leaves = jax.tree.leaves(getattr(sampler, held))
        seen["bytes"].append(sum(x.nbytes for x in leaves))
        release(weights)
        seen["released"].append(leaves)

    def dispatch_step(*args, **kwargs) -> Any:
        leaves = seen["released"][-1] if seen["released"] else []
        live = {id(x) for x in jax.live_arrays()}
        seen["deleted_at_step"].append(
            bool(leaves) and getattr(sampler, held) is None
            and all(x.is_deleted() and id(x) not in live for x in leaves))
        return dispatch(*args, **kwargs)

    sampler.release_cache, engine.dispatch = release_cache, dispatch_step
    return seen


def _run(tmp_path, held: str, **overrides: Any) -> tuple[list, list, dict, dict, Any]:
    """(sorted (prompt, tokens) pairs, losses, ``_record``'s record, summary, final params) of a
    synchronous two-step tiny RL run with ``overrides``."""
    from meshrl.jobs import rl as rl_job

    config = tiny_rl_config(**{"rollout.max_staleness": 0, "sampler.temperature": 1.0,
                               **overrides})
    loop = rl_job.build(config, tmp_path)
    tokens: list[tuple] = []
    seen = _record(loop, held)

    class Recorder:
        def __init__(self, inner: AsyncSampler) -> None:
            self.inner, self.lock = inner, threading.Lock()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def agenerate(self, request: Request) -> Any:
            out = await self.inner.agenerate(request)
            with self.lock:
                tokens.append((tuple(request.prompt_ids), tuple(out.tokens)))
            return out
    try:
        summary = asyncio.run(asyncio.wait_for(loop.arun(Recorder), timeout=300))
        params = jax.device_get(loop.engine.params)
    finally:
        loop.close()
    return sorted(tokens), [h["train/loss"] for h in loop.history], seen, summary, params


@pytest.mark.slow  # every colocated RL test of the default run releases the cache
@pytest.mark.distributed
def test_colocated_run_with_the_cache_released_trains_like_one_without_it(tmp_path):
    tokens, losses, seen, _, params = _run(tmp_path / "release", "cache",
                                           **{"rl.release_sampler_cache": True})
    tokens_kept, losses_kept, seen_kept, _, params_kept = _run(
        tmp_path / "keep", "cache", **{"rl.release_sampler_cache": False})

    assert seen["deleted_at_step"] == [True, True]  # both steps ran with the cache freed
    assert all(b > 0 for b in seen["bytes"])
    assert seen_kept["released"] == [] and seen_kept["deleted_at_step"] == [False, False]
    assert tokens == tokens_kept and len(tokens) >= 2 * 3 * 2  # 2 steps of 3 groups of 2
    np.testing.assert_allclose(losses, losses_kept, rtol=1e-6, atol=1e-7)
    assert_trees_close(params, params_kept, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_colocated_run_with_the_weights_released_generates_and_trains_like_one_keeping_them(
        tmp_path):
    tokens, losses, seen, summary, params = _run(tmp_path / "release", "params",
                                                 **{"rl.release_sampler_weights": True})
    tokens_kept, losses_kept, seen_kept, summary_kept, params_kept = _run(
        tmp_path / "keep", "params", **{"rl.release_sampler_weights": False})

    assert seen["deleted_at_step"] == [True, True]  # both steps ran without sampler weights
    assert seen_kept["deleted_at_step"] == [False, False]
    # Synchronous (max_staleness 0), so both runs sample the same tokens; sequences in flight
    # at a release: tests/inference/test_weights_release.py.
    assert tokens == tokens_kept and len(tokens) >= 2 * 3 * 2
    np.testing.assert_allclose(losses, losses_kept, rtol=1e-6, atol=1e-7)
    assert_trees_close(params, params_kept, rtol=1e-6, atol=1e-7)
    assert summary["accuracy_after"] == summary_kept["accuracy_after"]
