"""Test helper: the same weights in the unrolled and the ``scan_layers`` decoder layouts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.configs.schema import ModelConfig
from meshrl.models import create_model, split_model


def stacked_like(params: nnx.State, stacked: nnx.State) -> nnx.State:
    """``params`` (unrolled layers) in the layout of ``stacked`` (a scan_layers model's)."""
    flat = dict(nnx.to_flat_state(params))
    out = jax.tree.map(lambda x: x, stacked)
    for key, var in nnx.to_flat_state(out):
        if key[0] == "layers":
            n = var[...].shape[0]
            var.set_value(jnp.stack([flat[("layers", i, *key[1:])][...] for i in range(n)]))
        else:
            var.set_value(flat[key][...])
    return out


def unrolled_and_scanned(cfg: ModelConfig, seed: int = 0
                         ) -> tuple[tuple[nnx.GraphDef, nnx.State], tuple[nnx.GraphDef, nnx.State]]:
    """((graphdef, params) unrolled, (graphdef, params) scan_layers), the same weights."""
    graphdef, params = split_model(create_model(dataclasses.replace(cfg, scan_layers=False),
                                                seed=seed))
    s_graphdef, s_params = split_model(create_model(dataclasses.replace(cfg, scan_layers=True),
                                                    seed=seed))
    return (graphdef, params), (s_graphdef, stacked_like(params, s_params))
