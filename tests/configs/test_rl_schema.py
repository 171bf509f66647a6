"""The rl section (and rollout.max_turns): defaults validate; every check names field and rule."""

from __future__ import annotations

import typing

import pytest

from meshrl.algorithms import advantages, kl, policy_loss, rollout_correction
from meshrl.configs import Config, ConfigError, Job, base_config, from_config_dict
from meshrl.configs.schema import SECTIONS, RLConfig, RolloutConfig


def test_rl_section_is_registered_and_defaults_round_trip():
    config = from_config_dict(base_config("rl"))

    assert SECTIONS["rl"] is RLConfig
    assert config == Config(job=Job.RL)
    assert config.rl.policy_loss == "decoupled_ppo"


def test_rl_overrides_reach_the_typed_config():
    cfg = base_config("rl")
    cfg.rl.advantage = "rloo"
    cfg.rl.dual_clip_c = 3
    cfg.rollout.max_turns = 3
    cfg.agent.env = "tools"

    config = from_config_dict(cfg)

    assert (config.rl.advantage, config.rl.dual_clip_c, config.rollout.max_turns) == (
        "rloo", 3.0, 3)


def test_rollout_correction_choices_are_the_implemented_modes():
    choices = typing.get_args(typing.get_type_hints(RLConfig)["rollout_correction"])

    assert choices == rollout_correction.MODES == typing.get_args(rollout_correction.Mode)


def test_every_choice_names_a_registered_function():
    hints = typing.get_type_hints(RLConfig)
    for field, registry in (("advantage", advantages), ("policy_loss", policy_loss),
                            ("kl_estimator", kl)):
        choices = typing.get_args(hints[field])

        assert choices, field
        for choice in choices:
            registry.get(choice)  # raises KeyError on a choice without an implementation


@pytest.mark.parametrize("make, message", [
    (lambda: RLConfig(advantage="gae"), "rl.advantage = 'gae': must be one of"),
    (lambda: RLConfig(policy_loss="trpo"), "rl.policy_loss = 'trpo': must be one of"),
    (lambda: RLConfig(kl_estimator="k4"), "rl.kl_estimator = 'k4': must be one of"),
    (lambda: RLConfig(kl_where="advantage"), "rl.kl_where = 'advantage': must be one of"),
    (lambda: RLConfig(aggregation="sum"), "rl.aggregation = 'sum': must be one of"),
    (lambda: RLConfig(eps_low=-0.1), "rl.eps_low = -0.1: must be >= 0"),
    (lambda: RLConfig(eps_low=1.0), "rl.eps_low = 1.0: must be < 1"),
    (lambda: RLConfig(eps_high=-1), "rl.eps_high = -1.0: must be >= 0"),
    (lambda: RLConfig(kl_coef=-0.5), "rl.kl_coef = -0.5: must be >= 0"),
    (lambda: RLConfig(entropy_coef=-1e-3), "rl.entropy_coef = -0.001: must be >= 0"),
    (lambda: RLConfig(dual_clip_c=0.5), "rl.dual_clip_c = 0.5: must be 0 (off) or > 1"),
    (lambda: RLConfig(dual_clip_c=1.0), "rl.dual_clip_c = 1.0: must be 0 (off) or > 1"),
    (lambda: RLConfig(behav_weight_cap=0.5), "rl.behav_weight_cap = 0.5: must be 0 (off) or >= 1"),
    (lambda: RLConfig(adv_eps=-1.0), "rl.adv_eps = -1.0: must be >= 0"),
    (lambda: RLConfig(behav_cap_mode="clip"), "rl.behav_cap_mode = 'clip': must be one of"),
    (lambda: RLConfig(rollout_correction="tis"), "rl.rollout_correction = 'tis': must be one of"),
    (lambda: RLConfig(correction_cap=0.9), "rl.correction_cap = 0.9: must be >= 1"),
    (lambda: RLConfig(correction_low=-0.1), "rl.correction_low = -0.1: must be >= 0"),
    (lambda: RLConfig(correction_low=1.5, correction_high=2.0),
     "rl.correction_low = 1.5: must be <= 1"),
    (lambda: RLConfig(correction_high=0.5), "rl.correction_high = 0.5: must be >= 1"),
    (lambda: RLConfig(correction_low=1.0, correction_high=1.0),
     "rl.correction_low = 1.0: must be < rl.correction_high = 1.0"),
    (lambda: RLConfig(ppo_minibatches=0), "rl.ppo_minibatches = 0: must be >= 1"),
    (lambda: RLConfig(ppo_epochs=0), "rl.ppo_epochs = 0: must be >= 1"),
    (lambda: RLConfig(overlong_buffer=-1), "rl.overlong_buffer = -1: must be >= 0"),
    (lambda: RLConfig(overlong_buffer=8, overlong_max_len=8),
     "rl.overlong_max_len = 8: must be > rl.overlong_buffer = 8"),
    (lambda: RLConfig(overlong_penalty=-1.0), "rl.overlong_penalty = -1.0: must be >= 0"),
    (lambda: RLConfig(eps_low="0.2"), "rl.eps_low = '0.2': must be a number"),
    (lambda: RLConfig(warm_start_steps=-2), "rl.warm_start_steps = -2: must be >= -1"),
    (lambda: RLConfig(warm_start_lr=0.0), "rl.warm_start_lr = 0.0: must be > 0"),
    (lambda: RLConfig(warm_start_lr=-1e-3), "rl.warm_start_lr = -0.001: must be > 0"),
    (lambda: RLConfig(placement="remote"), "rl.placement = 'remote': must be one of"),
    (lambda: RLConfig(placement="split"),
     "rl.sampler_devices = 0: must be >= 1 when rl.placement = 'split'"),
    (lambda: RLConfig(sampler_devices=2),
     "rl.sampler_devices = 2: must be 0 when rl.placement = 'colocated'"),
    (lambda: RLConfig(placement="split", sampler_devices=-1),
     "rl.sampler_devices = -1: must be >= 0"),
    (lambda: RLConfig(placement="split", sampler_devices=2, release_sampler_weights=True),
     "rl.release_sampler_weights = true: only with rl.placement = 'colocated' (got 'split'"),
    (lambda: RLConfig(release_sampler_cache=False, release_sampler_weights=True),
     "rl.release_sampler_weights = true: needs rl.release_sampler_cache = true"),
    (lambda: RolloutConfig(max_turns=0), "rollout.max_turns = 0: must be >= 1"),
])
def test_rl_validation_names_field_value_and_rule(make, message):
    with pytest.raises(ConfigError) as e:
        make()

    assert message in str(e.value)


def test_unknown_rl_key_suggests_the_closest():
    cfg = base_config("rl").to_dict()
    cfg["rl"]["eps_hi"] = 0.3

    with pytest.raises(ConfigError, match="did you mean 'rl.eps_high'|did you mean 'eps_high'"):
        from_config_dict(cfg)


def test_overlong_penalty_with_a_valid_window_constructs():
    rl = RLConfig(overlong_buffer=4, overlong_max_len=16, overlong_penalty=0.5)

    assert (rl.overlong_buffer, rl.overlong_max_len) == (4, 16)


def test_warm_start_overrides_reach_the_typed_config():
    cfg = base_config("rl")
    cfg.rl.warm_start_steps = 7
    cfg.rl.warm_start_lr = 3e-4

    config = from_config_dict(cfg)

    assert (config.rl.warm_start_steps, config.rl.warm_start_lr) == (7, 3e-4)


def test_warm_start_defaults_keep_the_previous_behaviour():
    rl = RLConfig()

    # -1: as many SFT steps as trainer.steps, at the former constant peak rate 1e-3.
    assert (rl.warm_start_steps, rl.warm_start_lr) == (-1, 1e-3)


def test_several_turns_without_an_environment_are_refused():
    cfg = base_config("rl")
    cfg.rollout.max_turns = 3

    with pytest.raises(ConfigError, match=r"rollout.max_turns = 3: later turns need an "
                                          r"environment .*agent.env is empty"):
        from_config_dict(cfg)
