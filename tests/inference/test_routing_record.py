"""The sampler records each generated token's routing (``record_routing``): the experts of the
forward it was sampled from, equal to the trainer's full forward at that position; replaying
them reproduces the sampler's logprobs. Without the flag nothing is recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference.requests import Request
from meshrl.inference.sampler import Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import _devices

MOE = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32,
                  intermediate_size=64, moe_intermediate_size=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(1,),
                  max_position_embeddings=256)
PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7]]
SAMPLING = SamplerConfig(max_len=64, slots=4, max_new_tokens=6, temperature=1.0,
                         decode_chunk=4, prompt_buckets=(8, 16))


@pytest.fixture(scope="module")
def moe_model():
    return split_model(create_model(MOE, seed=3))


def _rows(outs) -> jax.Array:
    """Each prompt + its completion but the last token, zero-padded to one [3, 16] batch (the
    causal forward never lets the padding reach a real position): one compile."""
    rows = np.zeros((len(PROMPTS), 16), np.int32)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        seq = list(prompt) + out.tokens[:-1]
        rows[i, :len(seq)] = seq
    return jnp.asarray(rows)


def _generated(prompt, out, x_BxLx) -> np.ndarray:
    """The generated tokens' rows of a per-position array (position P - 1 + j for token j)."""
    P = len(prompt)
    return np.asarray(x_BxLx)[P - 1:P - 1 + len(out.tokens)]


@pytest.mark.parametrize("mesh_cfg", [None, pytest.param(MeshConfig(data=1, expert=2),
                                                         marks=[pytest.mark.distributed,
                                                                pytest.mark.slow])],
                         ids=["one_device", "expert2"])
def test_recorded_routing_equals_the_trainer_forward_and_replays_its_logprobs(moe_model,
                                                                             mesh_cfg):
    graphdef, params = moe_model
    mesh = create_mesh(mesh_cfg or MeshConfig(data=1), _devices(mesh_cfg))
    sampler = Sampler(MOE, SAMPLING, mesh, params, record_routing=True)

    outs = sampler.generate([Request(p, seed=i) for i, p in enumerate(PROMPTS)])

    rows = _rows(outs)
    own, routing = jax.jit(lambda p, s: nnx.merge(graphdef, p)(s, return_routing=True))(
        params, rows)
    replayed = jax.jit(lambda p, s, r: nnx.merge(graphdef, p)(s, replay_NxBxLxK=r))(
        params, rows, routing)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        routing_nxLxK = np.stack(out.routing)
        assert routing_nxLxK.shape == (len(out.tokens), 2, 2)
        assert (routing_nxLxK[:, 1] == -1).all()  # layer 1 is dense
        np.testing.assert_array_equal(
            routing_nxLxK, _generated(prompt, out, routing[:, i].swapaxes(0, 1)))
        for logits in (own, replayed):
            logp = _generated(prompt, out, jax.nn.log_softmax(logits[i], -1))
            np.testing.assert_allclose(
                np.take_along_axis(logp, np.asarray(out.tokens)[:, None], -1)[:, 0],
                out.raw_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a compile for a negative check; the flag's effect is tested above
def test_without_the_flag_no_routing_is_recorded(moe_model):
    _, params = moe_model
    sampler = Sampler(MOE, SAMPLING, create_mesh(MeshConfig(data=1), jax.devices()[:1]), params)

    out = sampler.generate([Request(PROMPTS[0])])[0]

    assert out.routing == [] and len(out.tokens) == 6
