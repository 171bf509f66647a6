"""Rules across config sections: loading the config rejects them, naming the field, so a dry run
rejects exactly what a run rejects; the device-count rules stay at run time and in the dry run."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from meshrl.configs import ConfigError, base_config, from_config_dict
from meshrl.configs.schema import Config, Job, MeshConfig
from meshrl.jobs import dispatch
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (job, overrides "section.field" -> value, the text the error starts with)
CROSS_SECTION_ERRORS = [
    ("sft", {"mesh.expert_tensor": 2}, "mesh.expert_tensor = 2: must be 1"),
    ("sft", {"mesh.expert_tensor": -1, "mesh.data": 8}, "mesh.expert_tensor = -1: must be 1"),
    ("rl", {"mesh.dcn_expert_tensor": 2}, "mesh.dcn_expert_tensor = 2: must be 1"),
    ("sft", {"mesh.context": 4, "mesh.data": 2, "trainer.seq_len": 36},
     "trainer.seq_len = 36: must be divisible by 2 x mesh.context = 8"),
    ("sft", {"mesh.context": 4, "mesh.data": 2, "trainer.seq_len": 34,
             "model.context_balance": False},
     "trainer.seq_len = 34: must be divisible by mesh.context = 4"),
    ("sft", {"model.arch": "qwen3_moe", "model.num_experts": 6, "mesh.expert": 4,
             "mesh.data": 2}, "mesh.expert = 4: must divide model.num_experts = 6"),
    ("sft", {"model.arch": "mixtral", "model.num_experts": 8, "model.intermediate_size": 6,
             "mesh.expert_tensor": 4, "mesh.data": 2},
     "mesh.expert_tensor = 4: must divide the expert FFN width model.moe_intermediate_size = 6"),
    ("sft", {"trainer.batch_size": 6, "trainer.microbatches": 4},
     "trainer.microbatches = 4: must divide trainer.batch_size = 6"),
    ("rl", {"rl.warm_start_batch_size": 6, "trainer.microbatches": 4},
     "trainer.microbatches = 4: must divide rl.warm_start_batch_size = 6"),
    ("rl", {"rl.warm_start_batch_size": 24, "trainer.microbatches": 3},
     "trainer.microbatches = 3: must divide rollout.prompts_per_step * rollout.group_size = 32"),
    ("rl", {"rl.ppo_minibatches": 3},
     "rl.ppo_minibatches = 3: rl.ppo_minibatches * trainer.microbatches = 3 must divide "
     "rollout.prompts_per_step * rollout.group_size = 32"),
    ("rl", {"rl.ppo_minibatches": 8, "trainer.microbatches": 8},
     "rl.ppo_minibatches = 8: rl.ppo_minibatches * trainer.microbatches = 64 must divide"),
    ("rl", {"rollout.group_size": 1, "trainer.microbatches": 1},
     "rollout.group_size = 1: every advantage is 0 under rl.advantage = 'grpo'"),
    ("rl", {"rollout.group_size": 1, "trainer.microbatches": 1, "rl.advantage": "rloo"},
     "rollout.group_size = 1: every advantage is 0 under rl.advantage = 'rloo'"),
    ("rl", {"sampler.temperature": 0.0},
     "sampler.temperature = 0.0: the RL job needs a temperature > 0"),
    ("rl", {"sampler.top_p": 0.9, "sampler.min_p": 0.1, "agent.env": "tools"},
     "sampler.top_p = 0.9, sampler.min_p = 0.1: agent episodes (agent.env = 'tools') do not "
     "record the sampler's kept token counts"),
    ("rl", {"rl.routing_replay": "rollout"},
     "rl.routing_replay = 'rollout': the model is dense (model.num_experts = 0)"),
    ("rl", {"rl.routing_replay": "rollout", "model.arch": "qwen3_moe", "model.num_experts": 4,
            "agent.env": "tools"},
     "rl.routing_replay = 'rollout': agent episodes (agent.env = 'tools') do not record"),
    ("rl", {"rl.routing_replay": "rollout", "model.arch": "qwen3_moe", "model.num_experts": 4,
            "sampler.kv_cache": "paged"},
     "rl.routing_replay = 'rollout': the paged KV cache's prefix programs do not record"),
    ("rl", {"rl.sampler_expert": 4},
     "rl.sampler_expert = 4: the model is dense (model.num_experts = 0), so there are no "
     "expert weights to shard: set 0"),
    ("rl", {"rl.sampler_expert": 4, "model.arch": "qwen3_moe", "model.num_experts": 6},
     "rl.sampler_expert = 4: must divide model.num_experts = 6"),
    ("rl", {"model.hf_path": "/ckpt/qwen", "rl.warm_start_steps": 5},
     "rl.warm_start_steps = 5: must be -1 or 0 with model.hf_path"),
    ("rl", {"data.max_prompt_len": 200},
     "sampler.prompt_buckets = (32, 64, 128): the largest must be >= data.max_prompt_len = 200"),
    ("generate", {"generate.source": "hf_path"}, "generate.source = 'hf_path': model.hf_path is empty"),
    ("generate", {"generate.source": "random", "model.hf_path": "/ckpt"},
     "generate.source = 'random': model.hf_path = '/ckpt' would be ignored"),
]


def _cfg(job: str, overrides: dict):
    cfg = base_config(job)
    cfg.generate.source = "random"  # the generate job's default source needs model.hf_path
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return cfg


def _ids(case) -> str:
    return f"{case[0]}:" + ",".join(case[1])


@pytest.mark.parametrize("job, overrides, message", CROSS_SECTION_ERRORS,
                         ids=[_ids(c) for c in CROSS_SECTION_ERRORS])
def test_cross_section_error_is_raised_at_load_naming_the_field(job, overrides, message):
    with pytest.raises(ConfigError) as info:
        from_config_dict(_cfg(job, overrides))

    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("job, overrides, message", CROSS_SECTION_ERRORS,
                         ids=[_ids(c) for c in CROSS_SECTION_ERRORS])
def test_cross_section_error_is_rejected_by_the_dry_run_path(job, overrides, message):
    # main.py --dry_run is from_config_dict, then dispatch.dry_run: the first rejects it.
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        dispatch.dry_run(from_config_dict(_cfg(job, overrides)))


@pytest.mark.parametrize("job, overrides, message", CROSS_SECTION_ERRORS,
                         ids=[_ids(c) for c in CROSS_SECTION_ERRORS])
def test_cross_section_error_is_raised_by_replace_too(job, overrides, message):
    valid = from_config_dict(_cfg(job, {}))
    sections = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        dataclasses.replace(valid, **{s: dataclasses.replace(getattr(valid, s), **v)
                                      for s, v in sections.items()})


COMPILED_JOB_ERRORS = [c for c in CROSS_SECTION_ERRORS if c[0] in ("sft", "rl")]


@pytest.mark.parametrize("job, overrides, message", COMPILED_JOB_ERRORS,
                         ids=[_ids(c) for c in COMPILED_JOB_ERRORS])
def test_compile_job_refuses_what_the_compiled_job_refuses(job, overrides, message):
    cfg = _cfg(job, overrides)
    cfg.job = "compile"  # compile.job stays the file's own job

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        from_config_dict(cfg)


def test_compile_job_accepts_an_rl_config_that_the_sft_batch_rule_would_refuse():
    # The RL job trains on its own batch (32 rows here) and has no warm start: trainer.batch_size
    # is not its batch.
    overrides = {"trainer.batch_size": 6, "trainer.microbatches": 4, "rl.warm_start_steps": 0}
    cfg = _cfg("rl", overrides)
    cfg.job = "compile"

    config = from_config_dict(cfg)

    assert config.compile.job == "rl" and config.trainer.microbatches == 4
    from_config_dict(_cfg("rl", overrides))  # the RL job itself accepts it too


def test_rules_of_one_job_do_not_apply_to_another():
    greedy = _cfg("sft", {"sampler.temperature": 0.0, "sampler.top_k": 5})

    assert from_config_dict(greedy).sampler.top_k == 5
    assert Config(job=Job.SFT, mesh=MeshConfig(expert=2)).mesh.expert == 2  # extra batch


def test_a_group_of_one_is_accepted_with_a_batch_normalised_advantage():
    config = from_config_dict(_cfg("rl", {"rollout.group_size": 1, "trainer.microbatches": 1,
                                          "rl.advantage": "reinforce_pp"}))

    assert config.rollout.group_size == 1


def test_rl_config_with_a_sampling_temperature_other_than_one_is_accepted():
    config = from_config_dict(_cfg("rl", {"sampler.temperature": 0.7}))

    assert config.sampler.temperature == 0.7


@pytest.mark.parametrize("overrides, message", [
    ({"rl.placement": "split", "rl.sampler_devices": 8},
     "rl.sampler_devices = 8: must be in [1, 7]"),
    ({"rl.placement": "split", "rl.sampler_devices": 2, "mesh.data": 4},
     "rl.sampler_devices = 2 leaves 6 of the 8 devices to the trainer"),
    ({"rl.sampler_expert": 16, "model.arch": "qwen3_moe", "model.num_experts": 16},
     "rl.sampler_expert = 16: with mesh.tensor = 1 and mesh.expert_tensor = 1 the sampler "
     "needs a multiple of 16 devices, and has 8"),
])
def test_device_count_rule_loads_but_the_dry_run_rejects_it(overrides, message):
    config = from_config_dict(_cfg("rl", overrides))  # needs the device count: not at load

    with pytest.raises(ConfigError, match=re.escape(message)):
        dispatch.dry_run(config)


def test_main_dry_run_exits_one_naming_the_cross_section_field():
    env = cpu_env(8)
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "default.py"), "--dry_run",
                          "--config.sampler.temperature=0"],
                         capture_output=True, text=True, env=env, timeout=300)

    assert out.returncode == 1, out.stderr
    assert "error: sampler.temperature = 0.0: the RL job needs a temperature > 0" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("overrides", [{"sampler.top_k": 5}, {"sampler.top_p": 0.9},
                                       {"sampler.min_p": 0.05}])
def test_rl_config_with_truncated_sampling_loads(overrides):
    (key, value), = overrides.items()

    config = from_config_dict(_cfg("rl", overrides))

    assert getattr(config.sampler, key.split(".")[1]) == value


def test_routing_replay_on_a_dense_checkpoint_is_rejected_when_the_model_is_known():
    # With model.hf_path the RL job checks the loaded model's expert count (jobs/rl.py).
    from meshrl.configs.cross_section import check_routing_replay

    with pytest.raises(ConfigError, match="^rl.routing_replay = 'rollout': the model is dense"):
        check_routing_replay("rollout", 0)
    check_routing_replay("rollout", 4)
    check_routing_replay("off", 0)
