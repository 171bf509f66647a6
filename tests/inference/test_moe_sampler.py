"""The sampler decodes an MoE decoder (a dense layer mixed in): greedy tokens and logprobs equal
the full forward's argmax (KV-cache parity), on one device and on expert=2, tensor=2."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference.requests import Request
from meshrl.inference.sampler import Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import _devices, reference_greedy

MOE = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32,
                  intermediate_size=64, moe_intermediate_size=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(1,),
                  max_position_embeddings=256)
PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7], [88, 12, 19]]


@pytest.fixture(scope="module")
def moe_model():
    return split_model(create_model(MOE, seed=3))


@pytest.fixture(scope="module")
def references(moe_model):
    graphdef, params = moe_model
    return [reference_greedy(graphdef, params, p, 6) for p in PROMPTS]


@pytest.mark.parametrize("mesh_cfg", [pytest.param(None, marks=pytest.mark.slow),
                                      MeshConfig(data=1, expert=2, tensor=2)],
                         ids=["one_device", "expert2_tensor2"])
def test_moe_sampler_greedy_equals_the_full_forward_argmax(moe_model, references, mesh_cfg):
    _, params = moe_model
    mesh = create_mesh(mesh_cfg or MeshConfig(data=1), _devices(mesh_cfg))
    sampler = Sampler(MOE, SamplerConfig(max_len=64, slots=4, max_new_tokens=6, temperature=0.0,
                                         decode_chunk=4, prompt_buckets=(8, 16)), mesh, params)

    outs = sampler.generate([Request(p, max_new_tokens=6) for p in PROMPTS])

    for out, (tokens, logprobs) in zip(outs, references, strict=True):
        assert out.tokens == tokens
        np.testing.assert_allclose(out.raw_logprobs, logprobs, rtol=1e-4, atol=1e-5)
