"""The sampler on the paged KV cache (sampler.kv_cache = "paged") against the dense one."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler

# Ragged prompts and budgets, more requests than slots: continuous batching refills slots.
CASES = [(3, 8), (10, 5), (7, 12), (14, 8), (5, 3)]
KW = dict(page_size=8, max_new_tokens=12, prompt_buckets=(16,))


def _requests(cases=CASES):
    return [Request([(7 * n + i) % 90 + 1 for i in range(n)], max_new_tokens=m)
            for n, m in cases]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        # float32: only the summation order of the attention differs (window vs pages).
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=0, atol=1e-6)
        assert g.versions == w.versions


# Sharded meshes: the cascade's split chunks on tensor = 2 in the default run
# (tests/inference/test_paged_cascade.py).
@pytest.mark.parametrize("mesh, cases", [
    (None, CASES),
    pytest.param(MeshConfig(data=1, tensor=2), CASES[:3], marks=pytest.mark.slow),
    pytest.param(MeshConfig(data=2, tensor=1), CASES[:3], marks=pytest.mark.slow)],
    ids=["one_device", "tensor2", "data2"])
def test_paged_greedy_equals_dense_and_frees_every_page(tiny_params, mesh, cases):
    _, params = tiny_params
    dense = make_sampler(params, mesh_cfg=mesh, **KW).generate(_requests(cases))
    sampler = make_sampler(params, mesh_cfg=mesh, kv_cache="paged", **KW)

    paged = sampler.generate(_requests(cases))

    _assert_same(paged, dense)
    assert sampler.pages.pages_in_use == 0
    assert (sampler.pages.alloc.table == -1).all()
    # Any mix of lengths decodes over all slots: one program per window of whole pages.
    assert sampler.window_buckets == (32, 48, 64) and sampler.row_buckets == (4,)
    assert sampler._decode._cache_size() <= len(sampler.window_buckets)


def test_paged_update_mid_generation_equals_dense(tiny_params):
    _, old = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]

    def run(**kw):
        sampler = make_sampler(old, **KW, **kw)
        for r in _requests(CASES[:3]):
            sampler.submit(r)
        outs = sampler.step() + sampler.step()
        sampler.update_weights(new, version=1)
        while sampler.has_work():
            outs += sampler.step()
        return sampler, sorted(outs, key=lambda c: c.request.id)

    _, dense = run()
    sampler, paged = run(kv_cache="paged")

    _assert_same(paged, dense)
    assert any(1 in c.versions and 0 in c.versions for c in paged)
    assert sampler.pages.pages_in_use == 0


@pytest.mark.slow  # arrival-order admission: tests/inference/test_sampler.py
def test_pool_for_one_sequence_makes_requests_wait_in_arrival_order(tiny_params):
    _, params = tiny_params
    cases = [(10, 10), (6, 12), (9, 10)]  # each needs 3 pages of 8; the pool holds 4
    kw = {**KW, "max_len": 32}
    want = make_sampler(params, **kw).generate(_requests(cases), longest_first=False)
    sampler = make_sampler(params, kv_cache="paged", num_pages=4, **kw)
    for r in _requests(cases):
        sampler.submit(r)

    sampler.step()
    assert len(sampler._queue) == 2 and sampler.pages.pages_in_use == 3  # the rest waits
    outs = []
    while sampler.has_work():
        outs += sampler.step()
        assert sampler.pages.pages_in_use <= 4

    _assert_same(sorted(outs, key=lambda c: c.request.id), want)
    assert sampler.pages.pages_in_use == 0


@pytest.mark.parametrize("kw, message", [
    (dict(page_size=24), "sampler.page_size = 24: must divide sampler.max_len = 64"),
    (dict(page_size=16, num_pages=3), "sampler.num_pages = 3: one max_len sequence needs 4 "
                                      "pages"),
])
def test_paged_config_error_names_the_field_and_the_rule(kw, message):
    with pytest.raises(ConfigError, match=message):
        SamplerConfig(max_len=64, kv_cache="paged", **kw)


def test_dense_cache_ignores_page_settings():
    cfg = SamplerConfig(max_len=64, prompt_buckets=(16,), page_size=24, num_pages=1)
    assert cfg.kv_cache == "dense"
