"""The one weight source of the sample, export and evaluate jobs: random, ``model.hf_path``, a
run's checkpoint step or a published weight version, each resolved and loaded with its weight
version; a missing or wrong one is one error line naming the value and the rule."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import CheckpointConfig
from meshrl.inference.published import publish_weights
from meshrl.jobs import weights_source as ws
from meshrl.mesh import create_mesh
from meshrl.models import create_model, forward, split_model
from meshrl.tests.models.conftest import (
    TINY,
    byte_sft_config,
    hf_logits,
    random_hf_model,
    random_ids,
)
from meshrl.trainer.checkpoint import Checkpointer
from meshrl.utils.params import flat_params

WORDS = ws.Wording(source="job = 'test'", step="test.step", version="test.version",
                   instead="pick another source")
STEPS = {3: 11, 5: 13}  # checkpoint step -> the weight version saved with it


def _config(**model):
    return byte_sft_config(**model)


def _mesh(config):
    return create_mesh(config.mesh, jax.devices()[:1])


def _params(config, seed):
    return split_model(create_model(config.model, mesh=_mesh(config), seed=seed))[1]


def _assert_same(got, want):
    got, want = flat_params(got), flat_params(want)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]),
                                      err_msg=name)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A workdir with checkpoint steps 3 and 5 (params of seeds 3, 5) and weight version 4
    (params of seed 4), the config saved with the checkpoints."""
    workdir = tmp_path_factory.mktemp("run")
    config = _config()
    params = {seed: _params(config, seed) for seed in (3, 4, 5)}
    ckpt = Checkpointer(workdir / "checkpoints", CheckpointConfig(async_save=False))
    try:
        for step, version in STEPS.items():
            state = {"params": params[step], "weight_version": jnp.int32(version)}
            ckpt.save(step, state, {}, config.to_dict(), {})
        ckpt.wait()
    finally:
        ckpt.close()
    publish_weights(params[4], workdir, 4)
    return workdir, params


def test_random_source_is_a_random_init_of_model_at_version_zero(tmp_path):
    config = _config()
    src = ws.resolve(config, tmp_path, "random", WORDS)

    loaded, version = ws.load_source(config, tmp_path, src, _mesh(config), "sample")

    assert version == 0 and src.model == config.model
    _assert_same(loaded.params, _params(config, config.trainer.seed))


def test_hf_path_source_loads_the_checkpoints_weights(tmp_path):
    torch_model = random_hf_model("LlamaConfig", "LlamaForCausalLM", {**TINY, "vocab_size": 256})
    torch_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config = _config(hf_path=str(tmp_path / "hf"))
    src = ws.resolve(config, tmp_path, "hf_path", WORDS)

    loaded, version = ws.load_source(config, tmp_path, src, _mesh(config), "sample")

    ids_BxL = random_ids(2, 5, vocab=256)
    assert version == 0 and loaded.arch.hidden_size == TINY["hidden_size"]
    np.testing.assert_allclose(np.asarray(forward(loaded.graphdef, loaded.params, ids_BxL)),
                               hf_logits(torch_model, ids_BxL), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("step, want_step", [(3, 3), (ws.NEWEST, 5)])
def test_checkpoint_source_loads_that_steps_params_and_weight_version(run, step, want_step):
    workdir, params = run
    config = _config(num_layers=1)  # ignored: the run's saved config defines the model
    src = ws.resolve(config, workdir, "checkpoint", WORDS, step=step)

    loaded, version = ws.load_source(config, workdir, src, _mesh(config), "train")

    assert (src.step, version, src.model.num_layers) == (want_step, STEPS[want_step], 2)
    _assert_same(loaded.params, params[want_step])


def test_version_source_loads_the_published_params_with_the_runs_model(run):
    workdir, params = run
    config = _config(num_layers=1)
    src = ws.resolve(config, workdir, "version", WORDS, version=4)

    loaded, version = ws.load_source(config, workdir, src, _mesh(config), "sample")

    assert (version, src.step, src.model.num_layers) == (4, 5, 2)
    _assert_same(loaded.params, params[4])


@pytest.mark.parametrize("kind, kwargs, match", [
    ("checkpoint", {"step": 4}, r"^test.step = 4: no verified checkpoint of that step under "
                                r".*checkpoints \(verified: \[3, 5\]\): pick one of them"),
    ("version", {"version": 9}, r"^test.version = 9: not published under .*weights "
                                r"\(published: \[4\]\): pick one of them, or pick another"),
])
def test_a_step_or_version_the_run_lacks_is_one_line_listing_what_it_has(run, kind, kwargs,
                                                                        match):
    workdir, _ = run

    with pytest.raises(ConfigError, match=match) as e:
        ws.resolve(_config(), workdir, kind, WORDS, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind, match", [
    ("checkpoint", r"^job = 'test': no verified checkpoint under .*checkpoints: pass the run's "
                   r"workdir as --workdir, or pick another source$"),
    ("version", r"^job = 'test': no published weights under .*weights: pass the run's workdir "
                r"as --workdir, or pick another source$"),
    ("hf_path", r"^model.hf_path = '.*empty': no config.json there \(job = 'test'\): point it "
                r"at a local Hugging Face checkpoint directory$"),
])
def test_a_source_that_does_not_exist_is_one_line_naming_it(tmp_path, kind, match):
    (tmp_path / "empty").mkdir()
    config = _config(hf_path=str(tmp_path / "empty")) if kind == "hf_path" else _config()

    with pytest.raises(ConfigError, match=match):
        ws.resolve(config, tmp_path, kind, WORDS)
    assert not (tmp_path / "checkpoints").exists()  # resolving never creates a run


def test_published_weights_of_another_model_are_one_line_naming_the_version(tmp_path):
    other = _config(hidden_size=64, intermediate_size=128)
    publish_weights(_params(other, 0), tmp_path, 2)  # a workdir without checkpoints
    src = ws.resolve(_config(), tmp_path, "version", WORDS)

    with pytest.raises(ConfigError, match=r"weights/2: weight version 2 does not fit model.\* "
                                          r"of this config \(param .*shape.*\): pass the config "
                                          r"the run was trained with"):
        ws.load_source(_config(), tmp_path, src, _mesh(_config()), "sample")
