"""Weight handoff: trainer mesh -> sampler mesh (in process and via Orbax), validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.published import publish_weights
from meshrl.inference.sampler import Request, Sampler
from meshrl.inference.weights import WeightMismatchError
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler
from meshrl.utils.params import flat_params

TRAIN_MESH = MeshConfig(data=2, tensor=4, fsdp=True)
SAMPLE_MESH = MeshConfig(data=2, tensor=4)


def _trainer_params(seed: int = 0):
    mesh = create_mesh(TRAIN_MESH)
    return split_model(create_model(TINY, mesh=mesh, rules=rules_for("train", True), seed=seed))[1]


def _sampler(dtype: str = "bfloat16", workdir=None) -> Sampler:
    # Sampler mesh built over the devices in reverse: a genuinely different device layout.
    mesh = create_mesh(SAMPLE_MESH, jax.devices()[::-1])
    cfg = SamplerConfig(max_len=32, slots=4, decode_chunk=4, prompt_buckets=(8,), dtype=dtype)
    return Sampler(TINY, cfg, mesh, workdir=str(workdir) if workdir else None)


@pytest.mark.distributed
def test_handoff_from_fsdp_trainer_mesh_equals_trainer_params_cast(tmp_path):
    trainer = _trainer_params()
    sampler = _sampler("bfloat16", tmp_path)

    sampler.update_weights(trainer, version=3)

    ours, theirs = flat_params(sampler.params), flat_params(trainer)
    assert sampler.version == 3
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == jnp.bfloat16, name
        assert got.sharding.mesh.devices.flat[0] == jax.devices()[-1]
        assert "data" not in jax.tree.leaves(tuple(got.sharding.spec)), (name, got.sharding)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.distributed
def test_orbax_published_weights_restore_bitwise_equal_to_handoff(tmp_path):
    trainer = _trainer_params()
    in_process = _sampler("bfloat16", tmp_path)
    in_process.update_weights(trainer, version=1)
    restored = _sampler("bfloat16", tmp_path)

    publish_weights(trainer, tmp_path, 1)
    restored.load_weights(1)

    assert (tmp_path / "weights" / "1").is_dir()
    a, b = flat_params(in_process.params), flat_params(restored.params)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].sharding == b[name].sharding, name
        np.testing.assert_array_equal(np.asarray(a[name].view(jnp.uint16)),
                                      np.asarray(b[name].view(jnp.uint16)), err_msg=name)
    assert restored.version == 1


@pytest.mark.distributed
def test_handoff_never_aliases_source_buffers_even_with_identical_sharding():
    mesh = create_mesh(SAMPLE_MESH)
    src = split_model(create_model(TINY, mesh=mesh, rules=rules_for("sample")))[1]
    cfg = SamplerConfig(max_len=32, slots=4, decode_chunk=4, prompt_buckets=(8,))
    sampler = Sampler(TINY, cfg, mesh, src)

    ours, theirs = flat_params(sampler.params), flat_params(src)
    for name in theirs:
        assert ours[name].sharding == theirs[name].sharding
        src_ptrs = {s.data.unsafe_buffer_pointer() for s in theirs[name].addressable_shards}
        dst_ptrs = {s.data.unsafe_buffer_pointer() for s in ours[name].addressable_shards}
        assert not src_ptrs & dst_ptrs, name


def test_mismatched_shape_is_rejected_naming_the_param(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    other = split_model(create_model(dataclasses.replace(TINY, intermediate_size=48)))[1]

    with pytest.raises(WeightMismatchError, match=r"layers/0/mlp/(down|gate|up)/kernel"):
        sampler.update_weights(other, version=1)
    assert sampler.version == 0


def test_mismatched_tree_and_dtype_kind_are_rejected(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    flat = flat_params(params)
    missing = {k: v for k, v in flat.items() if k != "final_norm/scale"}
    ints = dict(flat, embed=flat["embed"].astype(jnp.int32))

    with pytest.raises(WeightMismatchError, match="final_norm/scale"):
        sampler.update_weights(missing, version=1)
    with pytest.raises(WeightMismatchError, match="param embed: dtype int32"):
        sampler.update_weights(ints, version=1)


@pytest.mark.distributed
def test_sharded_sampler_greedy_equals_single_device_sampler(tiny_params):
    _, params = tiny_params
    prompts = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7], [88, 12, 19]]
    single = make_sampler(params)
    sharded = make_sampler(params, mesh_cfg=SAMPLE_MESH)

    a = single.generate([Request(p, max_new_tokens=6) for p in prompts])
    b = sharded.generate([Request(p, max_new_tokens=6) for p in prompts])

    assert [c.tokens for c in a] == [c.tokens for c in b]
    np.testing.assert_allclose([c.raw_logprobs for c in a], [c.raw_logprobs for c in b],
                               rtol=1e-4, atol=1e-5)
