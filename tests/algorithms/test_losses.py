"""Loss registry and the SFT cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.batch import TrainBatch
from meshrl.algorithms.losses import get_loss, register, sft_cross_entropy


def _batch(targets, mask) -> TrainBatch:
    # The loss reads targets and mask only; the forward pass's fields stay unset.
    return TrainBatch(input_ids=None, targets=targets, loss_mask=mask, positions=None,
                      segment_ids=None)


def test_sft_loss_is_masked_token_sum_of_negative_log_likelihood():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], np.float32)
    total, weight, aux = sft_cross_entropy(jnp.asarray(logits), _batch(targets, mask))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(total, (nll * mask).sum(), rtol=1e-5)
    assert float(weight) == mask.sum()
    right = (logits.argmax(-1) == targets) * mask
    np.testing.assert_allclose(aux["token_accuracy"], right.sum(), rtol=0, atol=0)


def test_sft_loss_in_bfloat16_logits_is_computed_in_float32():
    logits = jnp.zeros((1, 3, 4), jnp.bfloat16)
    total, weight, _ = sft_cross_entropy(logits, _batch(jnp.zeros((1, 3), jnp.int32),
                                                        jnp.ones((1, 3))))
    assert total.dtype == jnp.float32
    np.testing.assert_allclose(total / weight, np.log(4), rtol=1e-6)


def test_registry_returns_registered_and_rejects_unknown_or_duplicate_names():
    assert get_loss("sft") is sft_cross_entropy

    @register("test_zero_loss")
    def zero(logits, batch):
        return jnp.zeros(()), jnp.ones(()), {}

    assert get_loss("test_zero_loss") is zero
    with pytest.raises(KeyError, match="unknown loss 'ppo_typo'; registered: .*sft"):
        get_loss("ppo_typo")
    with pytest.raises(ValueError, match="already registered"):
        register("sft")(zero)
    assert jax.tree.leaves(zero(None, None))
