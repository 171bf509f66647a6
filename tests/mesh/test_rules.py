"""Logical -> physical rules map each logical name as documented, for both roles."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrl.configs import MeshConfig
from meshrl.mesh import create_mesh, logical_to_sharding, logical_to_spec, rules_for, tree_shardings

pytestmark = pytest.mark.distributed

DOCUMENTED = {
    # logical: (train, train with fsdp, sample)
    "batch": (("data", "expert"),) * 2 + (("data", "expert", "context"),),
    "length": (("context",), ("context",), ()),
    "embed": ((), ("data",), ()),
    "heads": (("tensor",),) * 3,
    "kv_heads": (("tensor",),) * 3,
    "head_dim": ((),) * 3,
    "mlp": (("tensor",),) * 3,
    "vocab": (("tensor",),) * 3,
    "exp": (("expert",),) * 3,
    "mlp_moe": (("expert_tensor",),) * 3,
    "layers": ((),) * 3,
    "act_embed": ((),) * 3,
    "act_heads": (("tensor",),) * 3,
    "act_kv_heads": (("tensor",),) * 3,
    "act_mlp": (("tensor",),) * 3,
    "act_vocab": (("tensor",),) * 3,
    "cache_slots": (("data", "expert"),) * 2 + (("data", "expert", "context"),),
    "cache_len": ((),) * 3,
    "loss_vocab": (("tensor", "data", "expert", "context", "expert_tensor"),) * 2 + (("tensor",),),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_logical_name_maps_as_documented_in_both_roles(name):
    train, train_fsdp, sample = DOCUMENTED[name]
    assert dict(rules_for("train", fsdp=False))[name] == train
    assert dict(rules_for("train", fsdp=True))[name] == train_fsdp
    assert dict(rules_for("sample"))[name] == sample


def test_rule_tables_cover_the_same_names():
    assert set(dict(rules_for("train"))) == set(dict(rules_for("sample"))) == set(DOCUMENTED)


def test_without_mesh_spec_keeps_all_rule_axes():
    spec = logical_to_spec(("batch", "length", "act_embed"), rules_for("train"))
    assert spec == P(("data", "expert"), "context", None)


def test_mesh_drops_size_one_axes():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    assert logical_to_spec(("batch", "length"), rules_for("train"), mesh) == P("data", None)


def test_axis_is_not_used_twice_in_one_spec():
    mesh = create_mesh(MeshConfig(data=8, fsdp=True))
    spec = logical_to_spec(("embed", "batch"), rules_for("train", fsdp=True), mesh)
    assert spec == P("data", None)


def test_indivisible_dimension_stays_replicated():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    rules = rules_for("sample")
    assert logical_to_spec(("kv_heads", "head_dim"), rules, mesh, shape=(2, 16)) == P(None, None)
    assert logical_to_spec(("kv_heads", "head_dim"), rules, mesh, shape=(8, 16)) == P("tensor", None)


def test_unknown_logical_name_is_an_error():
    with pytest.raises(KeyError, match="logical axis 'embd' has no rule"):
        logical_to_spec(("embd",), rules_for("train"))


def test_shape_rank_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed", "mlp"), rules_for("train"), shape=(4,))


def test_sharding_places_shards_on_devices():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    sharding = logical_to_sharding(("embed", "mlp"), mesh, rules_for("train"), shape=(16, 32))
    x = jax.device_put(np.zeros((16, 32), np.float32), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(16, 8)}


def test_tree_shardings_follow_logical_tree():
    mesh = create_mesh(MeshConfig(data=2, tensor=4, fsdp=True))
    logical = {"w": ("embed", "mlp"), "norm": ("embed",)}
    arrays = {"w": jax.ShapeDtypeStruct((16, 32), np.float32),
              "norm": jax.ShapeDtypeStruct((16,), np.float32)}
    out = tree_shardings(logical, mesh, rules_for("train", fsdp=True), arrays)
    assert out["w"].spec == P("data", "tensor")
    assert out["norm"].spec == P("data")
