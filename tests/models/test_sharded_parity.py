"""HF parity on 8 fake CPU devices: params placed straight into their shards, same logits."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import create_model, forward, load_hf_checkpoint, split_model
from meshrl.tests.models.conftest import hf_logits, random_ids

pytestmark = pytest.mark.distributed

RTOL, ATOL = 1e-4, 1e-4  # float32 both sides; sharded reductions only reorder sums

MESHES = {
    "data2_tensor4": (MeshConfig(data=2, tensor=4), False),
    "tensor8": (MeshConfig(data=1, tensor=8), False),
    "data8_fsdp": (MeshConfig(data=8, fsdp=True), True),
}

# param path -> mesh -> expected number of shards (tiny shapes: heads 4, kv 2, mlp 96, embed 64)
EXPECTED_SHARDS = {
    ("embed",): {"data2_tensor4": 4, "tensor8": 8, "data8_fsdp": 8},
    ("layers", 0, "mlp", "gate", "kernel"): {"data2_tensor4": 4, "tensor8": 8, "data8_fsdp": 8},
    ("layers", 0, "attn", "q", "kernel"): {"data2_tensor4": 4, "tensor8": 1, "data8_fsdp": 8},
}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", ["llama3_rope", "qwen2_untied", "qwen3"])
def test_sharded_load_matches_transformers_and_shards_weights(hf_checkpoint, kind, mesh_name):
    mesh_cfg, fsdp = MESHES[mesh_name]
    mesh = create_mesh(mesh_cfg)
    path, torch_model = hf_checkpoint(kind)
    ids_BxL = random_ids(8, 12)

    model = load_hf_checkpoint(path, mesh=mesh, rules=rules_for("train", fsdp))
    graphdef, params = split_model(model)
    logits_BxLxV = jax.jit(forward, static_argnums=0)(graphdef, params, ids_BxL)

    np.testing.assert_allclose(np.asarray(logits_BxLxV), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)
    for path_key, per_mesh in EXPECTED_SHARDS.items():
        arr = _get(params, path_key)[...]
        shard_shape = arr.addressable_shards[0].data.shape
        assert math.prod(arr.shape) // math.prod(shard_shape) == per_mesh[mesh_name], (
            path_key, arr.shape, shard_shape, arr.sharding)
        # Every device holds exactly its slice, never a full replica of a sharded weight.
        assert all(s.data.shape == shard_shape for s in arr.addressable_shards)


def test_create_model_births_params_in_their_target_shardings():
    mesh = create_mesh(MeshConfig(data=2, tensor=4))
    rules = rules_for("train", True)
    cfg = ModelConfig(arch="qwen3", qk_norm=True, head_dim=32)

    model = create_model(cfg, mesh=mesh, rules=rules)

    q = model.layers[0].attn.q.kernel[...]  # [embed 64, heads 4, head_dim 32]
    assert q.sharding.spec == jax.sharding.PartitionSpec("data", "tensor", None)
    assert q.addressable_shards[0].data.shape == (32, 1, 32)
    logits = model(random_ids(2, 6))
    assert logits.shape == (2, 6, cfg.vocab_size)


def test_scanned_layers_shard_and_match_transformers_with_fsdp(hf_checkpoint):
    mesh = create_mesh(MeshConfig(data=2, tensor=4, fsdp=True))
    path, torch_model = hf_checkpoint("qwen2_untied")
    ids_BxL = random_ids(4, 12)

    model = load_hf_checkpoint(path, mesh=mesh, rules=rules_for("train", True),
                               scan_layers=True)
    graphdef, params = split_model(model)
    logits_BxLxV = jax.jit(forward, static_argnums=0)(graphdef, params, ids_BxL)

    np.testing.assert_allclose(np.asarray(logits_BxLxV), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)
    q = params["layers"]["attn"]["q"]["kernel"][...]  # [layers 2, embed 64, heads 4, hd 16]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "data", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 1, 16)
