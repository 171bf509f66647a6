"""The workflow against the real AsyncEngine on a tiny random model: the protocol fits, and the
sampler's behaviour logprobs line up with the trainer's recomputed ones after to_train_batch."""

from __future__ import annotations

import asyncio
import collections

import jax
import numpy as np
import pytest

from meshrl.configs.schema import RLConfig
from meshrl.inference.async_engine import AsyncEngine
from meshrl.models import create_model, forward, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler
from meshrl.tests.workflows.fakes import FakeRewards, decode
from meshrl.trainer.losses import token_logprobs
from meshrl.trainer.policy_loss import make_rl_loss_fn
from meshrl.workflows import EpisodeSettings, arun_group, build_rollout_batch


@pytest.mark.slow  # ~30 s on CPU, almost all of it compiling the sampler
def test_real_engine_episodes_give_behaviour_logprobs_equal_to_trainer_logprobs():
    graphdef, params = split_model(create_model(TINY, seed=0))
    engine = AsyncEngine(make_sampler(params, temperature=1.0))
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
    batch = build_rollout_batch(groups, length_buckets=(16,))
    tb = batch.to_train_batch()
    logits_BxLxV = forward(graphdef, params, tb["input_ids"])
    logp_BxL = np.asarray(token_logprobs(logits_BxLxV, tb["targets"]))
    mask = tb["loss_mask"] > 0

    assert counters["accepted_groups"] == 2
    assert all(t.versions == [0] * len(t.completion_ids) for g in groups for t in g)
    np.testing.assert_allclose(logp_BxL[mask], tb["behaviour_logprobs"][mask], rtol=1e-4,
                               atol=1e-4)
    loss_sum, weight, aux = jax.jit(make_rl_loss_fn(RLConfig()))(logits_BxLxV, tb)
    assert float(weight) == mask.sum()
    # pi_prox / pi_behav: ~1 because the sampler and the trainer ran the same weights.
    np.testing.assert_allclose(float(aux["behav_weight_mean"]) / float(weight), 1.0, rtol=1e-4,
                               atol=1e-4)
