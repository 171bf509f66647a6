"""The workflow against the real AsyncSampler on a tiny random model: the protocol fits, and the
sampler's behaviour logprobs line up with the trainer's recomputed ones in the built batch, at
temperature 1 and at a temperature T != 1 (the trainer then scores logits / T)."""

from __future__ import annotations

import asyncio
import collections

import jax
import numpy as np
import pytest

from meshrl.algorithms.losses import token_logprobs
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import RLConfig
from meshrl.inference.async_sampler import AsyncSampler
from meshrl.models import create_model, forward, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler
from meshrl.tests.workflows.fakes import FakeRewards, decode
from meshrl.workflows import EpisodeSettings, arun_group, build_rl_batch


@pytest.mark.slow  # ~30 s on CPU, almost all of it compiling the sampler
def test_real_engine_episodes_give_behaviour_logprobs_equal_to_trainer_logprobs():
    graphdef, params = split_model(create_model(TINY, seed=0))
    engine = AsyncSampler(make_sampler(params, temperature=1.0))
    items = [{"prompt": "p", "prompt_ids": [5, 9, 14], "answer": "x"},
             {"prompt": "q", "prompt_ids": [40, 41], "answer": "y"}]
    counters: collections.Counter[str] = collections.Counter()

    async def main():
        return await asyncio.gather(*(arun_group(
            engine, item, group_size=2, group_id=g, filter_equal=False, counters=counters,
            reward_pool=FakeRewards(), decode=decode,
            settings=EpisodeSettings(max_new_tokens=6, temperature=1.0, seed=3))
            for g, item in enumerate(items)))
    try:
        groups = asyncio.run(main())
    finally:
        engine.shutdown()
    batch = build_rl_batch(groups, length_buckets=(16,))
    tb = batch
    logits_BxLxV = forward(graphdef, params, tb.input_ids)
    logp_BxL = np.asarray(token_logprobs(logits_BxLxV, tb.targets))
    mask = tb.loss_mask > 0

    assert counters["accepted_groups"] == 2
    assert all(t.versions == [0] * len(t.completion_ids) for g in groups for t in g)
    np.testing.assert_allclose(logp_BxL[mask], tb.behaviour_logprobs[mask], rtol=1e-4,
                               atol=1e-4)
    loss_sum, weight, aux = jax.jit(make_rl_loss_fn(RLConfig()))(logits_BxLxV, tb)
    assert float(weight) == mask.sum()
    # pi_prox / pi_behav: ~1 because the sampler and the trainer ran the same weights.
    np.testing.assert_allclose(float(aux["behav_weight_mean"]) / float(weight), 1.0, rtol=1e-4,
                               atol=1e-4)


class _Recording:
    """The engine, keeping each request's Completion (to compare raw and sampled logprobs)."""

    def __init__(self, engine: AsyncSampler) -> None:
        self.engine, self.completions = engine, {}

    @property
    def version(self) -> int:
        return self.engine.version

    async def agenerate(self, request):
        out = await self.engine.agenerate(request)
        self.completions[request.id] = out
        return out


@pytest.mark.slow  # ~25 s on CPU compiling the sampler; the default run covers the same contract
# with the sampling function alone (tests/trainer/test_rl_temperature.py)
def test_episodes_at_temperature_t_record_the_logprobs_the_trainer_recomputes_at_t():
    graphdef, params = split_model(create_model(TINY, seed=0))
    engine = _Recording(AsyncSampler(make_sampler(params, max_len=32, prompt_buckets=(8,))))
    items = [{"prompt": "p", "prompt_ids": [5, 9, 14], "answer": "x"},
             {"prompt": "q", "prompt_ids": [40, 41], "answer": "y"}]
    temperatures = (0.7, 1.0)  # one sampler: temperature is a per-request slot parameter

    async def main():
        return await asyncio.gather(*(arun_group(
            engine, item, group_size=2, group_id=g, filter_equal=False,
            reward_pool=FakeRewards(), decode=decode,
            settings=EpisodeSettings(max_new_tokens=6, temperature=t, seed=3))
            for g, (item, t) in enumerate(zip(items, temperatures, strict=True))))
    try:
        groups = asyncio.run(main())
    finally:
        engine.engine.shutdown()

    for group, t in zip(groups, temperatures, strict=True):
        tb = build_rl_batch([group], length_buckets=(16,))
        logits_BxLxV = forward(graphdef, params, tb.input_ids)
        mask = tb.loss_mask > 0
        behaviour = tb.behaviour_logprobs[mask]
        # KV-cache decode vs one full forward: float32 summation order differs slightly.
        np.testing.assert_allclose(
            np.asarray(token_logprobs(logits_BxLxV, tb.targets, temperature=t))[mask],
            behaviour, rtol=1e-4, atol=1e-4, err_msg=f"T={t}")
        _, weight, aux = jax.jit(make_rl_loss_fn(RLConfig(), temperature=t))(logits_BxLxV, tb)
        np.testing.assert_allclose(float(aux["behav_weight_mean"]) / float(weight), 1.0,
                                   rtol=1e-4, atol=1e-4, err_msg=f"T={t}")
        raw = [lp for g in range(2) for lp in engine.completions[(group[0].group_id, g, 0)]
               .raw_logprobs]
        recorded = [lp for traj in group for lp in traj.logprobs]
        if t == 1.0:
            # Untempered sampling records exactly the raw log_softmax, as before temperatures.
            np.testing.assert_array_equal(recorded, raw)
        else:
            untempered = np.asarray(token_logprobs(logits_BxLxV, tb.targets))[mask]
            assert np.max(np.abs(untempered - behaviour)) > 1e-2
            assert np.max(np.abs(np.asarray(raw) - np.asarray(recorded))) > 1e-2
