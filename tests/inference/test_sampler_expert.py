"""A colocated MoE sampler with its own expert axis (``rl.sampler_expert``): its mesh spans the
trainer's devices with the experts sharded further, the handoff lands on it from the trainer's
mesh, each chip holds fewer expert weights, and it decodes what the trainer-shaped sampler
decodes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from meshrl.configs import ConfigError, base_config, from_config_dict
from meshrl.configs.schema import SamplerConfig
from meshrl.inference.requests import Request
from meshrl.inference.sampler import Sampler
from meshrl.mesh import rules_for
from meshrl.mesh.placement import create_meshes, process_sampler_mesh
from meshrl.models import create_model, split_model
from meshrl.tests.inference.test_moe_sampler import MOE, PROMPTS
from meshrl.utils.params import flat_params

pytestmark = pytest.mark.distributed


def _config(sampler_expert: int):
    cfg = base_config("rl")
    cfg.model.update(arch="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32,
                     intermediate_size=64, moe_intermediate_size=16, num_layers=2, num_heads=4,
                     num_kv_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(1,),
                     max_position_embeddings=256)
    cfg.mesh.update(data=4, expert=2, fsdp=True)
    cfg.rl.sampler_expert = sampler_expert
    return from_config_dict(cfg)


def test_colocated_sampler_mesh_takes_the_expert_size_over_the_trainers_devices():
    trainer, sampler = create_meshes(_config(4))
    _, same = create_meshes(_config(0))

    assert dict(sampler.shape) == {**dict(trainer.shape), "data": 2, "expert": 4}
    assert set(sampler.devices.flat) == set(trainer.devices.flat)
    assert dict(same.shape) == dict(trainer.shape)


def test_a_per_process_sampler_expert_that_does_not_fit_a_process_is_one_line():
    trainer, _ = create_meshes(_config(4))

    with pytest.raises(ConfigError, match=re.escape(
            "mesh.tensor = 1, rl.sampler_expert = 16, mesh.expert_tensor = 1: with several "
            "processes each process's sampler keeps these sizes on its own 8 devices, so their "
            "product must divide 8")):
        process_sampler_mesh(trainer, 16)


@pytest.mark.slow  # a whole MoE sampler on two meshes
def test_sampler_with_experts_over_every_chip_decodes_like_the_trainer_shaped_one():
    trainer_mesh, wide_mesh = create_meshes(_config(4))
    _, params = split_model(create_model(MOE, mesh=trainer_mesh, rules=rules_for("train", True),
                                         seed=3))
    cfg = SamplerConfig(max_len=64, slots=8, max_new_tokens=6, temperature=0.0, decode_chunk=4,
                        prompt_buckets=(8, 16))
    narrow = Sampler(MOE, cfg, trainer_mesh, params)  # the handoff from the trainer's mesh
    wide = Sampler(MOE, cfg, wide_mesh, params)

    want = narrow.generate([Request(p, max_new_tokens=6) for p in PROMPTS])
    got = wide.generate([Request(p, max_new_tokens=6) for p in PROMPTS])

    up = "layers/0/mlp/up"  # an expert weight [E, D, F]: E split 2 ways, then 4
    shard = {n: next(v.addressable_shards[0].data.shape[0] for k, v in
                     flat_params(s.params).items() if k.startswith(up))
             for n, s in (("narrow", narrow), ("wide", wide))}
    assert shard == {"narrow": 2, "wide": 1}
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=1e-5, atol=1e-5)
