"""The RL step's forwards replay the batch's routing (``RLTrainBatch.routing``, ``[B, L,
layers, k]``): the loss forward, the proximal / reference forward (``reference_logprobs``) and
the truncated one score the targets as the model does with those experts forced, not with
its own routing; a batch without ``routing`` calls the forward as before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.losses import token_logprobs
from meshrl.tests.models.test_routing_replay import (
    IDS,
    _model,
    _perturbed_router,
    _replayed,
    _routing,
)
from meshrl.trainer.reference import reference_logprobs
from meshrl.trainer.rl_step import truncated_logprobs
from meshrl.trainer.step import decoder_forward, make_grads_fn


def _batch(routing_NxBxLxK: jax.Array | None) -> RLTrainBatch:
    B, L = IDS.shape
    ones = jnp.ones((B, L), jnp.float32)
    zeros_i = jnp.zeros((B, L), jnp.int32)
    return RLTrainBatch(
        input_ids=IDS, targets=jnp.roll(IDS, -1, axis=1), loss_mask=ones,
        positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
        segment_ids=jnp.ones((B, L), jnp.int32), behaviour_logprobs=0.0 * ones,
        advantages=ones, versions=zeros_i, sample_ids=zeros_i,
        kept=jnp.full((B, L), 64, jnp.int32),
        routing=(None if routing_NxBxLxK is None
                 else jnp.transpose(routing_NxBxLxK, (1, 2, 0, 3))))


def _setup():
    graphdef, params = _model(None)
    _, recorded = _routing(graphdef, params)
    moved = _perturbed_router(params, 3.0)  # its own routing differs from the recorded one
    want = token_logprobs(_replayed(graphdef, moved, recorded), jnp.roll(IDS, -1, axis=1))
    own = token_logprobs(_routing(graphdef, moved)[0], jnp.roll(IDS, -1, axis=1))
    assert np.abs(np.asarray(want - own)).max() > 1e-3
    return decoder_forward(graphdef, 0), moved, recorded, np.asarray(want), np.asarray(own)


@pytest.mark.slow  # compiles an MoE forward three ways
def test_every_rl_forward_replays_the_batch_routing():
    fwd, moved, recorded, want, own = _setup()
    replay, plain = _batch(recorded), _batch(None)

    ref = jax.jit(lambda p, b: reference_logprobs(fwd, p, b, temperature=1.0, microbatches=2,
                                                  routing=b.routing))
    trunc = jax.jit(lambda p, b: truncated_logprobs(fwd, p, b, temperature=1.0,
                                                    microbatches=2)[0])

    def loss_fn(out, mb):  # the logprob sum as an aux, apart from the router losses
        logp = token_logprobs(out, mb.targets)
        return logp.sum(), jnp.float32(logp.size), {"logp_sum": logp.sum()}

    grads_fn = jax.jit(make_grads_fn(fwd, loss_fn, microbatches=2))

    for batch, expected in ((replay, want), (plain, own)):
        np.testing.assert_allclose(ref(moved, batch), expected, atol=1e-5)
        np.testing.assert_allclose(trunc(moved, batch), expected, atol=1e-5)
        np.testing.assert_allclose(grads_fn(moved, batch)[2]["logp_sum"], expected.sum(),
                                   rtol=1e-5)
