"""The typed schema: defaults validate, every validation path names field, value and rule."""

from __future__ import annotations

import dataclasses

import pytest

from meshrl.configs import (
    CompileConfig,
    Config,
    ConfigError,
    DataConfig,
    DistributedConfig,
    Job,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    SamplerConfig,
    TrainerConfig,
    base_config,
    from_config_dict,
)
from meshrl.configs.schema import SECTIONS


def test_base_config_round_trips_to_defaults():
    # Every field at its default, except compile.job: the job whose programs job = compile
    # compiles is the config file's own.
    config = from_config_dict(base_config("sft"))
    assert config == Config(job=Job.SFT, compile=CompileConfig(job="sft"))
    assert from_config_dict(base_config("rl")).compile.job == "rl"


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_has_doc(section):
    for f in dataclasses.fields(SECTIONS[section]):
        assert f.metadata.get("doc"), f"{section}.{f.name} has no doc"


@pytest.mark.parametrize("make, message", [
    (lambda: MeshConfig(tensor=0), "mesh.tensor = 0: must be >= 1, or -1"),
    (lambda: MeshConfig(data=-1, tensor=-1), "at most one -1 fill per ICI list"),
    (lambda: MeshConfig(dcn_data=-1, dcn_expert=-1), "at most one -1 fill per DCN list"),
    (lambda: MeshConfig(data=2.5), "mesh.data = 2.5: must be an int"),
    (lambda: MeshConfig(fsdp=1), "mesh.fsdp = 1: must be a bool"),
    (lambda: ModelConfig(arch="gpt2"), "model.arch = 'gpt2': must be one of"),
    (lambda: ModelConfig(num_heads=4, num_kv_heads=3), "model.num_kv_heads = 3: must divide"),
    (lambda: ModelConfig(hidden_size=30, num_heads=4), "model.hidden_size = 30: must be divisible"),
    (lambda: ModelConfig(vocab_size=0), "model.vocab_size = 0: must be >= 1"),
    (lambda: ModelConfig(arch="qwen3_moe"), "model.num_experts = 0 with model.arch = "
                                            "'qwen3_moe': qwen3_moe and mixtral need"),
    (lambda: ModelConfig(num_experts=4), "model.num_experts = 4 with model.arch = 'llama'"),
    (lambda: ModelConfig(arch="mixtral", num_experts=2, num_experts_per_tok=3),
     "model.num_experts_per_tok = 3: must be <= model.num_experts = 2"),
    (lambda: ModelConfig(arch="qwen3_moe", num_experts=4, mlp_only_layers=(2,)),
     "model.mlp_only_layers = (2,): [2] outside [0, model.num_layers = 2)"),
    (lambda: ModelConfig(arch="mixtral", num_experts=4, decoder_sparse_step=2),
     "model.arch = 'mixtral': every layer is sparse"),
    (lambda: ModelConfig(arch="qwen3_moe", num_experts=4, mlp_only_layers=(1,),
                         scan_layers=True), "model.scan_layers = True: needs every layer alike"),
    (lambda: ModelConfig(arch="qwen3_moe", num_experts=4, moe_impl="dense",
                         capacity_factor=1.0), "model.moe_impl = 'dense' is dropless only"),
    (lambda: ModelConfig(hf_path=3), "model.hf_path = 3: must be a string"),
    (lambda: TrainerConfig(learning_rate=-1.0), "trainer.learning_rate = -1.0: must be >= 0"),
    # Adam's bias correction divides 0 by 0 at beta 1: every param NaN after one update.
    (lambda: OptimizerConfig(b1=1.0), "optimizer.b1 = 1.0: must be in [0, 1)"),
    (lambda: OptimizerConfig(b2=1.5), "optimizer.b2 = 1.5: must be in [0, 1)"),
    (lambda: OptimizerConfig(momentum=1.0), "optimizer.momentum = 1.0: must be in [0, 1)"),
    (lambda: TrainerConfig(learning_rate="fast"), "trainer.learning_rate = 'fast': must be a num"),
    (lambda: SamplerConfig(top_p=1.5), "sampler.top_p = 1.5: must be in [0, 1]"),
    (lambda: SamplerConfig(prompt_buckets=(64, 32)), "must be positive and ascending"),
    (lambda: SamplerConfig(slots=8, decode_row_buckets=(4, 16)),
     "sampler.decode_row_buckets = (4, 16): must be ascending, distinct and in [1, sampler.slots"),
    (lambda: SamplerConfig(decode_row_buckets=(8, 4)), "must be ascending, distinct"),
    (lambda: SamplerConfig(max_len=64, prompt_buckets=(32, 64)), "the largest must be < sampler"),
    (lambda: SamplerConfig(prompt_buckets=(32, "x")), "sampler.prompt_buckets[1] = 'x'"),
    (lambda: SamplerConfig(prompt_buckets=5), "must be a sequence of int"),
    (lambda: RewardConfig(names=("math", "gsm8k"), weights=(1.0,)), "needs one weight per name"),
    (lambda: DataConfig(source="jsonl"), "data.path = '': required when data.source = 'jsonl'"),
    (lambda: DistributedConfig(initialize="explicit"), "distributed.coordinator_address"),
    (lambda: DistributedConfig(num_processes=2, process_id=2), "distributed.process_id = 2"),
])
def test_invalid_value_raises_naming_field_value_and_rule(make, message):
    with pytest.raises(ConfigError, match=None) as info:
        make()
    assert message in str(info.value)


def test_int_is_accepted_for_float_field_and_stored_as_float():
    assert TrainerConfig(learning_rate=1).learning_rate == 1.0
    assert isinstance(TrainerConfig(learning_rate=1).learning_rate, float)


def test_list_is_accepted_for_tuple_field():
    assert SamplerConfig(prompt_buckets=[8, 16]).prompt_buckets == (8, 16)


def test_unknown_section_key_names_closest_key():
    cfg = base_config()
    cfg.trainer.unlock()
    cfg.trainer.lerning_rate = 1e-4
    with pytest.raises(ConfigError, match="unknown config key 'trainer.lerning_rate'; did you mean "
                                          "'learning_rate'"):
        from_config_dict(cfg)


def test_unknown_top_level_key_names_closest_section():
    values = base_config().to_dict()
    values["trainr"] = {}
    with pytest.raises(ConfigError, match="unknown config key 'trainr'; did you mean 'trainer'"):
        from_config_dict(values)


def test_bad_job_lists_valid_jobs():
    values = base_config().to_dict()
    values["job"] = "pretrain"
    with pytest.raises(ConfigError, match=r"job = 'pretrain': must be one of \['sft'"):
        from_config_dict(values)


def test_missing_job_is_an_error():
    values = base_config().to_dict()
    del values["job"]
    with pytest.raises(ConfigError, match="job: required"):
        from_config_dict(values)


def test_section_that_is_not_a_mapping_is_an_error():
    values = base_config().to_dict()
    values["model"] = 3
    with pytest.raises(ConfigError, match="model = 3: must be a section"):
        from_config_dict(values)


def test_config_is_frozen():
    config = from_config_dict(base_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.trainer.steps = 3  # type: ignore[misc]
