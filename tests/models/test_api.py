"""The public model API others code against: logical axes, shardings, sampler KV cache on a
mesh, dtype handling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import (
    K_CACHE_AXES,
    V_CACHE_AXES,
    KVCache,
    create_model,
    forward,
    load_hf_checkpoint,
    logical_axes,
    param_shardings,
    save_hf_checkpoint,
    split_model,
)
from meshrl.tests.models.conftest import random_ids

CFG = ModelConfig(arch="qwen2", vocab_size=128, attention_bias=True)


def test_logical_axes_mirror_the_param_state_and_name_every_dim():
    model = create_model(CFG)

    axes = logical_axes(model)
    params = nnx.state(model, nnx.Param)

    flat_axes = dict(nnx.to_flat_state(axes))
    flat_params = dict(nnx.to_flat_state(params))
    assert flat_axes.keys() == flat_params.keys()
    for path, names in flat_axes.items():
        assert isinstance(names, tuple) and len(names) == flat_params[path][...].ndim, path
    assert axes["embed"] == ("vocab", "embed")
    assert axes["layers"][0]["attn"]["q"]["kernel"] == ("embed", "heads", "head_dim")
    assert axes["layers"][0]["attn"]["o"]["kernel"] == ("heads", "head_dim", "embed")
    assert axes["layers"][0]["mlp"]["down"]["kernel"] == ("mlp", "embed")


@pytest.mark.distributed
def test_param_shardings_follow_sample_rules_on_a_tensor_mesh():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    model = create_model(CFG)

    shardings = param_shardings(model, mesh, rules_for("sample"))

    layer = shardings["layers"][0]
    assert layer["attn"]["q"]["kernel"].spec == P(None, "tensor", None)
    assert layer["attn"]["k"]["kernel"].spec == P(None, None, None)  # 2 kv heads on tensor=4
    assert layer["mlp"]["up"]["kernel"].spec == P(None, "tensor")
    assert shardings["embed"].spec == P("tensor", None)


@pytest.mark.slow  # sharded decode: tests/inference/test_weights.py's sharded sampler in the default run
@pytest.mark.distributed
def test_sharded_kv_cache_decode_matches_unsharded_full_forward():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    rules = rules_for("sample")
    reference = create_model(CFG, seed=3)
    model = create_model(CFG, mesh=mesh, rules=rules, seed=3)
    graphdef, params = split_model(model)
    ids_BxL = random_ids(4, 6)
    full_BxLxV = np.asarray(reference(ids_BxL))
    cache_sh = KVCache.shardings(CFG, 4, 8, mesh, rules)
    cache = jax.device_put(KVCache.init(CFG, 4, 8), cache_sh)
    step = jax.jit(forward, static_argnums=0, donate_argnames=("cache",),
                   out_shardings=(None, cache_sh))

    outputs = []
    for t in range(6):
        logits_Bx1xV, cache = step(graphdef, params, ids_BxL[:, t:t + 1],
                                   np.full((4, 1), t, np.int32), None, cache)
        outputs.append(np.asarray(logits_Bx1xV)[:, 0])

    np.testing.assert_allclose(np.stack(outputs, 1), full_BxLxV, rtol=1e-5, atol=1e-5)
    assert K_CACHE_AXES == ("cache_slots", "kv_heads", "head_dim", "cache_len")
    assert V_CACHE_AXES == ("cache_slots", "kv_heads", "cache_len", "head_dim")
    assert len(cache.k) == len(cache.v) == CFG.num_layers
    assert all(k.sharding.spec == P("data", None, None, None) for k in cache.k)
    assert all(v.sharding.spec == P("data", None, None, None) for v in cache.v)


def test_bfloat16_params_load_and_export(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen3")

    model = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    save_hf_checkpoint(model, tmp_path / "bf16")
    again = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.bfloat16)

    assert model.layers[0].attn.q.kernel[...].dtype == jnp.bfloat16
    assert model.cfg.compute_dtype == "bfloat16"
    ids_BxL = random_ids(1, 4)
    np.testing.assert_array_equal(np.asarray(again(ids_BxL), np.float32),
                                  np.asarray(model(ids_BxL), np.float32))


@pytest.mark.distributed
def test_activations_are_constrained_only_when_a_mesh_is_given():
    ids_BxL = random_ids(2, 4)
    plain = split_model(create_model(CFG))
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    sharded = split_model(create_model(CFG, mesh=mesh, rules=rules_for("train")))

    plain_jaxpr = str(jax.make_jaxpr(forward, static_argnums=0)(*plain, ids_BxL))
    sharded_jaxpr = str(jax.make_jaxpr(forward, static_argnums=0)(*sharded, ids_BxL))

    assert "sharding_constraint" not in plain_jaxpr
    assert "sharding_constraint" in sharded_jaxpr
