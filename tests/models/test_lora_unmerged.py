"""The unmerged LoRA forward (``Lora.unmerged``, ``models/lora_kernel.py``) against the merge."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.lora_schema import LoraConfig
from meshrl.models import create_model, split_model
from meshrl.models.lora import Lora, init_adapters
from meshrl.models.lora_kernel import AdaptedKernel
from meshrl.tests.trainer.tiny import tiny_config
from meshrl.utils.params import path_name


def _setup(scan: bool, base_dtype: str = "float32"):
    cfg = tiny_config(**{"model.hidden_size": 128, "model.intermediate_size": 128,
                         "model.scan_layers": scan}).model
    graphdef, params = split_model(create_model(cfg, seed=0))
    lora = Lora.of(LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype), graphdef, params)
    frozen = lora.freeze(params)
    adapters = init_adapters(list(lora.targets), 4, 0)
    # B = 0 would hide any error in the adapter path: give it values.
    adapters = {k: {"a": v["a"], "b": 0.05 * jax.random.normal(jax.random.key(3), v["b"].shape)}
                for k, v in adapters.items()}
    dtypes = {path_name(p): leaf.dtype
              for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    return graphdef, jax.tree.structure(params), lora, frozen, adapters, dtypes, ids


def _logits_fn(graphdef, treedef, lora, frozen, dtypes, ids, *, merge, key=None, p=0.0):
    def logits(adapters):
        if merge:
            params = lora.merged(treedef, frozen, adapters, dtypes)
        else:
            params = lora.unmerged(treedef, frozen, adapters, dtypes, key, p)
        return nnx.merge(graphdef, params)(ids).astype(jnp.float32)
    return logits


@pytest.mark.parametrize("scan,base_dtype", [(False, "float32"),
                                             pytest.param(True, "float32", marks=pytest.mark.slow),
                                             (True, "nf4")])
def test_unmerged_forward_and_adapter_grads_equal_the_merged_ones(scan, base_dtype):
    g, treedef, lora, frozen, adapters, dtypes, ids = _setup(scan, base_dtype)
    def loss_and_logits(merge):
        f = _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=merge)

        def loss(ad):
            logits = f(ad)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
        return jax.jit(jax.grad(loss, has_aux=True))(adapters)

    (g_m, merged), (g_u, unmerged) = loss_and_logits(True), loss_and_logits(False)
    np.testing.assert_allclose(unmerged, merged, rtol=0, atol=1e-5)
    for path in adapters:
        for m in "ab":
            np.testing.assert_allclose(g_u[path][m], g_m[path][m], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{path}/{m}")


def test_unmerged_without_adapters_is_the_frozen_base():
    g, treedef, lora, frozen, _, dtypes, ids = _setup(True)
    base = _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=True)(None)
    np.testing.assert_allclose(
        _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=False)(None), base,
        rtol=0, atol=1e-5)


def test_dropout_masks_follow_the_key_exactly():
    g, treedef, lora, frozen, adapters, dtypes, ids = _setup(True)

    def run(seed, p=0.5):
        return _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=False,
                          key=jax.random.key(seed), p=p)(adapters)

    np.testing.assert_array_equal(run(0), run(0))
    assert float(jnp.max(jnp.abs(run(0) - run(1)))) > 1e-4
    # Dropout acts on the adapter path only: with B = 0 every key gives the base.
    zero_b = {k: {"a": v["a"], "b": jnp.zeros_like(v["b"])} for k, v in adapters.items()}
    base = _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=True)(None)
    with_drop = _logits_fn(g, treedef, lora, frozen, dtypes, ids, merge=False,
                           key=jax.random.key(0), p=0.5)(zero_b)
    np.testing.assert_allclose(with_drop, base, rtol=0, atol=1e-5)


def test_an_adapted_kernel_refuses_a_slice():
    k = AdaptedKernel(jnp.ones((2, 2)), None, None, None, 1.0, 0.0, jnp.float32)
    with pytest.raises(TypeError, match=r"only \[\.\.\.\]"):
        k[0]
