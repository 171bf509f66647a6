"""The sampler's buckets, planned from its config and mesh without building a sampler."""

from __future__ import annotations

import jax

from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.shapes import plan_shapes
from meshrl.mesh import create_mesh, rules_for
from meshrl.tests.inference.tiny import TINY


def _plan(**kw):
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    cfg = SamplerConfig(**{"max_len": 64, "prompt_buckets": (), **kw})
    return plan_shapes(TINY, cfg, mesh, rules_for("sample"))


def test_32_slots_decode_on_eighths_quarters_halves_or_all_and_a_chunk_may_split():
    shapes = _plan(slots=32)
    assert shapes.row_buckets == (4, 8, 16, 32)
    assert shapes.split
    assert shapes.pass_tokens == 63  # a prefill pass holds one longest prompt bucket
    assert shapes.prompt_buckets == (16, 24, 32, 48, 63)  # up to max_len - 1
    assert shapes.window_buckets == (32, 48, 64)


def test_without_window_splits_a_chunk_is_one_call_on_the_same_row_buckets():
    shapes = _plan(slots=32, decode_split_windows=False)
    assert not shapes.split
    assert shapes.row_buckets == (4, 8, 16, 32)


def test_configured_buckets_win_and_the_slot_count_is_always_a_row_bucket():
    shapes = _plan(slots=8, prompt_buckets=(8, 16), decode_row_buckets=(2,))
    assert shapes.prompt_buckets == (8, 16)
    assert shapes.row_buckets == (2, 8)
