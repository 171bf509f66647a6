"""``model.mlp_chunk``: the MLP over token chunks gives the unchunked forward's values and
gradients, and a long sequence's step holds less temp memory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import ModelConfig
from meshrl.models import create_model, split_model
from meshrl.models.decoder import forward
from meshrl.tests.trees import assert_trees_close, unchanged_leaves

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=128)
B, L = 2, 21  # 21 positions: chunks of 8 tokens are 4 positions, the last one padded


def _loss_and_grads(cfg: ModelConfig, params, ids):
    graphdef, _ = split_model(create_model(cfg, seed=0))

    def loss(p):
        logits = forward(graphdef, p, ids).astype(jnp.float32)
        return (jax.nn.log_softmax(logits)[..., 1] * jnp.arange(L)).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


# The plain case stays in the default run; the remat and remat+scan variants (~15 s each) are
# slow: the chunk's remat is the same jax.checkpoint either way.
@pytest.mark.parametrize("extra", [
    pytest.param({}, marks=pytest.mark.slow), {"remat": "full"},
    pytest.param({"remat": "full", "scan_layers": True}, marks=pytest.mark.slow)])
def test_chunked_mlp_matches_the_unchunked_forward_and_gradients(extra):
    cfg = dataclasses.replace(CFG, **extra)
    _, params = split_model(create_model(cfg, seed=0))
    ids = jax.random.randint(jax.random.key(1), (B, L), 0, CFG.vocab_size)

    ref_val, ref_grads = _loss_and_grads(cfg, params, ids)
    val, grads = _loss_and_grads(dataclasses.replace(cfg, mlp_chunk=8), params, ids)

    np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-6)
    # Every gradient leaf is non-zero somewhere: the comparison below is not vacuous.
    assert unchanged_leaves(ref_grads, jax.tree.map(jnp.zeros_like, ref_grads)) == []
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # compiles a long-sequence step twice
def test_chunked_mlp_step_needs_less_temp_memory_on_a_long_sequence():
    cfg = dataclasses.replace(CFG, intermediate_size=1024, remat="full", scan_layers=True)
    ids = jax.ShapeDtypeStruct((1, 2048), jnp.int32)

    def temp(c: ModelConfig) -> int:
        graphdef, params = split_model(create_model(c, seed=0))
        fn = jax.jit(jax.grad(lambda p, x: forward(graphdef, p, x).astype(jnp.float32).mean()))
        return fn.lower(params, ids).compile().memory_analysis().temp_size_in_bytes

    full, chunked = temp(dataclasses.replace(cfg, max_position_embeddings=2048)), temp(
        dataclasses.replace(cfg, max_position_embeddings=2048, mlp_chunk=256))

    # One layer's [2048, 1024] float32 activation is 8 MiB; a chunk's is 1 MiB.
    assert chunked <= full - 8 * 2 ** 20, (chunked, full)
