"""Paged decode chunks split over shared prompt prefixes (cascade attention) sample exactly
like the dense cache: one group, a group beside a lone prompt, sharded meshes."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.inference.sampler import Request
from meshrl.tests.inference.tiny import make_sampler

PROMPT = [(5 * i) % 90 + 1 for i in range(13)]  # 3 full pages of 4, the 13th token on a 4th
KW = dict(page_size=4, max_new_tokens=12, prompt_buckets=(16,))


def _requests(temperature: float, lone: bool = False) -> list[Request]:
    group = [Request(PROMPT, max_new_tokens=10 - i, seed=i, temperature=temperature)
             for i in range(3 if lone else 4)]
    other = [Request([p + 2 for p in PROMPT], max_new_tokens=9, seed=7,
                     temperature=temperature)]
    return group + (other if lone else [])


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=0, atol=1e-6)


# Greedy only in -m slow: the sampled case splits the same chunks and adds a lone prompt.
@pytest.mark.parametrize("temperature, lone", [pytest.param(0.0, False, marks=pytest.mark.slow),
                                               (1.0, True)],
                         ids=["greedy_group", "sampled_group_and_lone_prompt"])
def test_chunks_split_over_the_shared_prompt_sample_like_the_dense_cache(tiny_params,
                                                                         temperature, lone):
    _, params = tiny_params
    want = make_sampler(params, **KW).generate(_requests(temperature, lone))
    sampler = make_sampler(params, kv_cache="paged", **KW)

    got = sampler.generate(_requests(temperature, lone))

    _assert_same(got, want)
    assert sampler.pages.cascade_chunks > 0
    assert sampler.pages.pages_in_use == 0


# data = 2 shards the pool's pages with the slots, and each device gathers its own slots'
# pages: no chunk splits over a shared prefix, which would gather a row's pages for members on
# any device.
@pytest.mark.parametrize("mesh, split", [(MeshConfig(data=1, tensor=2), True),
                                         pytest.param(MeshConfig(data=2, tensor=1), False,
                                                      marks=pytest.mark.slow)],
                         ids=["tensor2", "data2"])
def test_chunks_on_sharded_meshes_equal_the_dense_cache(tiny_params, mesh, split):
    _, params = tiny_params
    want = make_sampler(params, mesh_cfg=mesh, **KW).generate(_requests(0.0))
    sampler = make_sampler(params, mesh_cfg=mesh, kv_cache="paged", **KW)

    got = sampler.generate(_requests(0.0))

    _assert_same(got, want)
    assert (sampler.pages.cascade_chunks > 0) == split


# Long enough for several blocks of older pages a slot (pages of 4, blocks of 4 pages); stop
# ids end samples at different steps, so slots sit at different positions; lagged read-back
# plans each chunk from positions that count the tokens still in flight.
# Lagged only in the default run: immediate read-back plans from exact positions, a subset.
@pytest.mark.parametrize("readback", [pytest.param("immediate", marks=pytest.mark.slow),
                                      "lagged"])
def test_slots_at_different_positions_read_their_own_blocks_like_the_dense_cache(
        tiny_params, readback, monkeypatch):
    _, params = tiny_params
    kw = dict(page_size=4, max_new_tokens=44, prompt_buckets=(16,), readback=readback)
    requests = [Request(PROMPT, max_new_tokens=44, seed=i, temperature=1.0,
                        stop_ids=tuple(range(1, 5))) for i in range(6)]
    want = make_sampler(params, **kw).generate(requests)
    sampler = make_sampler(params, kv_cache="paged", **kw)
    plans = []
    bind_plan = sampler.pages.bind_plan
    monkeypatch.setattr(sampler.pages, "bind_plan",
                        lambda cache, plan: plans.append(plan) or bind_plan(cache, plan))

    got = sampler.generate(requests)

    _assert_same(got, want)
    assert len({len(c.tokens) for c in got}) > 1
    # Split chunks whose slots read blocks of their own, two blocks for some slot, at
    # different positions.
    blocks_a_slot = [np.bincount(p.owners_N[p.owners_N < 4], minlength=4) for p in plans]
    assert max(b.max() for b in blocks_a_slot) >= 2
    assert any(len(set(p.band_start_B.tolist())) > 1 and (b > 0).any()
               for p, b in zip(plans, blocks_a_slot, strict=True))
