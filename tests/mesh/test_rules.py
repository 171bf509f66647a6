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
    "batch": (("dcn_data", "data", "expert"),) * 2 + (("dcn_data", "data", "expert", "context"),),
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
    "cache_slots": (("dcn_data", "data", "expert"),) * 2
    + (("dcn_data", "data", "expert", "context"),),
    "cache_len": ((),) * 3,
    "loss_vocab": (("tensor", "data", "expert", "context", "expert_tensor", "dcn_data"),) * 2
    + (("tensor",),),
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
    assert spec == P(("dcn_data", "data", "expert"), "context", None)


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


def _replica_groups(x: jax.Array) -> list[set[int]]:
    """Device ids grouped by the shard (index) they hold."""
    groups: dict[str, set[int]] = {}
    for shard in x.addressable_shards:
        groups.setdefault(str(shard.index), set()).add(shard.device.id)
    return sorted(groups.values(), key=min)


def test_hsdp_shards_params_within_a_granule_and_replicates_them_across_dcn():
    mesh = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2, fsdp=True))
    rules = rules_for("train", fsdp=True)
    sharding = logical_to_sharding(("embed", "mlp"), mesh, rules, shape=(16, 32))
    w = jax.device_put(np.zeros((16, 32), np.float32), sharding)

    assert mesh.axis_names[:2] == ("dcn_data", "data") and mesh.shape["dcn_data"] == 2
    assert sharding.spec == P("data", "tensor")
    assert {s.data.shape for s in w.addressable_shards} == {(8, 16)}
    # The two granules are devices 0-3 and 4-7: each shard lives once in each of them.
    for group in _replica_groups(w):
        assert len(group) == 2 and len({d // 4 for d in group}) == 2, group


def test_hsdp_batch_rows_land_where_plain_data_parallelism_puts_them():
    hsdp = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2, fsdp=True))
    flat = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2, fsdp=False))
    rows = [logical_to_sharding(("batch", "length"), m, rules_for("train", fsdp=True), (8, 16))
            for m in (hsdp, flat)]

    assert rows[0].spec == P(("dcn_data", "data"), None) and rows[1].spec == P("data", None)
    assert rows[0].devices_indices_map((8, 16)) == rows[1].devices_indices_map((8, 16))
