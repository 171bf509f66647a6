"""Packed RL train batches: several sequences per row, and a train step that sees the same loss,
metrics and gradients as on the padded batch (segment-aware attention, per-sequence terms)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshrl.algorithms.batch import RLTrainBatch, field_dtype
from meshrl.algorithms.kl import kl_reward_advantages
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import ModelConfig, RLConfig
from meshrl.models import create_model, forward, split_model
from meshrl.trainer.state import init_state
from meshrl.trainer.step import BucketedStep, make_train_step, row_buckets
from meshrl.workflows import Trajectory, build_rl_batch, pack_rows, rows_needed

V, L = 32, 16


def test_pack_rows_places_longest_first_into_the_first_row_with_room():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [1, 1, 2, 0, 0]
    assert pack_rows([8, 8], 8) == [0, 1]
    assert pack_rows([], 8) == []


@pytest.mark.parametrize("lengths", [[3, 0], [9]])
def test_pack_rows_rejects_a_sequence_that_no_row_holds(lengths):
    with pytest.raises(ValueError, match=r"must be in \[1, 8\]"):
        pack_rows(lengths, 8)


def rollout(seed: int = 0, groups: int = 3, n: int = 2):
    """Groups of random trajectories (prompt 2-5 tokens, completion 1-9), some feedback tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        group = []
        for _ in range(n):
            p, c = int(rng.integers(2, 6)), int(rng.integers(1, 10))
            mask = [1] + [int(x) for x in rng.integers(0, 2, c - 1)]
            group.append(Trajectory(
                rng.integers(1, V, p).tolist(), rng.integers(1, V, c).tolist(),
                (-rng.random(c)).tolist(), [3] * c, mask,
                reward=float(rng.random()), group_id=g))
        out.append(group)
    return out


def build(groups, rows=None) -> RLTrainBatch:
    return build_rl_batch(groups, length_buckets=(L,), rows=rows)


def test_packed_batch_holds_each_sequence_once_in_a_segment_of_its_own():
    groups = rollout()
    padded, rows = build(groups), rows_needed(groups, L)
    packed = build(groups, rows + 1)  # one spare row: all padding

    assert rows < padded.rows
    for f in dataclasses.fields(packed):
        if getattr(packed, f.name) is not None:
            assert getattr(packed, f.name).dtype == field_dtype(RLTrainBatch, f.name), f.name
    for b, n in enumerate(len(t) for g in groups for t in g):
        where = packed.sample_ids == b
        r = int(np.flatnonzero(where.any(axis=1))[0])
        assert where.sum() == n and where[r].sum() == n  # whole, in one row
        for f in dataclasses.fields(padded):  # segment ids: renumbered within the row
            if f.name != "segment_ids" and getattr(padded, f.name) is not None:
                np.testing.assert_array_equal(getattr(packed, f.name)[where],
                                              getattr(padded, f.name)[b, :n], err_msg=f.name)
        assert len(set(packed.segment_ids[where].tolist())) == 1
    seg = packed.segment_ids
    assert not (seg[-1] > 0).any() and (packed.sample_ids[seg == 0] == -1).all()
    for r in range(rows):  # distinct segments per row
        ids = packed.sample_ids[r][seg[r] > 0]
        assert len(set(seg[r][seg[r] > 0].tolist())) == len(set(ids.tolist()))
    assert packed.loss_mask.sum() == padded.loss_mask.sum()


def test_packing_into_too_few_rows_fails_and_names_the_need():
    groups = rollout()
    with pytest.raises(ValueError, match=f"need {rows_needed(groups, L)} rows"):
        build(groups, rows_needed(groups, L) - 1)


def test_row_buckets_are_quarters_of_the_batch_rounded_to_the_shard_multiple():
    assert row_buckets(32, 1) == (8, 16, 24, 32)
    assert row_buckets(6, 2) == (2, 4, 6)
    assert row_buckets(12, 4) == (4, 8, 12)
    assert row_buckets(8, 8) == (8,)


def tiny_decoder():
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1)
    graphdef, params = split_model(create_model(cfg, seed=0))
    return (lambda p, ids, pos, seg: forward(graphdef, p, ids, pos, seg)), params


# GSPO with sequence_mean runs both per-sequence paths (the sequence ratio and the segment
# means); the per-token losses and token_mean share every other term, attention included. One
# case: each costs two train-step compiles (~12 s on 2 cores).
@pytest.mark.parametrize(("policy_loss", "aggregation"), [("gspo", "sequence_mean")])
def test_packed_step_equals_the_padded_step(policy_loss, aggregation):
    fwd, params = tiny_decoder()
    groups = rollout(seed=1, groups=4)
    rl = RLConfig(policy_loss=policy_loss, aggregation=aggregation, entropy_coef=0.01)
    tx = optax.sgd(0.1)
    step = jax.jit(make_train_step(fwd, make_rl_loss_fn(rl), tx, lambda s: 0.1, microbatches=2))
    need = rows_needed(groups, L)
    rows = need + need % 2  # microbatches must divide the rows
    # The step's fields only: ``rewards`` is for the KL-in-reward reference.
    outs = [step(init_state(params, tx, seed=0), jax.tree.map(jnp.asarray, b))
            for b in (build(groups).replace(rewards=None),
                      build(groups, rows).replace(rewards=None))]

    (s_pad, m_pad), (s_pack, m_pack) = outs
    assert rows < 8
    for k in ("loss", "tokens", "grad_norm", "clip_frac", "entropy", "ratio_mean"):
        np.testing.assert_allclose(m_pack[k], m_pad[k], rtol=2e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
                 s_pack.params, s_pad.params)


def test_kl_reward_advantages_follow_sample_ids_in_packed_rows():
    groups = rollout(seed=2)
    rl = dataclasses.replace(RLConfig(), advantage="drgrpo", kl_coef=0.5, kl_where="reward",
                             kl_estimator="k1")

    def advantages(rl, b):
        ref = jnp.asarray(b.behaviour_logprobs) - 0.3 * jnp.asarray(b.loss_mask)
        rewards_B = jnp.asarray(build(groups).sample_rewards())
        return kl_reward_advantages(rl, rewards_B, b.behaviour_logprobs, ref, b.loss_mask, 2,
                                    sample_ids_BxL=jnp.asarray(b.sample_ids))
    padded, packed = build(groups), build(groups, rows_needed(groups, L))

    np.testing.assert_allclose(advantages(rl, packed), advantages(rl, padded), rtol=1e-6,
                               atol=1e-6)
    without = advantages(dataclasses.replace(rl, kl_coef=0.0), padded)
    assert not np.allclose(advantages(rl, padded), without, atol=1e-3)  # the KL moved them


def test_bucketed_step_refuses_row_counts_outside_its_buckets():
    step = BucketedStep(lambda *a: None, None, L, (4, 8))
    batch = build(rollout(), 6)

    with pytest.raises(ValueError, match=r"6 rows: the step is compiled for \(4, 8\)"):
        step(None, batch)


def test_packing_picks_the_smallest_row_count_that_holds_the_batch():
    groups = rollout()
    need = rows_needed(groups, L)

    assert build(groups, (need - 1, need + 2, need + 5)).input_ids.shape == (need + 2, L)
    with pytest.raises(ValueError, match=f"need {need} rows"):
        build(groups, (need - 2, need - 1))
