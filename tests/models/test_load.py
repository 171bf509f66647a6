"""``models.load(config, mesh, role)``: one read of config.json, the tokenizer, and params (or
their shapes) in the role's shardings."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.schema import MeshConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import LoadedModel, forward, load, param_shardings
from meshrl.models.load import with_weights
from meshrl.tests.models.conftest import (
    TINY,
    byte_sft_config,
    hf_logits,
    random_hf_model,
    random_ids,
)
from meshrl.tests.trees import assert_trees_equal
from meshrl.utils.errors import MissingFileError


def _config(**model):
    return byte_sft_config(**model)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[pathlib.Path, object]:
    """A tiny LlamaForCausalLM with a byte vocabulary, saved by transformers."""
    model = random_hf_model("LlamaConfig", "LlamaForCausalLM", {**TINY, "vocab_size": 256})
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _count_config_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    original = pathlib.Path.read_text

    def counting(self, *args, **kwargs):
        if self.name == "config.json":
            reads.append(str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    return reads


def test_load_of_hf_path_reads_config_json_once_and_gives_transformers_logits(hf_dir,
                                                                             monkeypatch):
    path, torch_model = hf_dir
    config = _config(hf_path=str(path))
    reads = _count_config_reads(monkeypatch)

    loaded = load(config, create_mesh(config.mesh, jax.devices()[:1]), "sample")

    assert reads == [str(path / "config.json")]
    assert loaded.arch.hidden_size == TINY["hidden_size"] and not loaded.abstract
    ids_BxL = random_ids(2, 6, vocab=256)
    np.testing.assert_allclose(np.asarray(forward(loaded.graphdef, loaded.params, ids_BxL)),
                               hf_logits(torch_model, ids_BxL), rtol=1e-4, atol=1e-4)


def test_abstract_load_then_with_weights_reads_config_json_once_in_all(hf_dir, monkeypatch):
    path, _ = hf_dir
    config = _config(hf_path=str(path))
    reads = _count_config_reads(monkeypatch)

    skeleton = load(config, create_mesh(config.mesh, jax.devices()[:1]), "train", abstract=True)
    full = with_weights(skeleton, seed=0)

    assert len(reads) == 1
    assert skeleton.abstract and all(isinstance(x, jax.ShapeDtypeStruct)
                                     for x in jax.tree.leaves(skeleton.params))
    assert not full.abstract and full.arch == skeleton.arch
    assert jax.tree.map(lambda a: a.shape, full.params) == \
        jax.tree.map(lambda a: a.shape, skeleton.params)


@pytest.mark.parametrize("role, fsdp, embed_sharded", [
    ("train", True, True),  # FSDP: params sharded over data
    pytest.param("train", False, False, marks=pytest.mark.slow),
    ("sample", True, False),  # the sampler keeps params replicated over data, whatever mesh.fsdp
])
def test_load_places_params_in_the_roles_shardings(role, fsdp, embed_sharded):
    config = _config()
    mesh = create_mesh(MeshConfig(data=8))

    loaded = load(config, mesh, role, fsdp=fsdp)

    want = param_shardings(loaded.params, mesh, rules_for(role, fsdp))
    assert loaded.rules == rules_for(role, fsdp) and loaded.role == role
    assert jax.tree.leaves(loaded.shardings) == jax.tree.leaves(want)
    for sharding, var in zip(jax.tree.leaves(loaded.shardings),
                             jax.tree.leaves(loaded.params, is_leaf=lambda x: isinstance(
                                 x, nnx.Variable)), strict=True):
        assert var.get_value().sharding == sharding
    sharded = [not s.is_fully_replicated for s in jax.tree.leaves(loaded.shardings)]
    assert any(sharded) == embed_sharded


def test_random_load_is_seeded_by_trainer_seed_and_carries_the_tokenizer():
    config = _config()
    mesh = create_mesh(config.mesh, jax.devices()[:1])

    a, b = load(config, mesh, "train"), load(config, mesh, "train")

    assert isinstance(a, LoadedModel) and a.tokenizer.vocab_size <= a.arch.vocab_size
    assert_trees_equal(a.params, b.params)


def test_load_of_hf_path_without_config_json_names_the_file(tmp_path):
    config = _config(hf_path=str(tmp_path))

    with pytest.raises(MissingFileError, match=rf"{tmp_path}/config.json: not found"):
        load(config, create_mesh(config.mesh, jax.devices()[:1]), "sample", abstract=True)


@pytest.mark.parametrize("role, field", [("train", "trainer.seq_len"),
                                         ("sample", "sampler.max_len")])
def test_sequences_past_max_position_embeddings_are_a_config_error(role, field):
    from meshrl.configs.fields import ConfigError

    config = _config(max_position_embeddings=8)  # the default seq_len and max_len are longer

    with pytest.raises(ConfigError, match=rf"{field} = \d+: longer than the model's "
                                          rf"max_position_embeddings = 8"):
        load(config, create_mesh(config.mesh, jax.devices()[:1]), role, abstract=True)
