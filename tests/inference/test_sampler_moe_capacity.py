"""A capacity-limited MoE in the sampler: bucket padding takes no expert capacity, so a prompt's
first token is scored as the trainer scores the same rows (padding masked by segment ids)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference.sampler import Request, Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.models.decoder import forward

P = 12
MOE = ModelConfig(arch="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=32,
                  intermediate_size=48, moe_intermediate_size=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, num_experts=4, num_experts_per_tok=2, param_dtype="float32",
                  compute_dtype="float32", capacity_factor=0.5)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_bucket_padding_takes_no_expert_capacity_in_the_samplers_prefill(kv_cache):
    graphdef, params = split_model(create_model(MOE, seed=0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, 2).tolist(), rng.integers(1, 64, 4).tolist()]
    # One prefill pass holds the longest bucket's P tokens: three rows of the 4-token bucket,
    # the first with 2 padding tokens before the second's, the third an empty row.
    sampler = Sampler(MOE, SamplerConfig(max_len=32, slots=3, max_new_tokens=1,
                                         temperature=0.0, prompt_buckets=(4, P),
                                         kv_cache=kv_cache, page_size=4),
                      create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1]), params)

    got = sampler.generate([Request(p, max_new_tokens=1) for p in prompts],
                           longest_first=False)

    # The trainer's view of the same three rows: padding masked by segment ids.
    ids, seg = np.zeros((3, 4), np.int32), np.zeros((3, 4), np.int32)
    for r, p in enumerate(prompts):
        ids[r, :len(p)], seg[r, :len(p)] = p, 1
    pos = np.broadcast_to(np.arange(4, dtype=np.int32), (3, 4))
    logits = np.asarray(forward(graphdef, params, jnp.asarray(ids), jnp.asarray(pos),
                                jnp.asarray(seg)))
    for r, p in enumerate(prompts):
        logp = jax.nn.log_softmax(logits[r, len(p) - 1])
        assert got[r].tokens[0] == int(np.argmax(logp))
        np.testing.assert_allclose(got[r].raw_logprobs[0], logp[got[r].tokens[0]], rtol=1e-5,
                                   atol=1e-5)
