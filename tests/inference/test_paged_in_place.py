"""The paged cache decoded in place (sampler.paged_decode = "in_place"): keys and values in one
interleaved pool, every decode step attending over the pages where they lie (on a TPU through
JAX's ragged paged attention kernel: tests/jobs/test_compile_tpu.py), one decode program for
any mix of lengths."""

from __future__ import annotations

import pytest

from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.shapes import decodes_in_place
from meshrl.models import create_model, split_model
from meshrl.tests.inference import test_paged_prefix as prefix
from meshrl.tests.inference.test_paged_sampler import CASES, KW, _assert_same, _requests
from meshrl.tests.inference.tiny import TINY, make_sampler

IN_PLACE = dict(kv_cache="paged", paged_decode="in_place")


@pytest.mark.parametrize("mesh, cases", [
    (None, CASES),
    (MeshConfig(data=1, tensor=2), CASES[:3]),
    pytest.param(MeshConfig(data=2, tensor=1), CASES[:3], marks=pytest.mark.slow)],
    ids=["one_device", "tensor2", "data2"])
def test_in_place_greedy_equals_dense_in_one_decode_program(tiny_params, mesh, cases):
    _, params = tiny_params
    dense = make_sampler(params, mesh_cfg=mesh, **KW).generate(_requests(cases))
    sampler = make_sampler(params, mesh_cfg=mesh, **IN_PLACE, **KW)

    got = sampler.generate(_requests(cases))

    _assert_same(got, dense)
    assert sampler.cache.combined  # one interleaved pool, the TPU kernel's layout
    assert sampler.window_buckets == (sampler.cfg.max_len,)
    assert sampler._decode._cache_size() == 1  # any mix of lengths: one program
    assert sampler.pages.pages_in_use == 0


def test_in_place_group_shares_its_prompt_and_survives_a_weight_update(tiny_params):
    _, old = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    group = prefix._group(budgets=(10,) * 4)
    want, _ = prefix._run(make_sampler(old, **prefix.KW), group, update=new)
    sampler = make_sampler(old, **IN_PLACE, **prefix.KW)

    got, (prompt_pages, prefills) = prefix._run(sampler, prefix._group(budgets=(10,) * 4),
                                                update=new)

    prefix._assert_same(got, want)
    assert prompt_pages == 3 + 4 and prefills == 1  # shared pages written once, copied 4th
    assert sampler.pages.prompt_prefills == 2 and sampler.pages.cascade_chunks == 0
    assert all(c.versions[0] == 0 and c.versions[-1] == 1 for c in got)


@pytest.mark.parametrize("setting, platform, in_place", [
    ("auto", "tpu", True), ("auto", "cpu", False), ("auto", "gpu", False),
    ("window", "tpu", False), ("in_place", "cpu", True)])
def test_auto_decodes_in_place_on_a_tpu_only(setting, platform, in_place):
    cfg = SamplerConfig(max_len=256, kv_cache="paged", paged_decode=setting)

    assert decodes_in_place(cfg, platform) is in_place


def test_warmup_compiles_one_decode_and_a_group_run_nothing_more(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, **IN_PLACE, **{**prefix.KW, "slots": 2, "max_len": 32})
    sampler.warmup()
    before = sampler.compile_count()

    outs = sampler.generate(prefix._group(g=2, budgets=(3, 10)))

    assert sampler.compile_count() == before
    assert sampler._decode._cache_size() == 1 and sampler.pages.extend._cache_size() == 1
    assert sampler.pages.fanouts == 1 and [len(c.tokens) for c in outs] == [3, 10]
