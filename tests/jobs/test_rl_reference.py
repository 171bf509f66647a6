"""The KL reference policy of the RL job (``rl.kl_coef > 0``, ``trainer/reference.py``): it is
the step-0 policy, frozen in its own buffers, its logprobs reach the loss (``kl_where="loss"``)
or the advantages (``kl_where="reward"``), and a resumed run rebuilds the same reference.

Runs on the suite's 8 fake CPU devices with a data x tensor = 4 x 2 trainer mesh and two
microbatches, so the reference pass is sharded and microbatched like the train step."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms import advantages as adv_lib
from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.kl import kl_reward_advantages
from meshrl.algorithms.losses import token_logprobs
from meshrl.configs.schema import Config
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.tests.trees import assert_trees_equal, unchanged_leaves

T = 0.7  # a temperature != 1: the reference must be scored at the sampler's temperature
TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 logprobs, tensor-parallel vs one-device sums


def _kl_config(**overrides: Any) -> Config:
    """8 rows (4 groups of 2), synchronous, KL on; every step trains on a fresh version."""
    return tiny_rl_config(**{"mesh.data": 4, "mesh.tensor": 2, "rollout.prompts_per_step": 4,
                             "rollout.max_staleness": 0, "trainer.microbatches": 2,
                             "sampler.temperature": T, "rl.kl_coef": 0.5, **overrides})


def _informative_rewards(batch: RLTrainBatch, config: Config) -> RLTrainBatch:
    # An untrained policy earns 0 everywhere: all advantages 0, no update, and in the reward
    # mode GRPO would normalise a ~1e-7 KL's float noise. Rewards 0, 1 in every group (and their
    # advantages) keep the policy moving and the advantages well conditioned.
    ids_BxL = batch.sample_ids
    rewards_B = (np.arange(int(ids_BxL.max()) + 1) % 2).astype(np.float32)
    advantages_B = np.asarray(adv_lib.compute(config.rl.advantage, jnp.asarray(rewards_B),
                                              config.rollout.group_size, eps=config.rl.adv_eps))
    at_BxL = np.maximum(ids_BxL, 0)
    return batch.replace(
        rewards=np.where(ids_BxL >= 0, rewards_B[at_BxL], 0.0).astype(np.float32),
        advantages=(advantages_B[at_BxL] * batch.loss_mask).astype(np.float32))


@dataclasses.dataclass
class Run:
    trainer: Any
    summary: dict[str, Any]
    params0: Any  # host copy of the trainer's params at version 0
    ref_before: Any  # host copy of the reference params before any step
    rollouts: list[RLTrainBatch]  # the host batch of each step, before the reference
    batches: list[RLTrainBatch]  # the batch each train step received (host copies)


def _run(config: Config, workdir: Any) -> Run:
    from meshrl.jobs import rl as rl_job
    from meshrl.trainer import rl_loop

    rollouts: list[Any] = []
    batches: list[RLTrainBatch] = []
    real_make = rl_loop.make_rl_batch

    def make(*args: Any, **kwargs: Any) -> Any:
        rollouts.append(_informative_rewards(real_make(*args, **kwargs), config))
        return rollouts[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_loop, "make_rl_batch", make)
        trainer = rl_job.build(config, workdir)
        try:
            params0 = jax.device_get(trainer.state.params)
            ref_before = jax.device_get(trainer.reference.params)
            step_call = type(trainer.step).__call__

            def spy(step: Any, state: Any, batch: RLTrainBatch) -> Any:
                batches.append(jax.device_get(batch))  # explicit: the transfer guard allows it
                return step_call(step, state, batch)

            mp.setattr(type(trainer.step), "__call__", spy)
            summary = asyncio.run(trainer.arun())
        finally:
            trainer.close()
    return Run(trainer, summary, params0, ref_before, rollouts, batches)


def _logprobs(trainer: Any, params: Any, batch: RLTrainBatch) -> np.ndarray:
    """Unsharded, unmicrobatched log p(target) at T on one device, 0 off the loss mask."""
    @jax.jit
    def fn(p: Any, b: RLTrainBatch) -> jax.Array:
        logits_BxLxV = trainer.forward(p, b.input_ids, b.positions, b.segment_ids)
        return jnp.where(b.loss_mask > 0, token_logprobs(logits_BxLxV, b.targets, T), 0.0)

    return np.asarray(fn(params, batch.replace(ref_logprobs=None)))


@pytest.fixture(scope="module")
def loss_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(_kl_config(**{"rl.kl_where": "loss"}), tmp_path_factory.mktemp("loss"))


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # drgrpo: with 2-sample groups GRPO maps any reward pair to +-1 and would hide the KL.
    return _run(_kl_config(**{"rl.kl_where": "reward", "rl.advantage": "drgrpo"}),
                tmp_path_factory.mktemp("reward"))


@pytest.mark.distributed
def test_kl_in_loss_scores_every_batch_under_the_step0_policy_and_kl_starts_at_zero(loss_run):
    run = loss_run

    assert (run.summary["steps"], run.summary["start_step"]) == (2, 0)
    assert len(run.batches) == 2
    for step, batch in enumerate(run.batches, start=1):
        want_BxL = _logprobs(run.trainer, run.params0, batch)
        # Step 1: the trainer's own version-0 logprobs; step 2: still the step-0 policy.
        np.testing.assert_allclose(batch.ref_logprobs, want_BxL, err_msg=f"step {step}",
                                   **TOL)
    first, second = run.trainer.history
    # KL(current || ref) at step 1 is between identical policies: k3 of a ~1e-6 log-ratio.
    np.testing.assert_allclose(first["train/kl_ref"], 0.0, rtol=0, atol=1e-6)
    # The sampler drew step 1 with the same version-0 weights: its KL to the reference is ~0.
    np.testing.assert_allclose(first["train/kl_behaviour_ref"], 0.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(run.batches[0].ref_logprobs,
                               run.batches[0].behaviour_logprobs, rtol=0, atol=1e-4)
    # Step 2 (synchronous): the policy moved away from the reference, and the sampler's policy
    # is the trainer's, so both KLs are the same positive number.
    assert second["train/kl_ref"] > 1e-6
    np.testing.assert_allclose(second["train/kl_behaviour_ref"], second["train/kl_ref"],
                               rtol=1e-2, atol=1e-7)


@pytest.mark.slow  # a second RL run; the reward-KL advantage math has unit tests
@pytest.mark.distributed
def test_kl_in_reward_recomputes_advantages_with_the_step0_reference(reward_run):
    run = reward_run
    rl, group_size = run.trainer.config.rl, run.trainer.config.rollout.group_size

    assert (run.summary["steps"], run.summary["start_step"]) == (2, 0)
    assert len(run.batches) == 2
    for step, (batch, rb) in enumerate(zip(run.batches, run.rollouts, strict=True), start=1):
        assert batch.ref_logprobs is None  # the loss adds no KL of its own
        ref_BxL = _logprobs(run.trainer, run.params0, batch)
        mask_BxL = batch.loss_mask
        ids_BxL = batch.sample_ids  # rows are packed: each token names its sample
        want_B = kl_reward_advantages(rl, jnp.asarray(rb.sample_rewards()),
                                      jnp.asarray(batch.behaviour_logprobs),
                                      jnp.asarray(ref_BxL), jnp.asarray(mask_BxL), group_size,
                                      sample_ids_BxL=jnp.asarray(ids_BxL))
        np.testing.assert_allclose(batch.advantages,
                                   np.asarray(want_B)[np.maximum(ids_BxL, 0)] * mask_BxL,
                                   err_msg=f"step {step}", **TOL)
    first, second = run.trainer.history
    assert "train/kl_ref" not in first
    # At step 2 the policy has moved: the KL visibly changed the rollout's own advantages.
    plain_BxL = run.rollouts[1].advantages  # the same packing, before the KL
    assert np.abs(run.batches[1].advantages - plain_BxL).max() > 1e-5
    assert second["train/kl_behaviour_ref"] > 1e-6
    np.testing.assert_allclose(first["train/kl_behaviour_ref"], 0.0, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_reference_params_survive_donated_train_steps_unchanged_while_the_policy_moves(
        loss_run):
    run = loss_run
    ref_after = jax.device_get(run.trainer.reference.params)
    policy_after = jax.device_get(run.trainer.state.params)

    assert_trees_equal(ref_after, run.ref_before)
    assert_trees_equal(run.ref_before, run.params0)  # the reference is the version-0 policy
    still = unchanged_leaves(policy_after, run.params0)
    assert len(still) < len(jax.tree.leaves(run.params0)), \
        "the trainer's params did not move: the test would prove nothing"
    ref_sh = [x.sharding for x in jax.tree.leaves(run.trainer.reference.params)]
    state_sh = [x.sharding for x in jax.tree.leaves(run.trainer.state.params)]
    assert ref_sh == state_sh


@pytest.mark.slow  # a second RL run; the reference logic is checked by the first
@pytest.mark.distributed
def test_resumed_run_restores_the_warm_start_as_the_same_reference_without_retraining(
        tmp_path):
    from meshrl.jobs import rl as rl_job

    config = _kl_config(**{"rl.warm_start_steps": 2, "trainer.steps": 1})
    first = rl_job.build(config, tmp_path)
    try:
        ref_first = jax.device_get(first.reference.params)
        asyncio.run(first.arun())  # one RL step, checkpointed at the end
    finally:
        first.close()
    sft = tmp_path / "sft" / "checkpoints"
    sft_steps = sorted(p.name for p in sft.iterdir() if p.name.isdigit())
    sft_mtime = (sft / sft_steps[-1]).stat().st_mtime_ns

    resumed = rl_job.build(_kl_config(**{"rl.warm_start_steps": 2, "trainer.steps": 2}),
                                tmp_path)
    try:
        ref_resumed = jax.device_get(resumed.reference.params)
        start_step, warm = resumed.start_step, resumed.warm_start_steps
    finally:
        resumed.close()

    assert (start_step, warm) == (1, 2)  # resumed: the run's warm start, restored (below)
    assert sft_steps == ["2"]
    assert sorted(p.name for p in sft.iterdir() if p.name.isdigit()) == sft_steps
    assert (sft / "2").stat().st_mtime_ns == sft_mtime  # restored, not retrained and resaved
    assert_trees_equal(ref_resumed, ref_first)


@pytest.mark.parametrize("kl_where", ["loss", "reward"])
def test_reference_apply_puts_a_microbatched_reference_kl_into_the_batch(kl_where):
    from meshrl.algorithms import kl as kl_lib
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.tests.trainer.tiny import make_trainee
    from meshrl.trainer.engine import expand_prefix
    from meshrl.trainer.reference import ReferencePolicy, ref_fields, reference_logprobs
    from meshrl.trainer.step import batch_shardings

    # drgrpo (r - group mean): GRPO's std scaling maps every 2-sample group to +-1, KL or not.
    config = tiny_rl_config(**{"mesh.data": 8, "rl.kl_coef": 0.5, "rl.kl_where": kl_where,
                               "rl.advantage": "drgrpo"})
    rl, B, L, G = config.rl, 8, 12, 2
    mesh, rules = create_mesh(config.mesh), rules_for("train", False)
    trainee = make_trainee(config, mesh)
    params_sh = expand_prefix(trainee.params_shardings, trainee.params)
    batch_sh = batch_shardings(mesh, rules, B, L, RLTrainBatch, *ref_fields(rl))
    reference = ReferencePolicy(rl, trainee.forward, trainee.params, params_sh, mesh, batch_sh,
                                samples=B, temperature=T, group_size=G, microbatches=2)
    rng = np.random.default_rng(0)
    mask_BxL = (np.arange(L) >= 6).astype(np.float32)[None].repeat(B, 0)
    batch = RLTrainBatch(
        input_ids=rng.integers(3, 250, (B, L)).astype(np.int32),
        targets=rng.integers(3, 250, (B, L)).astype(np.int32),
        positions=np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        segment_ids=np.ones((B, L), np.int32), loss_mask=mask_BxL,
        behaviour_logprobs=np.zeros((B, L), np.float32), versions=np.zeros((B, L), np.int32),
        advantages=np.zeros((B, L), np.float32),
        sample_ids=np.broadcast_to(np.arange(B, dtype=np.int32)[:, None], (B, L)).copy())
    # Unmicrobatched, unsharded reference logprobs; the behaviour policy sits 0.1 (b + 1) nats
    # below on row b, so the sequence KLs differ within each group.
    ref_BxL = np.asarray(jax.jit(functools.partial(
        reference_logprobs, trainee.forward, temperature=T, microbatches=1))(
            jax.device_get(trainee.params), jax.tree.map(jnp.asarray, batch)))
    shift_Bx1 = 0.1 * (1.0 + np.arange(B, dtype=np.float32))[:, None]
    batch = batch.replace(behaviour_logprobs=(ref_BxL - shift_Bx1) * mask_BxL)
    rewards_B = (np.arange(B) % 2).astype(np.float32)
    batch = batch.replace(rewards=np.repeat(rewards_B[:, None], L, 1))
    in_sh = batch_sh.replace(ref_logprobs=None)
    placed = jax.tree.map(jax.device_put, batch.like(in_sh), in_sh)

    out, metrics = reference.apply(placed)

    assert jax.tree.structure(out) == jax.tree.structure(batch_sh)
    assert np.all(ref_BxL[:, :6] == 0.0) and np.all(ref_BxL[:, 6:] < 0.0)
    kl_BxL = np.asarray(kl_lib.get(rl.kl_estimator)(jnp.asarray(batch.behaviour_logprobs),
                                                    jnp.asarray(ref_BxL))) * mask_BxL
    np.testing.assert_allclose(float(metrics["kl_behaviour_ref"]),
                               kl_BxL.sum() / mask_BxL.sum(), **TOL)
    if kl_where == "loss":
        np.testing.assert_allclose(np.asarray(out.ref_logprobs), ref_BxL, **TOL)
        np.testing.assert_array_equal(np.asarray(out.advantages), batch.advantages)
    else:
        want_B = kl_reward_advantages(rl, jnp.asarray(rewards_B),
                                      jnp.asarray(batch.behaviour_logprobs),
                                      jnp.asarray(ref_BxL), jnp.asarray(mask_BxL), G)
        plain_B = kl_reward_advantages(dataclasses.replace(rl, kl_coef=0.0),
                                       jnp.asarray(rewards_B),
                                       jnp.asarray(batch.behaviour_logprobs),
                                       jnp.asarray(ref_BxL), jnp.asarray(mask_BxL), G)
        got_BxL = np.asarray(out.advantages)
        np.testing.assert_allclose(got_BxL, np.asarray(want_B)[:, None] * mask_BxL, **TOL)
        assert not np.allclose(got_BxL, np.asarray(plain_B)[:, None] * mask_BxL, rtol=1e-3,
                               atol=1e-3)  # the KL really moved the advantages


def test_resumed_lora_run_keeps_its_warm_start_base_when_trainer_steps_grow(tmp_path):
    # LoRA without a KL: the warm start's result is the frozen base the adapters adapt. With
    # rl.warm_start_steps = -1 (as many as trainer.steps) a longer resumed run must restore the
    # warm start it ran, not start from the random init nor train the warm start further.
    import orbax.checkpoint as ocp

    from meshrl.jobs import rl as rl_job
    from meshrl.tests.trainer.tiny import run_rl
    from meshrl.utils.params import flat_params

    over = {"rl.warm_start_steps": -1, "rl.warm_start_batch_size": 4, "lora.rank": 4,
            "trainer.steps": 1}
    run_rl(tiny_rl_config(**over), tmp_path)  # 1 warm-start step, 1 RL step, version 1
    published = flat_params(ocp.StandardCheckpointer().restore(tmp_path / "weights" / "1"))

    resumed = rl_job.build(tiny_rl_config(**{**over, "trainer.steps": 2}), tmp_path)
    try:
        merged = flat_params(jax.device_get(resumed.engine.params))
        start, warm = resumed.start_step, resumed.warm_start_steps
    finally:
        resumed.close()

    assert (start, warm) == (1, 1)
    assert sorted(p.name for p in (tmp_path / "sft" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["1"]
    assert merged.keys() == published.keys()
    for name, value in published.items():  # the sampler's weights at version 1, merged
        np.testing.assert_allclose(merged[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
