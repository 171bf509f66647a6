"""Adapter-only weight handoff: the sampler merges each version's adapters into its own copy of
the frozen base and ends up with the params a full merged handoff gives."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from meshrl.configs.lora_schema import LoraConfig
from meshrl.inference.weights import SamplerWeights, WeightMismatchError
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import abstract_model, create_model, param_shardings, split_model
from meshrl.models.lora import LoraSetup, init_adapters
from meshrl.tests.inference.test_weights import SAMPLE_MESH, TRAIN_MESH, _sampler
from meshrl.tests.inference.tiny import TINY
from meshrl.utils.params import flat_params

pytestmark = pytest.mark.distributed


def _setup(base_dtype: str):
    mesh = create_mesh(TRAIN_MESH)
    graphdef, params = split_model(create_model(TINY, mesh=mesh,
                                                rules=rules_for("train", True)))
    setup = LoraSetup(LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype), graphdef, params,
                      jax.tree.map(lambda x: x.sharding, params))
    return setup, setup.freeze(params)


def _adapters(setup: LoraSetup):
    """``seed -> adapters`` placed as the trainer places them, B off zero (fresh adapters would
    merge to the base); one program for every seed."""
    def make(key):
        fresh = init_adapters(list(setup.lora.targets), setup.cfg.rank, 0)
        keys = jax.random.split(key, len(fresh))
        return {p: {"a": ab["a"], "b": 0.05 * jax.random.normal(k, ab["b"].shape)}
                for k, (p, ab) in zip(keys, fresh.items())}
    jitted = jax.jit(make, out_shardings=setup.adapter_sh)
    return lambda seed: jitted(jax.random.key(seed))


def _sampler_weights() -> SamplerWeights:
    """The sampler's param layout (its mesh over the devices in reverse), float32."""
    mesh, rules = create_mesh(SAMPLE_MESH, jax.devices()[::-1]), rules_for("sample")
    _, abstract = split_model(abstract_model(TINY, mesh=mesh, rules=rules))
    return SamplerWeights(abstract, param_shardings(abstract, mesh, rules))


@pytest.mark.parametrize("base_dtype", ["float32", "nf4"])
def test_adapter_handoffs_give_the_full_merged_handoffs_params_across_versions(base_dtype):
    setup, frozen = _setup(base_dtype)
    weights, make = _sampler_weights(), _adapters(setup)

    for version in (1, 2):
        adapters = make(version)
        got = weights.handoff(setup.update(adapters, frozen, with_base=not weights.has_base))
        want = weights.handoff(setup.merged(frozen, adapters))

        assert sorted(got) == sorted(want)
        for name, w in want.items():
            assert got[name].sharding == w.sharding and got[name].dtype == w.dtype, name
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(w), rtol=1e-6,
                                       atol=1e-6, err_msg=f"{name} at version {version}")
    sent, full = weights.handoff_bytes
    assert 0 < sent < full / 4


def test_an_adapter_handoff_for_another_base_is_one_line_and_keeps_the_weights():
    setup, frozen = _setup("float32")
    # Another base: its MLP is wider.
    other = tuple((k, (shape[0] * 2,) + shape[1:] if k == "layers/0/mlp/down/kernel" else shape,
                   dtype) for k, shape, dtype in setup.base_tree)
    sampler, make = _sampler("float32"), _adapters(setup)
    sampler.update_weights(setup.update(make(1), frozen, with_base=True), 1)
    kept = flat_params(sampler.params)

    update = dataclasses.replace(setup.update(make(2), frozen, with_base=False),
                                 base_tree=other)
    with pytest.raises(WeightMismatchError,
                       match=r"^adapter handoff for another frozen base: the base differs at "
                             r"\['layers/0/mlp/down/kernel'"):
        sampler.update_weights(update, 2)

    assert sampler.version == 1
    for name, value in flat_params(sampler.params).items():
        assert value is kept[name]


def test_an_adapter_handoff_before_any_base_is_refused():
    setup, frozen = _setup("float32")
    with pytest.raises(WeightMismatchError, match="before the sampler holds a base"):
        _sampler_weights().handoff(setup.update(_adapters(setup)(1), frozen, with_base=False))
