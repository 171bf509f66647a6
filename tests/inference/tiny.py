"""Tiny model config and sampler builder shared by the inference tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference.sampler import Sampler
from meshrl.mesh import create_mesh
from meshrl.models import forward

TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256)


def make_sampler(params, *, mesh_cfg: MeshConfig | None = None, **sampler_kw) -> Sampler:
    kw = dict(max_len=64, slots=4, max_new_tokens=8, temperature=0.0, decode_chunk=4,
              prompt_buckets=(8, 16))
    kw.update(sampler_kw)
    mesh = create_mesh(mesh_cfg or MeshConfig(data=1, tensor=1), _devices(mesh_cfg))
    return Sampler(TINY, SamplerConfig(**kw), mesh, params)


def _devices(mesh_cfg: MeshConfig | None):
    import jax
    if mesh_cfg is None:
        return jax.devices()[:1]
    n = 1
    for s in mesh_cfg.ici_shape:
        n *= max(s, 1)
    return jax.devices()[:n]


def replace(cfg, **kw):
    return dataclasses.replace(cfg, **kw)


def reference_greedy(graphdef, params, prompt: list[int], n: int) -> tuple[list[int], list]:
    """Step-by-step full forward (no cache) argmax and its log_softmax.

    The sequence is right-padded to a fixed length (causal: padding never changes the logits
    at earlier positions), so the reference compiles once.
    """
    fwd = jax.jit(lambda p, ids: forward(graphdef, p, ids))
    seq, lps = list(prompt), []
    for _ in range(n):
        ids_1xL = np.zeros((1, 48), np.int32)
        ids_1xL[0, :len(seq)] = seq
        logp_V = jax.nn.log_softmax(fwd(params, ids_1xL)[0, len(seq) - 1].astype(jnp.float32))
        tok = int(jnp.argmax(logp_V))
        seq.append(tok)
        lps.append(float(logp_V[tok]))
    return seq[len(prompt):], lps

