"""The real-size configs: every variant validates, the architectures have the published
parameter counts (counted on the abstract model: nothing allocated), the dry run works on this
CPU, fields stay overridable, and ``@<topology>`` picks the recommended mesh."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import jax
import pytest

from meshrl.aot.chips import topology
from meshrl.configs import load_config_file
from meshrl.jobs.dispatch import dry_run
from meshrl.models import abstract_model, param_count, resolve_model_config, split_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Parameter counts as published on each model's Hugging Face page (safetensors metadata).
PUBLISHED = {"llama3_8b": 8_030_261_248, "qwen3_8b": 8_190_735_360,
             "qwen3_30b_a3b": 30_532_122_624, "llama3_70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_architecture_has_the_published_parameter_count(name):
    config = load_config_file(ROOT / "configs" / f"{name}.py", "grpo")
    model_cfg = resolve_model_config(config.model)
    _, params = split_model(abstract_model(model_cfg))  # ShapeDtypeStructs only
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert counted == param_count(model_cfg) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("variant", ["sft", "grpo"])
def test_variants_set_their_job_and_real_size_settings(name, variant):
    config = load_config_file(ROOT / "configs" / f"{name}.py", variant)
    assert config.job.value == ("sft" if variant == "sft" else "rl")
    assert config.compile.job == config.job.value
    assert config.trainer.seq_len == 4096 and config.model.scan_layers
    assert config.mesh.data == -1 and config.mesh.fsdp and not config.compile.topology


def _rows(config) -> int:
    """Sequences the train step sees per step."""
    if config.job.value == "sft":
        return config.trainer.batch_size
    return config.rollout.prompts_per_step * config.rollout.group_size


def _module(name: str):
    """configs/<name>.py as a module (its ARCH and RECOMMENDED_MESH)."""
    spec = importlib.util.spec_from_file_location(f"real_size_{name}",
                                                  ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_topology_variant_sets_the_slice_and_a_mesh_that_fills_it(name, job):
    for slice_name, mesh in _module(name).RECOMMENDED_MESH.items():
        config = load_config_file(ROOT / "configs" / f"{name}.py", f"{job}@{slice_name}")
        assert config.compile.topology == slice_name
        assert {k: getattr(config.mesh, k) for k in mesh} == mesh
        m = config.mesh
        assert m.data * m.tensor * m.context * m.expert * m.expert_tensor == \
            topology(slice_name).chips
        # Each microbatch's rows split evenly over the batch shards (data, and expert for MoE).
        assert _rows(config) // config.trainer.microbatches % (m.data * m.expert) == 0


def test_8b_grpo_on_v5p_8_trains_8_sequences_per_data_shard():
    config = load_config_file(ROOT / "configs" / "llama3_8b.py", "grpo@v5p-8")
    assert _rows(config) // config.mesh.data == 8
    assert (config.sampler.slots, config.sampler.max_len) == (256, 4096)
    assert config.model.attention == "splash" and config.model.remat == "full"


def test_moe_topology_uses_expert_parallelism():
    config = load_config_file(ROOT / "configs" / "qwen3_30b_a3b.py", "grpo@v5p-16")
    assert (config.mesh.data, config.mesh.expert) == (4, 2)
    assert config.model.num_experts == 128 and config.model.num_experts_per_tok == 8
    # Colocated, the sampler's weights leave for the step and its experts spread over 4 chips.
    assert config.rl.release_sampler_weights and config.rl.sampler_expert == 4


@pytest.mark.parametrize("variant", ["dpo", "grpo@v9-8"])
def test_unknown_variant_or_slice_is_one_line(variant):
    with pytest.raises(ValueError, match="configs/llama3_8b.py: "):
        load_config_file(ROOT / "configs" / "llama3_8b.py", variant)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("variant", ["sft", "grpo"])
def test_dry_run_of_every_variant(name, variant):
    # The dry run builds no params: the 70B's resolves in well under a second here.
    out = dry_run(load_config_file(ROOT / "configs" / f"{name}.py", variant))
    hidden = _module(name).ARCH["hidden_size"]
    assert f"model.hidden_size = {hidden}" in out and "# mesh (" in out


def test_dry_run_shows_the_real_size_model_and_takes_overrides():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--config",
         f"{ROOT / 'configs' / 'llama3_70b.py'}:sft", "--dry_run",
         "--config.model.num_layers=40"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model.hidden_size = 8192" in proc.stdout
    assert "model.num_layers = 40" in proc.stdout
