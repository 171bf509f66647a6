"""MoE routing replay in the RL job (``rl.routing_replay = 'rollout'``): the sampler records each
generated token's experts and the train step's forwards route those tokens to them, so with a
float32 sampler and synchronous RL the trainer's logprobs equal the sampler's to float
rounding, on one device and with the experts split over two; without replay a bfloat16
sampler routes some tokens elsewhere and the mismatch is larger (a wider MoE, where bfloat16
rounding flips some of the k-th/(k+1)-th expert near-ties)."""

from __future__ import annotations

import jax
import pytest

from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config

MOE = {"model.arch": "qwen3_moe", "model.qk_norm": True, "model.num_layers": 2,
       "model.num_experts": 4, "model.num_experts_per_tok": 2,
       "model.moe_intermediate_size": 16, "model.compute_dtype": "float32",
       "rollout.max_staleness": 0}


WIDE = {"model.num_layers": 4, "model.num_experts": 64, "model.num_experts_per_tok": 8,
        "sampler.max_new_tokens": 16, "rollout.group_size": 4, "rollout.prompts_per_step": 4}


def _mismatch(tmp_path, **overrides) -> list[dict]:
    trainer, _ = run_rl(tiny_rl_config(**{**MOE, **overrides}), tmp_path)
    assert len(trainer.history) == 2
    return trainer.history


@pytest.mark.slow  # an RL run per mesh; the batch and compiled-step routing tests stay fast
@pytest.mark.parametrize("mesh", [{}, pytest.param({"mesh.expert": 2},
                                                   marks=[pytest.mark.distributed,
                                                          pytest.mark.slow])],
                         ids=["one_device", "expert2"])
def test_replayed_routing_makes_the_trainer_logprobs_equal_the_samplers(tmp_path, mesh):
    if mesh and jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    history = _mismatch(tmp_path, **{"sampler.dtype": "float32",
                                     "rl.routing_replay": "rollout", **mesh})
    for record in history:
        assert record["train/logprob_mismatch_tokens"] == record["train/tokens"] > 0
        assert record["train/logprob_mismatch_max"] <= 1e-6, record


@pytest.mark.slow
def test_replay_removes_the_mismatch_of_a_bfloat16_sampler(tmp_path):
    """The same bfloat16-sampler run with and without replay; step 1 samples the same tokens
    from the same params in both. Replay leaves only the bfloat16 rounding of the forward;
    without it the tokens whose experts flipped also take other experts."""
    runs = {mode: _mismatch(tmp_path / mode, **{**WIDE, "sampler.dtype": "bfloat16",
                                                "rl.routing_replay": mode})[0]
            for mode in ("off", "rollout")}
    off, on = (runs[m]["train/logprob_mismatch_max"] for m in ("off", "rollout"))
    assert on < off, (on, off)


def test_compiled_rl_step_takes_the_routing_field():
    from meshrl.jobs.compile_programs import train_program
    from meshrl.mesh import create_mesh

    config = tiny_rl_config(**{**MOE, "rl.routing_replay": "rollout"})
    mesh = create_mesh(config.mesh, jax.devices()[:1])
    program = train_program(config, config.model, mesh)

    batch = program.lowered.args_info[0][1]
    assert batch.routing.shape == (6, 32, 2, 2)  # [rows, L, layers, k]
