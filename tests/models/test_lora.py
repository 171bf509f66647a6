"""LoRA math on the param state and the quantised frozen base (QLoRA)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.lora_schema import LoraConfig
from meshrl.models import create_model, quant, split_model
from meshrl.models.lora import Lora, delta, init_adapters, projections
from meshrl.tests.trainer.tiny import tiny_config
from meshrl.tests.trees import assert_trees_equal

# Documented in docs/lora.md: max |logit - float32 logit| over the tiny model's logits,
# relative to the float32 logits' max |value|.
TOLERANCE = {"float32": 0.0, "bfloat16": 0.02, "int8": 0.02, "nf4": 0.15}


def _model(**overrides):
    cfg = tiny_config(**{"model.hidden_size": 128, "model.intermediate_size": 128,
                         **overrides}).model
    return split_model(create_model(cfg, seed=0))


def _logits(graphdef, params, ids):
    return nnx.merge(graphdef, params)(ids).astype(jnp.float32)


def test_projections_split_lead_in_out_axes_for_plain_and_stacked_layers():
    for scan in (False, True):
        g, params = _model(**{"model.scan_layers": scan})
        by = {t.path: t for t in projections(g, params)}
        o = by["layers/attn/o/kernel" if scan else "layers/0/attn/o/kernel"]
        assert (o.n_lead, o.n_in, o.n_out) == ((1 if scan else 0), 2, 1)


def test_delta_is_a_times_b_over_the_rank_axis():
    g, params = _model()
    t = next(t for t in projections(g, params) if t.path.endswith("attn/o/kernel"))
    ad = init_adapters([t], rank=3, seed=1)[t.path]
    b = jax.random.normal(jax.random.key(2), ad["b"].shape)
    want = np.einsum("hdr,re->hde", ad["a"], b)
    np.testing.assert_allclose(delta(t, ad["a"], b), want, rtol=1e-5, atol=1e-6)


def test_zero_b_merges_to_the_base_bitwise():
    g, params = _model()
    lora = Lora.of(LoraConfig(rank=4), g, params)
    frozen = lora.freeze(params)
    adapters = init_adapters(list(lora.targets), 4, 0)
    dtypes = {k: v.dtype for k, v in frozen.items()}
    merged = lora.merged(jax.tree.structure(params), frozen, adapters, dtypes)
    assert_trees_equal(merged, params)


def test_a_frozen_base_through_jit_keeps_each_layers_weights_in_its_layer():
    # 11 unscanned layers: jit returns the frozen dict sorted as strings (layers/10 before
    # layers/2); the tree must be rebuilt by name, in the merged and the unmerged forms.
    g, params = _model(**{"model.num_layers": 11, "model.hidden_size": 32,
                          "model.intermediate_size": 32, "model.scan_layers": False})
    lora = Lora.of(LoraConfig(rank=4), g, params)
    frozen = jax.jit(lora.freeze)(params)
    keys = list(frozen)
    assert keys.index("layers/10/attn/k/kernel") < keys.index("layers/2/attn/k/kernel")
    dtypes = {k: v.dtype for k, v in frozen.items()}
    treedef = jax.tree.structure(params)

    merged = lora.merged(treedef, frozen, None, dtypes)
    unmerged = lora.unmerged(treedef, frozen, None, dtypes)

    assert_trees_equal(merged, params)
    bases = [x.weight() if hasattr(x, "weight") else x
             for x in jax.tree.leaves(unmerged, is_leaf=lambda x: hasattr(x, "weight"))]
    for got, want in zip(bases, jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "int8", "nf4"])
def test_quantised_base_logits_stay_within_the_documented_tolerance(base_dtype):
    g, params = _model()
    lora = Lora.of(LoraConfig(rank=4, base_dtype=base_dtype), g, params)
    frozen = lora.freeze(params)
    dtypes = {k: v.dtype for k, v in
              zip(frozen, jax.tree.leaves(params), strict=True)}
    base = lora.merged(jax.tree.structure(params), frozen, None, dtypes)
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
    want, got = _logits(g, params, ids), _logits(g, base, ids)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err <= TOLERANCE[base_dtype], err
    if base_dtype in quant.QUANT_DTYPES:
        assert err > 0  # the base really is stored quantised
        q = frozen["layers/0/mlp/up/kernel"]
        assert q.codes.dtype == (jnp.int8 if base_dtype == "int8" else jnp.uint8)


def test_nf4_uses_blocks_of_64_and_int8_one_scale_per_output_channel():
    w = jax.random.normal(jax.random.key(0), (128, 8))
    assert quant.quantize(w, "nf4").scale.shape == (1, 2, 1, 8)
    assert quant.quantize(w, "int8").scale.shape == (1, 1, 1, 8)
    stacked = quant.quantize(jnp.stack([w, 10 * w]), "int8", n_lead=1)
    # Each layer has its own scale: the small layer's error is half its own step, not the
    # large layer's.
    step = float(jnp.max(jnp.abs(w))) / 127
    np.testing.assert_allclose(quant.dequantize(stacked)[0], w, atol=step / 2 * 1.001)


def test_unknown_quant_kind_is_refused():
    with pytest.raises(ValueError, match="quantize kind = 'fp3'"):
        quant.quantize(jnp.ones((4, 4)), "fp3")


def test_dropout_of_one_or_more_is_one_config_error():
    from meshrl.configs.fields import ConfigError
    with pytest.raises(ConfigError, match="lora.dropout = 1.0: must be < 1"):
        dataclasses.replace(LoraConfig(rank=4), dropout=1.0).validate()
    dataclasses.replace(LoraConfig(rank=4), dropout=0.1).validate()


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8", "nf4"])
@pytest.mark.parametrize("scan", [False, True])
def test_base_dtype_stores_only_projection_kernels(base_dtype, scan):
    # Embeddings, LM head, norms (2-D when the layers are stacked) and biases keep their dtype.
    g, params = _model(**{"model.scan_layers": scan, "model.tie_embeddings": False,
                          "model.attention_bias": True})
    lora = Lora.of(LoraConfig(rank=4, base_dtype=base_dtype), g, params)
    kernels = {t.path for t in projections(g, params)}

    frozen = lora.freeze(params)

    flat = {p: leaf for p, leaf in zip(frozen, jax.tree.leaves(params), strict=True)}
    kept = {p for p in frozen if p not in kernels}
    assert kept and any("norm" in p for p in kept) and any("embed" in p for p in kept)
    for path in kept:
        assert frozen[path].dtype == flat[path].dtype, path
        np.testing.assert_array_equal(frozen[path], flat[path], err_msg=path)
    assert all(getattr(frozen[p], "dtype", None) != jnp.float32 for p in kernels)


@pytest.mark.parametrize("chunk", [0, 8])
def test_lora_dropout_draws_a_mask_of_its_own_for_every_mlp_chunk(chunk):
    # 8 tokens a chunk with 2 rows: 4 positions a chunk. The same input at every position
    # shows the masks: no two positions of different chunks may share one.
    from meshrl.utils.params import path_name

    cfg = tiny_config(**{"model.mlp_chunk": chunk, "model.num_layers": 1}).model
    g, params = split_model(create_model(cfg, seed=0))
    lora = Lora.of(LoraConfig(rank=4, targets="mlp/gate", dropout=0.5), g, params)
    dtypes = {path_name(p): v.dtype for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    adapters = {k: {"a": v["a"], "b": jnp.ones_like(v["b"])}
                for k, v in init_adapters(list(lora.targets), 4, 0).items()}
    state = lora.unmerged(jax.tree.structure(params), lora.freeze(params), adapters, dtypes,
                          jax.random.key(5), 0.5)

    out = np.asarray(nnx.merge(g, state).layers[0].mlp(jnp.ones((2, 16, cfg.hidden_size))))

    assert not any(np.array_equal(out[:, t], out[:, t + 4]) for t in range(12))
