"""A sampler on a mesh with context > 1 (a colocated RL config's mesh): the sample role folds
``context`` into the batch, so slots shard over it and decoding equals one device's."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.inference.requests import Request
from meshrl.mesh import create_mesh, logical_to_spec, rules_for
from meshrl.tests.inference.tiny import make_sampler

pytestmark = pytest.mark.distributed
PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7], [88, 12, 19]]


def test_sample_rules_fold_context_into_the_batch_and_the_cache_slots():
    import jax

    mesh = create_mesh(MeshConfig(data=2, context=4), jax.devices())

    for name in ("batch", "cache_slots"):
        assert logical_to_spec((name,), rules_for("sample"), mesh, (8,))[0] == ("data",
                                                                              "context")
    assert logical_to_spec(("length",), rules_for("sample"), mesh, (64,))[0] is None


@pytest.mark.slow  # context parallelism's step and attention stay in the default run
def test_sampler_with_context2_decodes_like_one_device(tiny_params):
    import jax

    _, params = tiny_params
    single = make_sampler(params)
    folded = make_sampler(params, mesh_cfg=MeshConfig(data=1, context=2))

    a = single.generate([Request(p, max_new_tokens=6) for p in PROMPTS])
    b = folded.generate([Request(p, max_new_tokens=6) for p in PROMPTS])

    specs = {leaf.sharding.spec[0] for leaf in jax.tree.leaves(folded.cache) if leaf.ndim >= 3}
    assert specs == {"context"}, specs  # the slots of the KV cache are split over context
    assert [c.tokens for c in a] == [c.tokens for c in b]
    np.testing.assert_allclose([c.raw_logprobs for c in a], [c.raw_logprobs for c in b],
                               rtol=1e-4, atol=1e-5)
