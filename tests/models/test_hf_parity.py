"""HF transformers parity: logits of loaded checkpoints, round trips, and config conversion."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.schema import ModelConfig
from meshrl.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from meshrl.tests.models.conftest import KINDS, hf_logits, random_ids

# float32 on CPU on both sides; differences are summation order only.
RTOL, ATOL = 1e-4, 1e-4


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_match_transformers_in_float32(hf_checkpoint, kind):
    path, torch_model = hf_checkpoint(kind)
    ids_BxL = random_ids(2, 12)

    model = load_hf_checkpoint(path)
    logits_BxLxV = np.asarray(model(ids_BxL))

    expected = hf_logits(torch_model, ids_BxL)
    assert logits_BxLxV.shape == expected.shape
    np.testing.assert_allclose(logits_BxLxV, expected, rtol=RTOL, atol=ATOL)


def test_llama_logits_match_transformers_with_llama3_rope_at_long_positions(hf_checkpoint):
    # Positions far beyond original_max_position_embeddings (32) exercise all three frequency
    # bands of the llama3 rule (kept, smoothed, divided by the factor).
    path, torch_model = hf_checkpoint("llama3_rope")
    ids_BxL = random_ids(2, 8, seed=1)
    positions_BxL = np.broadcast_to(np.arange(1000, 1008, dtype=np.int32), (2, 8)).copy()

    model = load_hf_checkpoint(path)
    logits_BxLxV = np.asarray(model(ids_BxL, positions_BxL))

    np.testing.assert_allclose(logits_BxLxV, hf_logits(torch_model, ids_BxL, positions_BxL),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["llama3_rope", pytest.param("qwen2_tied", marks=pytest.mark.slow),
                                  "qwen2_untied", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_save_then_transformers_from_pretrained_gives_same_logits(hf_checkpoint, tmp_path, kind):
    import transformers

    path, torch_model = hf_checkpoint(kind)
    ids_BxL = random_ids(2, 10, seed=2)
    model = load_hf_checkpoint(path)

    save_hf_checkpoint(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager").eval()

    assert type(reloaded).__name__ == KINDS[kind][1]
    np.testing.assert_allclose(hf_logits(reloaded, ids_BxL), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)
    again = load_hf_checkpoint(tmp_path / "export")
    np.testing.assert_allclose(np.asarray(again(ids_BxL)), np.asarray(model(ids_BxL)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kind", [pytest.param("llama3_rope", marks=pytest.mark.slow),
                                  pytest.param("qwen2_tied", marks=pytest.mark.slow), "qwen3"])
def test_scanned_layers_load_match_transformers_and_export_back(hf_checkpoint, tmp_path, kind):
    import transformers

    path, torch_model = hf_checkpoint(kind)
    ids_BxL = random_ids(2, 10, seed=4)

    model = load_hf_checkpoint(path, scan_layers=True, remat="dots")
    save_hf_checkpoint(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager").eval()

    assert model.layers.mlp.up.kernel[...].shape == (2, 64, 96)  # [layers, embed, mlp]
    expected = hf_logits(torch_model, ids_BxL)
    np.testing.assert_allclose(np.asarray(model(ids_BxL)), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(hf_logits(reloaded, ids_BxL), expected, rtol=RTOL, atol=ATOL)


def test_sharded_safetensors_index_loads_with_same_logits(tmp_path):
    from meshrl.tests.models.conftest import build_hf_model

    torch_model = build_hf_model("qwen3")
    torch_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    ids_BxL = random_ids(2, 6, seed=5)

    model = load_hf_checkpoint(tmp_path)

    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    np.testing.assert_allclose(np.asarray(model(ids_BxL)), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)


def test_build_model_loads_hf_path_with_runtime_fields_from_config(hf_checkpoint):
    path, torch_model = hf_checkpoint("llama")
    cfg = ModelConfig(hf_path=str(path), remat="full", scan_layers=True, vocab_size=7)

    model = build_model(cfg)

    assert model.cfg.vocab_size == 128  # architecture comes from the checkpoint
    assert (model.cfg.remat, model.cfg.scan_layers) == ("full", True)
    ids_BxL = random_ids(1, 5)
    np.testing.assert_allclose(np.asarray(model(ids_BxL)), hf_logits(torch_model, ids_BxL),
                               rtol=RTOL, atol=ATOL)
