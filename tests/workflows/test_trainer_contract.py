"""An RL batch through the trainer's own pure train step with the RL loss: the keys, shapes
and the strided microbatch split fit, and the step moves the policy the right way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshrl.algorithms.losses import token_logprobs
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import RLConfig
from meshrl.trainer.state import init_state
from meshrl.trainer.step import make_train_step
from meshrl.workflows import Trajectory, build_rl_batch

V = 8


def forward(params, input_ids_BxL, positions_BxL=None, segment_ids_BxL=None):
    """A bigram 'model': logits of the next token depend on the current token only."""
    return params["table"][input_ids_BxL]


def groups(table: jax.Array) -> list[list[Trajectory]]:
    logp_VxV = jax.nn.log_softmax(table)

    def traj(prompt, completion, reward, gid):
        ctx = [prompt[-1], *completion[:-1]]
        lps = [float(logp_VxV[a, b]) for a, b in zip(ctx, completion, strict=True)]
        return Trajectory([prompt[-1]], list(completion), lps, [0] * len(completion),
                          [1] * len(completion), reward=reward, group_id=gid)
    return [[traj([1], [2, 3], 1.0, 0), traj([1], [4, 5, 6], 0.0, 0)],
            [traj([2], [3], 0.0, 1), traj([2], [7, 7], 1.0, 1)]]


@pytest.mark.parametrize("microbatches", [1, 2])
def test_rl_train_step_raises_the_logprob_of_positive_advantage_tokens(microbatches):
    params = {"table": jnp.zeros((V, V))}
    batch = build_rl_batch(groups(params["table"]), length_buckets=(6,))
    tx = optax.sgd(1.0)
    step = jax.jit(make_train_step(forward, make_rl_loss_fn(RLConfig()), tx,
                                   lambda s: 1.0, microbatches=microbatches))
    state = init_state(params, tx, seed=0)

    new_state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
    before = token_logprobs(forward(params, batch.input_ids), batch.targets)
    after = token_logprobs(forward(new_state.params, batch.input_ids), batch.targets)

    assert float(metrics["tokens"]) == batch.loss_mask.sum() == 8
    np.testing.assert_allclose(float(metrics["behav_weight_mean"]), 1.0, rtol=1e-5, atol=1e-5)
    # token 1 -> 2 was sampled in a positive-advantage episode and 2 -> 3 nowhere else
    up = np.asarray(after - before)[0, 0]
    assert up > 0, up
    assert bool(metrics["finite"])


def test_rl_train_step_with_microbatches_equals_one_big_batch():
    params = {"table": 0.1 * jax.random.normal(jax.random.key(0), (V, V))}
    batch = build_rl_batch(groups(params["table"]), length_buckets=(6,))
    batch = jax.tree.map(jnp.asarray, batch)
    tx = optax.sgd(0.5)
    outs = []
    for m in (1, 2):
        step = make_train_step(forward, make_rl_loss_fn(RLConfig(kl_coef=0.0)), tx,
                               lambda s: 0.5, microbatches=m)
        outs.append(jax.jit(step)(init_state(params, tx, seed=0), batch))

    (s1, m1), (s2, m2) = outs
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2.params["table"], s1.params["table"], rtol=1e-5, atol=1e-6)
