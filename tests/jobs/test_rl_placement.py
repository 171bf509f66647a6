"""rl.placement on the suite's 8 fake CPU devices: colocated meshes share every device, split
mode divides them into a trainer mesh and a sampler mesh, a short split RL run keeps each side
on its own devices and hands the sampler the trainer's weights, and bad splits are rejected."""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.mesh.placement import create_meshes
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.utils.params import flat_params


def _split(**overrides: Any) -> Config:
    return tiny_rl_config(**{"rl.placement": "split", **overrides})


def _devices(tree: Any) -> set[jax.Device]:
    return {d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def test_colocated_trainer_and_sampler_meshes_span_every_device_with_the_config_shape():
    config = tiny_rl_config(**{"mesh.data": 4, "mesh.tensor": 2})
    trainer_mesh, sampler_mesh = create_meshes(config)

    for mesh in (trainer_mesh, sampler_mesh):
        assert set(mesh.devices.flat) == set(jax.devices())
        assert (mesh.shape["data"], mesh.shape["tensor"]) == (4, 2)


@pytest.mark.distributed
def test_split_gives_the_sampler_the_last_devices_and_keeps_the_trainers_tensor_size():
    config = _split(**{"rl.sampler_devices": 2, "mesh.data": 3, "mesh.tensor": 2})

    trainer_mesh, sampler_mesh = create_meshes(config)

    assert set(trainer_mesh.devices.flat) == set(jax.devices()[:6])
    assert set(sampler_mesh.devices.flat) == set(jax.devices()[6:])
    assert (trainer_mesh.shape["data"], trainer_mesh.shape["tensor"]) == (3, 2)
    assert (sampler_mesh.shape["data"], sampler_mesh.shape["tensor"]) == (1, 2)


@pytest.mark.distributed
def test_split_with_a_data_fill_gives_the_trainer_every_remaining_device():
    trainer_mesh, sampler_mesh = create_meshes(_split(**{"rl.sampler_devices": 3}))

    assert trainer_mesh.shape["data"] == 5 and trainer_mesh.devices.size == 5
    assert sampler_mesh.shape["data"] == 3 and sampler_mesh.devices.size == 3


@pytest.mark.parametrize("overrides, messages", [
    ({"rl.sampler_devices": 8}, ["rl.sampler_devices = 8: must be in [1, 7]", "on 8 devices"]),
    ({"rl.sampler_devices": 2, "mesh.data": 2, "mesh.tensor": 4},
     ["data=2 tensor=4", "multiplies to 8 devices, but 6 devices are available",
      "rl.sampler_devices = 2 leaves 6 of the 8 devices to the trainer"]),
    ({"rl.sampler_devices": 2, "mesh.data": 2, "mesh.tensor": 3},
     ["rl.sampler_devices = 2: the sampler keeps the trainer's tensor=3"]),
])
def test_split_that_does_not_fit_the_devices_is_a_config_error_naming_the_values(
        overrides, messages):
    with pytest.raises(ConfigError) as e:
        create_meshes(_split(**overrides))

    for message in messages:
        assert message in str(e.value)


@pytest.mark.slow  # a full split-placement RL run
@pytest.mark.distributed
def test_split_rl_run_keeps_trainer_and_sampler_on_their_devices_and_publishes_weights(
        tmp_path):
    from meshrl.jobs import rl as rl_job

    config = _split(**{"rl.sampler_devices": 2, "mesh.data": 3, "mesh.tensor": 2})
    trainer_devices, sampler_devices = set(jax.devices()[:6]), set(jax.devices()[6:])

    trainer = rl_job.build(config, tmp_path)
    try:
        summary = asyncio.run(trainer.arun())
    finally:
        trainer.close()

    assert (summary["steps"], summary["start_step"]) == (2, 0)
    assert (summary["devices"], summary["sampler_devices"]) == (6, 2)
    assert len(trainer.history) == 2
    assert _devices(trainer.state) == trainer_devices
    assert _devices(trainer.sampler.params) == sampler_devices
    assert _devices(trainer.sampler.cache) == sampler_devices
    # The last publish (version 2) is the trainer's final params, cast to the sampler dtype.
    assert trainer.sampler.version == 2
    ours, theirs = flat_params(trainer.sampler.params), flat_params(trainer.state.params)
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        got = ours[name]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(got.dtype)),
                                      err_msg=name)
    assert (tmp_path / "weights" / "2").is_dir()  # the Orbax publication at the last step


def test_process_sampler_mesh_keeps_model_sizes_and_fills_data_with_this_processs_devices():
    from meshrl.configs.schema import MeshConfig
    from meshrl.mesh import create_mesh
    from meshrl.mesh.placement import process_sampler_mesh

    trainer = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2, fsdp=True))

    mesh = process_sampler_mesh(trainer)

    assert set(mesh.devices.flat) == set(jax.local_devices())
    assert (mesh.shape["data"], mesh.shape["tensor"]) == (4, 2)
    assert "dcn_data" not in mesh.shape  # a sampler never spans DCN


def test_process_sampler_mesh_whose_tensor_size_does_not_divide_the_local_devices_is_an_error():
    from meshrl.configs.schema import MeshConfig
    from meshrl.mesh import create_mesh
    from meshrl.mesh.placement import process_sampler_mesh

    trainer = create_mesh(MeshConfig(data=1, tensor=3), jax.devices()[:3])

    with pytest.raises(ConfigError, match=r"mesh.tensor = 3, .*must divide 8"):
        process_sampler_mesh(trainer)
