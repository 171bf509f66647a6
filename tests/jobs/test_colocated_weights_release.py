"""The sampler's weights freed with its KV cache across a colocated RL run's train step
(``rl.release_sampler_weights``): the buffers are deleted while the step runs, the handoff
refills them, and the run generates and trains exactly as one that keeps them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import jax
import numpy as np
import pytest

from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Request
from meshrl.tests.trainer.tiny import tiny_rl_config


def _record(loop: Any) -> dict[str, list]:
    """For each train step dispatched: whether the sampler's weights (those it held at the
    release) were deleted and gone from the live arrays then."""
    seen: dict[str, list] = {"weights": [], "deleted_at_step": []}
    sampler, engine = loop.sampler, loop.engine
    release, dispatch = sampler.release_cache, engine.dispatch

    def release_cache(weights: bool = False) -> None:
        seen["weights"].append(jax.tree.leaves(sampler.params))
        release(weights)

    def dispatch_step(*args, **kwargs) -> Any:
        leaves = seen["weights"][-1] if seen["weights"] else []
        live = {id(x) for x in jax.live_arrays()}
        seen["deleted_at_step"].append(
            bool(leaves) and sampler.params is None
            and all(x.is_deleted() and id(x) not in live for x in leaves))
        return dispatch(*args, **kwargs)

    sampler.release_cache, engine.dispatch = release_cache, dispatch_step
    return seen


def _run(tmp_path, release_weights: bool) -> tuple[list, list, dict, dict]:
    from meshrl.jobs import rl as rl_job

    config = tiny_rl_config(**{"rl.release_sampler_weights": release_weights,
                               "rollout.max_staleness": 0, "sampler.temperature": 1.0})
    loop = rl_job.build(config, tmp_path)
    tokens: list[tuple] = []
    seen = _record(loop)

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
    finally:
        loop.close()
    return sorted(tokens), [h["train/loss"] for h in loop.history], seen, summary


@pytest.mark.distributed
def test_colocated_run_with_the_weights_released_generates_and_trains_like_one_keeping_them(
        tmp_path):
    tokens, losses, seen, summary = _run(tmp_path / "release", True)
    tokens_kept, losses_kept, seen_kept, summary_kept = _run(tmp_path / "keep", False)

    assert seen["deleted_at_step"] == [True, True]  # both steps ran without sampler weights
    assert seen_kept["deleted_at_step"] == [False, False]
    # Synchronous (max_staleness 0), so both runs sample the same tokens; sequences in flight
    # at a release: tests/inference/test_weights_release.py.
    assert tokens == tokens_kept and len(tokens) >= 2 * 3 * 2
    np.testing.assert_allclose(losses, losses_kept, rtol=1e-6, atol=1e-7)
    assert summary["params_checksum"] == pytest.approx(summary_kept["params_checksum"],
                                                       rel=1e-6)
    assert summary["accuracy_after"] == summary_kept["accuracy_after"]
