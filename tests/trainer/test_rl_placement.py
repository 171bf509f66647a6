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
from meshrl.configs.loader import base_config, from_config_dict
from meshrl.configs.schema import Config
from meshrl.inference.weights import flat_params
from meshrl.trainer.placement import create_meshes


def _config(**overrides: Any) -> Config:
    """A tiny RL job: 2 steps, 3 groups of 2 samples, 4 new tokens, no warm start."""
    cfg = base_config("rl")
    cfg.model.vocab_size = 256  # the char tokenizer's byte vocabulary
    cfg.model.hidden_size = 32
    cfg.model.intermediate_size = 64
    cfg.model.num_layers = 1
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 2
    cfg.data.max_prompt_len = 16
    cfg.data.num_examples = 50
    cfg.data.eval_examples = 2
    cfg.trainer.steps = 2
    cfg.trainer.seq_len = 32
    cfg.trainer.learning_rate = 1e-3
    cfg.trainer.log_every = 1
    cfg.trainer.peak_flops = 1e11
    cfg.sampler.max_len = 32
    cfg.sampler.max_new_tokens = 4
    cfg.sampler.prompt_buckets = (16,)
    cfg.sampler.slots = 8
    cfg.sampler.decode_chunk = 4
    cfg.rollout.group_size = 2
    cfg.rollout.prompts_per_step = 3
    cfg.rollout.max_staleness = 1
    cfg.rollout.filter_equal_groups = False  # an untrained policy: keep every group
    cfg.reward.num_workers = 1
    cfg.rl.warm_start_steps = 0
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.async_save = False
    cfg.logging.tensorboard = False
    cfg.logging.progress_bar = False
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return from_config_dict(cfg)


def _split(**overrides: Any) -> Config:
    return _config(**{"rl.placement": "split", **overrides})


def _devices(tree: Any) -> set[jax.Device]:
    return {d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def test_colocated_trainer_and_sampler_meshes_span_every_device_with_the_config_shape():
    trainer_mesh, sampler_mesh = create_meshes(_config(**{"mesh.data": 4, "mesh.tensor": 2}))

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


@pytest.mark.distributed
def test_split_rl_run_keeps_trainer_and_sampler_on_their_devices_and_publishes_weights(
        tmp_path):
    from meshrl.trainer.rl_loop import RLTrainer

    config = _split(**{"rl.sampler_devices": 2, "mesh.data": 3, "mesh.tensor": 2})
    trainer_devices, sampler_devices = set(jax.devices()[:6]), set(jax.devices()[6:])

    trainer = RLTrainer(config, tmp_path)
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
