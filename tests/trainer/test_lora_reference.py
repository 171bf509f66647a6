"""The KL reference of a LoRA run: the adapter-disabled forward over the engine's frozen base."""

from __future__ import annotations

import jax
import numpy as np

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.mesh import create_mesh, rules_for
from meshrl.models.lora import LoraSetup
from meshrl.tests.trainer.tiny import make_trainee, tiny_rl_config
from meshrl.trainer.engine import expand_prefix
from meshrl.trainer.reference import ReferencePolicy, ref_fields
from meshrl.trainer.step import batch_shardings


def _batch(B, L):
    rng = np.random.default_rng(0)
    return RLTrainBatch(
        input_ids=rng.integers(3, 250, (B, L)).astype(np.int32),
        targets=rng.integers(3, 250, (B, L)).astype(np.int32),
        positions=np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        segment_ids=np.ones((B, L), np.int32),
        loss_mask=(np.arange(L) >= 4).astype(np.float32)[None].repeat(B, 0),
        behaviour_logprobs=np.zeros((B, L), np.float32), versions=np.zeros((B, L), np.int32),
        advantages=np.zeros((B, L), np.float32),
        sample_ids=np.broadcast_to(np.arange(B, dtype=np.int32)[:, None], (B, L)).copy())


def test_lora_reference_scores_the_frozen_base_it_reads_at_each_apply():
    config = tiny_rl_config(**{"mesh.data": 8, "rl.kl_coef": 0.5, "lora.rank": 4})
    B, L = 8, 12
    mesh, rules = create_mesh(config.mesh), rules_for("train", False)
    trainee = make_trainee(config, mesh)
    params_sh = expand_prefix(trainee.params_shardings, trainee.params)
    setup = LoraSetup(config.lora, _graphdef(config, mesh), trainee.params, params_sh)
    batch_sh = batch_shardings(mesh, rules, B, L, RLTrainBatch, *ref_fields(config.rl))
    kw = dict(samples=B, temperature=0.7, group_size=2)
    full = ReferencePolicy(config.rl, trainee.forward, trainee.params, params_sh, mesh,
                           batch_sh, **kw)
    frozen = {"tree": setup.freeze(trainee.params)}
    lora = ReferencePolicy(config.rl, setup.reference_forward(trainee.forward), None,
                           setup.frozen_sh, mesh, batch_sh, base=lambda: frozen["tree"], **kw)
    in_sh = batch_sh.replace(ref_logprobs=None)
    placed = jax.tree.map(jax.device_put, _batch(B, L).like(in_sh), in_sh)

    want = np.asarray(full.apply(placed)[0].ref_logprobs)
    got = np.asarray(lora.apply(placed)[0].ref_logprobs)

    assert lora.params is None  # no copy of the weights held
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # It reads the base the engine holds now (the step donates and returns it).
    frozen["tree"] = jax.tree.map(lambda x: x * 0.5, frozen["tree"])
    assert np.abs(np.asarray(lora.apply(placed)[0].ref_logprobs) - want).max() > 1e-4


def _graphdef(config, mesh):
    from meshrl.models import create_model, split_model

    rules = rules_for("train", config.mesh.fsdp)
    return split_model(create_model(config.model, mesh=mesh, rules=rules,
                                    seed=config.trainer.seed))[0]
