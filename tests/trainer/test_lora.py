"""LoRA through the train engine: only adapters train, the base stays frozen, resume is
bitwise, and a regex that matches nothing is one config error."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.mesh import rules_for
from meshrl.models import create_model, param_shardings, split_model
from meshrl.models.lora import LoraSetup
from meshrl.tests.trainer.tiny import RandomIterator, mesh_for, tiny_config
from meshrl.trainer.engine import Trainee, TrainEngine, expand_prefix
from meshrl.trainer.sft_loop import run_sft
from meshrl.trainer.spec import sft_spec
from meshrl.trainer.step import decoder_forward
from meshrl.utils.params import flat_params

LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "attn/(q|v)|mlp/up"}


def lora_trainee(config, mesh):
    """The tiny decoder's trainee with ``config.lora``'s adapters (what ``Trainee.of`` builds
    for a loaded model)."""
    rules = rules_for("train", config.mesh.fsdp)
    model = create_model(config.model, mesh=mesh, rules=rules, seed=config.trainer.seed)
    graphdef, params = split_model(model)
    shardings = param_shardings(params, mesh, rules)
    setup = LoraSetup(config.lora, graphdef, params, expand_prefix(shardings, params))
    return Trainee(forward=decoder_forward(graphdef, 0), params=params,
                   params_shardings=shardings, flops_per_token=1.0, lora=setup)


def _engine(config, workdir):
    mesh = mesh_for(config)
    trainee = lora_trainee(config, mesh)
    base = flat_params(trainee.params)
    engine = TrainEngine(config, workdir, mesh, trainee, sft_spec(config, mesh))
    engine.start(data=RandomIterator(config.trainer.batch_size, config.trainer.seq_len))
    return engine, base


def test_lora_trains_only_adapters_and_keeps_the_base(tmp_path):
    config = tiny_config(**LORA, **{"checkpoint.every_steps": 0, "checkpoint.async_save": False})
    engine, base = _engine(config, tmp_path)
    state0 = engine.state
    assert set(flat_params(state0.params)) == {
        f"layers/{i}/{p}/kernel/{m}" for i in (0, 1) for p in ("attn/q", "attn/v", "mlp/up")
        for m in "ab"}
    history = run_sft(engine)
    engine.close()
    assert history[-1]["loss"] < history[0]["loss"]
    merged = flat_params(engine.params)
    # Untargeted weights are the base, bitwise; targeted ones moved by the adapters.
    np.testing.assert_array_equal(merged["layers/0/attn/k/kernel"], base["layers/0/attn/k/kernel"])
    np.testing.assert_array_equal(merged["embed"], base["embed"])
    assert not np.allclose(merged["layers/0/attn/q/kernel"], base["layers/0/attn/q/kernel"])
    # Optimizer moments exist for adapters only.
    n_opt = sum(x.size for x in jax.tree.leaves(engine.state.opt_state))
    n_ad = sum(x.size for x in jax.tree.leaves(engine.state.params))
    assert n_opt <= 2 * n_ad + 8


def test_qlora_nf4_base_trains(tmp_path):
    config = tiny_config(**LORA, **{"lora.base_dtype": "nf4", "checkpoint.every_steps": 0,
                                    "checkpoint.async_save": False})
    engine, _ = _engine(config, tmp_path)
    history = run_sft(engine)
    engine.close()
    assert history[-1]["loss"] < history[0]["loss"]
    assert any(x.dtype == np.uint8 for x in engine._frozen)  # nf4 codes, two a byte


RESUMABLE = {**LORA, "trainer.steps": 4, "checkpoint.every_steps": 2,
             "checkpoint.async_save": False}


def _run_straight_and_resumed(over: dict, tmp_path) -> tuple:
    """The engine of a straight run of ``over`` and of one stopped at step 2 and resumed."""
    straight, _ = _engine(tiny_config(**over), tmp_path / "a")
    run_sft(straight)
    straight.close()
    first, _ = _engine(tiny_config(**{**over, "trainer.steps": 2}), tmp_path / "b")
    run_sft(first)
    first.close()
    resumed, _ = _engine(tiny_config(**over), tmp_path / "b")
    assert resumed.start_step == 2
    run_sft(resumed)
    resumed.close()
    return straight, resumed


def _assert_same_state(a_state, b_state) -> None:
    for a, b in zip(jax.tree.leaves(a_state), jax.tree.leaves(b_state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the dropout test resumes bitwise too
def test_lora_resume_is_bitwise(tmp_path):
    straight, resumed = _run_straight_and_resumed(RESUMABLE, tmp_path)
    _assert_same_state(straight.state, resumed.state)


def test_a_regex_matching_no_projection_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"lora.targets = 'nothing_here': matches no"):
        _engine(tiny_config(**{**LORA, "lora.targets": "nothing_here"}), tmp_path)


def test_a_bad_regex_is_one_config_error():
    with pytest.raises(ConfigError, match=r"lora.targets = '\(': not a valid regex"):
        tiny_config(**{**LORA, "lora.targets": "("})


@pytest.mark.slow  # two LoRA runs and a resume
def test_lora_dropout_changes_training_and_resumes_bitwise(tmp_path):
    plain, _ = _engine(tiny_config(**RESUMABLE), tmp_path / "plain")
    run_sft(plain)
    plain.close()
    straight, resumed = _run_straight_and_resumed({**RESUMABLE, "lora.dropout": 0.3}, tmp_path)
    _assert_same_state(straight.state, resumed.state)
    moved = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(plain.state.params), jax.tree.leaves(straight.state.params),
                 strict=True)]
    assert any(moved)  # the masks reached the adapters' updates


def test_the_merge_compiles_once_however_often_the_params_are_read(tmp_path):
    # The engine merges at every publish, evaluation and checksum.
    config = tiny_config(**LORA)
    trainee = lora_trainee(config, mesh_for(config))
    setup = trainee.lora
    frozen, adapters = setup.freeze(trainee.params), setup.adapters()

    for _ in range(3):
        setup.merged(frozen, adapters)
        setup.merged(frozen, None)

    assert setup._merge_jit._cache_size() == 2  # with adapters, and the base alone
