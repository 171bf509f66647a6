"""Qwen3-MoE and Mixtral from transformers checkpoints: logits on one device and on expert /
expert_tensor meshes, both on-disk expert layouts, export round trips, bad tensors."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import forward, load_hf_checkpoint, save_hf_checkpoint, split_model
from meshrl.models.hf_config import CheckpointError
from meshrl.tests.models.conftest import hf_logits, random_hf_model, random_ids
from meshrl.tests.trees import assert_trees_equal

RTOL, ATOL = 1e-4, 1e-4  # float32 both sides: summation order only (scaled: logits ~ O(1))

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, num_experts_per_tok=2,
            tie_word_embeddings=False)
KINDS = {
    # A dense layer mixed in (layer 1), head_dim 32 != hidden / heads = 16.
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                            norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                       norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, intermediate_size=32)),
}
MESHES = {
    "expert8": MeshConfig(data=1, expert=8),
    "expert4_et2": MeshConfig(data=1, expert=4, expert_tensor=2),
    "data2_expert2_et2": MeshConfig(data=2, expert=2, expert_tensor=2),
}


def build(kind: str, seed: int = 0):
    cfg_name, model_name, extra = KINDS[kind]
    return random_hf_model(cfg_name, model_name, {**TINY, **extra}, seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    out = {}
    for kind in KINDS:
        model = build(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_moe_logits_match_transformers_unsharded(checkpoints, kind):
    path, torch_model = checkpoints[kind]
    ids_BxL = random_ids(2, 12)

    logits_BxLxV = np.asarray(load_hf_checkpoint(path)(ids_BxL))

    np.testing.assert_allclose(logits_BxLxV, hf_logits(torch_model, ids_BxL), rtol=RTOL,
                               atol=ATOL)


# The default run pairs each model with one mesh (every model and every mesh once); -m slow
# runs the whole grid.
MESH_GRID = [(k, m) if (sorted(KINDS).index(k) == sorted(MESHES).index(m)) else
             pytest.param(k, m, marks=pytest.mark.slow)
             for k in sorted(KINDS) for m in sorted(MESHES)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind, mesh_name", MESH_GRID)
def test_moe_logits_match_transformers_on_expert_meshes(checkpoints, kind, mesh_name):
    path, torch_model = checkpoints[kind]
    mesh = create_mesh(MESHES[mesh_name])
    ids_BxL = random_ids(8, 12, seed=1)

    model = load_hf_checkpoint(path, mesh=mesh, rules=rules_for("train"))
    graphdef, params = split_model(model)
    logits_BxLxV = jax.jit(forward, static_argnums=0)(graphdef, params, ids_BxL)

    gate = model.layers[0].mlp.gate[...]
    E, ep, et = 8, mesh.shape["expert"], mesh.shape["expert_tensor"]
    assert {s.data.shape for s in gate.addressable_shards} == {(E // ep, 64, 32 // et)}
    np.testing.assert_allclose(np.asarray(logits_BxLxV), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["qwen3_moe_norm", "mixtral"])
def test_fused_expert_layout_on_disk_loads_the_same_params(checkpoints, tmp_path, kind):
    from safetensors.torch import save_file

    path, torch_model = checkpoints[kind]
    # transformers' in-memory names: mlp.gate, mlp.experts.gate_up_proj / down_proj.
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())

    fused = split_model(load_hf_checkpoint(tmp_path))[1]
    per_expert = split_model(load_hf_checkpoint(path))[1]

    assert_trees_equal(fused, per_expert)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_moe_export_loads_in_transformers_and_round_trips_bitwise(checkpoints, tmp_path, kind):
    import transformers

    path, torch_model = checkpoints[kind]
    ids_BxL = random_ids(2, 10, seed=2)
    model = load_hf_checkpoint(path)

    save_hf_checkpoint(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager").eval()
    again = load_hf_checkpoint(tmp_path / "export")

    assert type(reloaded).__name__ == KINDS[kind][1]
    np.testing.assert_allclose(hf_logits(reloaded, ids_BxL), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)
    assert_trees_equal(split_model(again)[1], split_model(model)[1])


def _rewrite(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_missing_expert_tensor_is_an_error_naming_it(checkpoints, tmp_path):
    path, _ = checkpoints["mixtral"]
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    _rewrite(path, tmp_path / "ckpt", lambda t: t.pop(name))

    with pytest.raises(CheckpointError, match=f"tensor '{name}'.*missing"):
        load_hf_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.mlp.experts.5.down_proj.weight", (64, 32)),
    ("model.layers.0.mlp.gate.weight", (8, 64)),
])
def test_misshapen_expert_or_router_tensor_names_it_and_the_expected_shape(checkpoints, tmp_path,
                                                                            name, shape):
    path, _ = checkpoints["qwen3_moe"]

    def edit(t):
        t[name] = np.zeros((shape[0], shape[1] + 1), t[name].dtype)

    _rewrite(path, tmp_path / "ckpt", edit)

    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \({shape[0]}, "
                                              rf"{shape[1] + 1}\).*needs shape \({shape[0]}, "
                                              rf"{shape[1]}\)"):
        load_hf_checkpoint(tmp_path / "ckpt")


def test_qwen3_moe_config_maps_sparse_layers_and_router(checkpoints):
    from meshrl.models.hf_config import load_hf_config

    cfg = load_hf_config(checkpoints["qwen3_moe_norm"][0])
    hf = json.loads((checkpoints["mixtral"][0] / "config.json").read_text())

    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (cfg.resolved_moe_intermediate_size, cfg.intermediate_size) == (32, 96)
    assert [cfg.is_sparse_layer(i) for i in range(2)] == [True, False]
    assert cfg.norm_topk_prob and cfg.router == "softmax_topk"
    mixtral = load_hf_config(checkpoints["mixtral"][0])
    assert (mixtral.router, mixtral.num_experts, hf["num_local_experts"]) == ("topk_softmax", 8, 8)


@pytest.mark.slow  # MoE parity with transformers stays in the default run unscanned
def test_scanned_moe_layers_load_match_transformers_and_export_back(checkpoints, tmp_path):
    path, torch_model = checkpoints["qwen3_moe"]  # every layer sparse: scan_layers allowed
    ids_BxL = random_ids(2, 10, seed=4)

    model = load_hf_checkpoint(path, scan_layers=True, remat="dots")
    save_hf_checkpoint(model, tmp_path / "export")
    again = load_hf_checkpoint(tmp_path / "export")

    assert model.layers.mlp.gate[...].shape == (2, 8, 64, 32)  # [layers, experts, embed, F]
    expected = hf_logits(torch_model, ids_BxL)
    np.testing.assert_allclose(np.asarray(model(ids_BxL)), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(again(ids_BxL)), expected, rtol=RTOL, atol=ATOL)
