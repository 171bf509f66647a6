"""An MoE train step: on data x expert x expert_tensor it gives one device's loss, router
losses, gradients and params; the router losses reach the loss and the metrics."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from meshrl.tests.trainer.test_step import _sgd, _train, _two_batches
from meshrl.tests.trees import assert_trees_close

MOE = {"model.arch": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 4,
       "model.moe_intermediate_size": 16, "model.num_kv_heads": 2,
       "model.router_aux_loss_coef": 0.01, "model.router_z_loss_coef": 0.001}


@functools.cache
def _one_device():
    return _train(_sgd(**MOE), _two_batches(), [jax.devices()[0]])


@pytest.mark.slow  # the load-balancing loss itself: tests/models/test_moe.py against transformers
def test_moe_step_reports_router_metrics_and_adds_the_router_losses_to_the_loss():
    _, hist = _one_device()
    _, no_aux = _train(_sgd(**{**MOE, "model.router_aux_loss_coef": 0.0,
                               "model.router_z_loss_coef": 0.0}), _two_batches()[:1],
                       [jax.devices()[0]])
    first = hist[0]

    # Top-2 of 4 experts: a perfectly even router gives exactly 2 (HF's normalisation).
    assert 1.5 < first["moe/aux_loss"] < 4.0 and first["moe/z_loss"] > 0
    assert first["moe/load_max_over_mean"] >= 1.0 and first["moe/dropped_frac"] == 0
    np.testing.assert_allclose(
        first["loss"] - no_aux[0]["loss"],
        0.01 * first["moe/aux_loss"] + 0.001 * first["moe/z_loss"], rtol=1e-4)


@pytest.mark.slow  # expert parallelism's step: tests/models/test_moe.py in the default run
@pytest.mark.distributed
def test_moe_step_on_data_expert_expert_tensor_matches_one_device():
    ref_state, ref_hist = _one_device()

    state, hist = _train(_sgd(**MOE, **{"mesh.data": 2, "mesh.expert": 2,
                                        "mesh.expert_tensor": 2}), _two_batches())

    for r, s in zip(ref_hist, hist, strict=True):
        for key in ("loss", "moe/aux_loss", "moe/z_loss"):
            np.testing.assert_allclose(s[key], r[key], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(s["grad_norm"], r["grad_norm"], rtol=1e-5, atol=1e-7)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
