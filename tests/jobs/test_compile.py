"""job = compile on the local (fake CPU) devices: compile.json, the programs a job runs, and the
one-line errors. TPU topologies: tests/jobs/test_compile_tpu.py."""

from __future__ import annotations

import json
import pathlib

import pytest

from meshrl.configs import ConfigError, base_config, from_config_dict, load_config_file
from meshrl.jobs import compile as compile_job
from meshrl.jobs import compile_analysis
from meshrl.jobs.compile_programs import default_programs
from meshrl.jobs.compile_report import table
from meshrl.utils.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = {"program", "fits", "hbm_per_chip_gib", "hbm_capacity_gib", "collectives",
          "step_s_roofline", "mfu_roofline", "memory_gib", "model_flops", "hbm_traffic_bytes",
          "xla_cost_analysis", "mesh", "warnings"}


def test_compile_job_writes_one_object_per_program_of_the_rl_job(tmp_path):
    config = load_config_file(ROOT / "configs" / "default.py")
    config = from_config_dict({**config.to_dict(), "job": "compile"})
    assert config.compile.job == "rl"  # the config file's own job
    compile_job.run(config, str(tmp_path))
    report = json.loads((tmp_path / "compile.json").read_text())
    assert [p["program"] for p in report["programs"]] == ["train", "prefill", "decode"]
    for entry in report["programs"]:
        assert FIELDS <= set(entry), FIELDS - set(entry)
        assert entry["hbm_per_chip_gib"] > 0 and entry["model_flops"] > 0
        assert entry["fits"] is None and entry["step_s_roofline"] is None  # no CPU chip figures
    train = report["programs"][0]
    assert train["mesh"]["data"] == 8 and "all-gather" in train["collectives"]  # FSDP
    assert report["programs"][2]["steps_per_call"] == config.sampler.decode_chunk


def test_sft_job_compiles_its_train_step_and_programs_select(tmp_path):
    cfg = base_config("sft")
    cfg.job = "compile"
    config = from_config_dict(cfg)
    assert config.compile.job == "sft" and default_programs(config) == ("train",)
    cfg.compile.job, cfg.rl.kl_coef = "rl", 0.1
    assert default_programs(from_config_dict(cfg))[-1] == "reference"
    cfg.compile.programs = ("reference",)
    results = compile_job.compile_all(from_config_dict(cfg), *compile_job.target(
        from_config_dict(cfg).compile)[:2])
    assert [r["program"] for r in results] == ["reference"]
    assert results[0]["hbm_per_chip_gib"] > 0


def test_paged_decode_updates_the_page_pool_in_place_without_a_second_copy():
    cfg = base_config("rl")
    cfg.job, cfg.compile.programs = "compile", ("prefill", "decode")
    cfg.sampler.kv_cache, cfg.sampler.page_size = "paged", 16
    config = from_config_dict(cfg)
    results = compile_job.compile_all(config, *compile_job.target(config.compile)[:2])
    assert [r["program"] for r in results] == ["prefill", "decode"]
    s, m = config.sampler, config.model
    data = results[1]["mesh"]["data"]
    assert data > 1 and s.slots % data == 0
    pool_gib = (2 * m.num_layers * s.slots * s.max_len * m.num_kv_heads * m.resolved_head_dim
                * 4 / 2**30) / data  # keys and values, float32, a device's pages (with its slots)
    decode = results[1]["memory_gib"]
    assert decode["aliased"] >= pool_gib * 0.999, (decode, pool_gib)  # donated, written in place
    # Pages are never copied, nor gathered from other devices: the window of a device's slots.
    assert decode["temps"] < 1.5 * pool_gib, (decode, pool_gib)


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("topology", "v4-8", "must be v5e-N, v5p-N or v6e-N"),
    ("programs", ("train", "backward"), "must be distinct names from"),
    ("programs", ("train", "train"), "must be distinct names from")])
def test_bad_compile_field_is_one_line_naming_it(field, value, rule):
    cfg = base_config("rl")
    cfg.compile[field] = value
    with pytest.raises(ConfigError, match=f"compile.{field} = .*{rule}"):
        from_config_dict(cfg)


def test_topology_without_the_tpu_compiler_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    cfg = base_config("rl")
    cfg.compile.topology = "v5p-8"
    with pytest.raises(UserError, match=r'needs the TPU compiler: pip install -e "\.\[tpu\]"'):
        compile_job.target(from_config_dict(cfg).compile)


def test_topology_of_a_size_not_offered_is_one_line():
    cfg = base_config("rl")
    cfg.compile.topology = "v5p-6"
    with pytest.raises(UserError, match="v5p slices here are v5p-8, v5p-16"):
        compile_job.target(from_config_dict(cfg).compile)


def _entry(program: str, gib: float, weights_gib: float, state_gib: float) -> dict:
    GiB = 2 ** 30
    return {"program": program, "hbm_per_chip_gib": gib, "hbm_capacity_gib": 95.0,
            "weights_bytes_per_chip": weights_gib * GiB, "state_bytes_per_chip": state_gib * GiB}


def _colocated_results() -> list[dict]:
    return [_entry("train", 55.0, 7.5, 15.0), _entry("prefill", 50.0, 15.0, 32.0),
            _entry("decode", 80.0, 15.0, 32.0)]


def test_colocated_rl_peak_with_the_kv_cache_released_is_the_larger_phase():
    config = from_config_dict({**base_config("rl").to_dict(), "job": "compile"})
    both = compile_job.colocated(config, _colocated_results())
    # Held in both phases: train params + moments (22.5) + sampler weights (15). Train phase:
    # + the step's own share (55 - 22.5 = 32.5) = 70; sampling phase: + KV (32) + decode's own
    # share (80 - 47 = 33) = 102.5.
    assert both["kv_cache_released"] is True
    assert both["phases_gib"] == pytest.approx({"train": 70.0, "sampling": 102.5})
    assert both["peak_phase"] == "sampling" and both["largest_program"] == "decode"
    assert both["peak_gib"] == pytest.approx(102.5) and both["resident_gib"] == pytest.approx(69.5)
    assert both["fits"] is False and "7.5 GiB over in the sampling phase" in both["advice"]
    assert "16.0 GiB of KV cache" in both["advice"]
    sft = from_config_dict({**base_config("sft").to_dict(), "job": "compile"})
    assert compile_job.colocated(sft, _colocated_results()) is None  # no sampler beside SFT


def test_colocated_rl_counts_a_kl_references_weights_once_and_none_with_lora():
    base = base_config("rl").to_dict()
    results = [*_colocated_results(), _entry("reference", 12.0, 7.5, 0.0)]

    def resident(**rl_lora):
        cfg = {**base, "job": "compile", "rl": {**base["rl"], "kl_coef": 0.1},
               "lora": {**base["lora"], **rl_lora}}
        return compile_job.colocated(from_config_dict(cfg), results)["resident_gib"]

    assert resident() == pytest.approx(69.5 + 7.5)  # its own frozen copy of the params
    assert resident(rank=4) == pytest.approx(69.5)  # the trainer's frozen base, no copy


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_colocated_rl_with_the_kl_on_and_no_reference_program_has_no_peak(lora_rank):
    base = base_config("rl").to_dict()
    config = from_config_dict({**base, "job": "compile", "rl": {**base["rl"], "kl_coef": 0.1},
                               "lora": {**base["lora"], "rank": lora_rank}})

    # compile.programs = train,prefill,decode: the frozen copy and the reference's own share
    # would be missing from the train phase.
    assert compile_job.colocated(config, _colocated_results()) is None
    assert compile_job.colocated(
        config, [*_colocated_results(), _entry("reference", 12.0, 7.5, 0.0)]) is not None


def test_an_empty_prompt_bucket_list_compiles_the_samplers_own_buckets():
    cfg = base_config("rl")
    cfg.job, cfg.compile.programs = "compile", ("prefill",)
    cfg.sampler.prompt_buckets = ()
    config = from_config_dict(cfg)
    (prefill,) = compile_job.compile_all(config, *compile_job.target(config.compile)[:2])
    assert prefill["hbm_per_chip_gib"] > 0


def test_colocated_rl_train_phase_peak_names_the_step_and_its_fix():
    config = from_config_dict({**base_config("rl").to_dict(), "job": "compile"})
    results = [_entry("train", 90.0, 7.5, 15.0), _entry("decode", 60.0, 15.0, 32.0)]
    both = compile_job.colocated(config, results)
    # Train phase 22.5 + 15 + 67.5 = 105 beats sampling 37.5 + 32 + 13 = 82.5.
    assert both["peak_phase"] == "train" and both["peak_gib"] == pytest.approx(105.0)
    assert both["largest_program"] == "train" and "sampler's weights hold 15.0 GiB" in both["advice"]
    assert "train phase 105.0 GiB" in table({"job": "rl", "target": "t", "chip": None,
                                             "programs": [], "colocated": both})


def test_colocated_rl_with_the_sampler_weights_released_leaves_them_out_of_the_train_phase():
    base = base_config("rl").to_dict()
    config = from_config_dict({**base, "job": "compile",
                               "rl": {**base["rl"], "release_sampler_weights": True}})
    results = [_entry("train", 90.0, 7.5, 15.0), _entry("decode", 60.0, 15.0, 32.0)]
    both = compile_job.colocated(config, results)
    # Train phase: train state 22.5 + the step's own 67.5 = 90 (no sampler weights); sampling
    # phase as before: 22.5 + 15 + 32 + 13 = 82.5.
    assert both["sampler_weights_released"] is True
    assert both["phases_gib"] == pytest.approx({"train": 90.0, "sampling": 82.5})
    assert both["peak_phase"] == "train" and both["fits"] is True
    assert both["resident_gib"] == pytest.approx(22.5)
    line = table({"job": "rl", "target": "t", "chip": None, "programs": [], "colocated": both})
    assert "KV cache and sampler weights freed for the train step: train phase 90.0 GiB" in line
    kept = compile_job.colocated(from_config_dict({**base, "job": "compile"}), results)
    assert kept["sampler_weights_released"] is False and kept["peak_gib"] == pytest.approx(105.0)
    assert "rl.release_sampler_weights = true frees them for the step" in kept["advice"]


def test_colocated_rl_without_release_keeps_the_kv_cache_resident_through_the_step():
    config = from_config_dict({**base_config("rl").to_dict(), "job": "compile",
                               "rl": {**base_config("rl").rl.to_dict(),
                                      "release_sampler_cache": False}})
    results = [_entry("train", 55.0, 7.5, 15.0), _entry("decode", 50.0, 15.0, 32.0)]
    both = compile_job.colocated(config, results)
    # Train state, sampler weights and KV all resident (69.5) + the step's own share (32.5).
    assert both["kv_cache_released"] is False and both["peak_phase"] == "all"
    assert both["peak_gib"] == pytest.approx(102.0) and both["largest_program"] == "train"


def test_program_refused_for_hbm_reports_how_much_it_needs_and_what_to_change():
    from meshrl.jobs.compile_programs import Program

    GiB = 2 ** 30
    prog = Program("decode", None, 8, 8e12, 8e12, 2 * GiB, 16 * GiB)
    error = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                         "required for HLO temporaries (41.87G) exceeds available HBM "
                         "(31.25G).\nmore")
    from meshrl.aot.chips import CHIPS

    config = from_config_dict({**base_config("rl").to_dict(), "job": "compile"})
    e = compile_analysis.over_capacity(prog, error, CHIPS["v6e"], 1.0,
                                  compile_analysis.advice(config, "decode"))
    assert e["fits"] is False and e["hbm_per_chip_gib"] == pytest.approx(41.87)
    assert e["error"].startswith("RESOURCE_EXHAUSTED") and "\n" not in e["error"]
    assert f"sampler.slots = {config.sampler.slots // 2}" in e["advice"]
    assert e["model_flops"] == pytest.approx(1e12)


def test_microbatch_rows_that_do_not_split_over_the_batch_shards_are_flagged():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from meshrl.jobs.compile_programs import split_warning

    mesh = Mesh(jax.devices()[:8], ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data", None))
    assert split_warning(8, 4, rows, 16) == (
        "2 rows per microbatch (batch 8 / 4 microbatches) do not split over the 8 batch "
        "shards: activations replicate; make trainer.batch_size / trainer.microbatches a "
        "multiple of 8",)
    assert split_warning(8, 1, rows, 16) == () and split_warning(32, 4, rows, 16) == ()


def test_mesh_search_candidates_cover_the_splits_and_refuse_with_the_rule():
    from meshrl.jobs.compile_search import candidates

    cfg = base_config("sft")
    cfg.model.update(num_heads=4, num_kv_heads=2)
    dense = candidates(from_config_dict(cfg), 4)
    assert len(dense) == 6 and all(c[1]["expert"] == 1 for c in dense)
    assert dense[0][1] == {"data": 4, "tensor": 1, "context": 1, "expert": 1}  # FSDP first
    cfg.model.update(arch="qwen3_moe", num_experts=2, num_experts_per_tok=1)
    moe = candidates(from_config_dict(cfg), 4)
    refused = [(split, why) for c, split, why in moe if c is None]
    assert any(s["expert"] == 4 and "mesh.expert = 4: must divide model.num_experts"
               in why for s, why in refused)
    assert {c[1]["expert"] for c in moe if c[0] is not None} == {1, 2}


def test_mesh_search_with_nothing_that_fits_says_so_in_one_line():
    from meshrl.aot.chips import CHIPS
    from meshrl.jobs import compile_search

    def over(config, devices, chip, names):
        return [{"fits": False, "headroom": -0.5, "hbm_per_chip_gib": 140.0,
                 "step_s_roofline": 1.0, "mfu_roofline": 0.5, "roofline": {"bound": "hbm"}}]

    def refused(config, devices, chip, names):  # as over_capacity reports it: no roofline
        return [{"fits": False, "headroom": -0.5, "hbm_per_chip_gib": 140.0,
                 "step_s_roofline": None, "mfu_roofline": None, "roofline": None}]

    import jax

    config = from_config_dict({**base_config("sft").to_dict(), "job": "compile"})
    devices = jax.devices()[:4]
    for compile_all in (over, refused):
        with pytest.raises(UserError, match="none of the 6 meshes tried fits on 4 x v5p"):
            compile_search.search(config, devices, CHIPS["v5p"], compile_all)
    with pytest.raises(UserError, match="compile.search = True: needs a chip's figures"):
        compile_search.search(config, devices, None, over)


def test_lora_train_program_takes_adapters_and_frozen_base_far_below_full_fine_tuning():
    from meshrl.algorithms.batch import abstract_batch
    from meshrl.jobs.compile_programs import _train_params, abstract_tree, per_chip_bytes
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.models import resolve_model_config
    from meshrl.trainer import batch_shardings

    cfg = base_config("sft")
    cfg.job, cfg.lora.rank, cfg.lora.base_dtype = "compile", 4, "nf4"
    config = from_config_dict(cfg)
    devices, chip = compile_job.target(config.compile)[:2]
    (lora,) = compile_job.compile_all(config, devices, chip)
    mesh = create_mesh(config.mesh, devices)
    _, params, params_sh = _train_params(config, resolve_model_config(config.model), mesh)
    full_weights = per_chip_bytes(abstract_tree(params, params_sh))
    t = config.trainer
    batch = per_chip_bytes(abstract_batch(batch_shardings(
        mesh, rules_for("train", config.mesh.fsdp), t.batch_size, t.seq_len),
        t.batch_size, t.seq_len))
    args = lora["memory_gib"]["arguments"] * 2 ** 30
    # The step's arguments are the frozen base, the adapters and their Adam state, the batch.
    assert args == pytest.approx(
        lora["weights_bytes_per_chip"] + lora["state_bytes_per_chip"] + batch, abs=64)
    assert lora["weights_bytes_per_chip"] < 0.5 * full_weights  # nf4 projections, fp32 rest
    assert lora["state_bytes_per_chip"] < 0.1 * 2 * full_weights  # vs full Adam moments
    assert args < 0.3 * (3 * full_weights + batch)  # full: params + two Adam moments


def test_rl_train_flops_count_each_epoch_once_and_the_proximal_forward_as_executed():
    from meshrl.jobs.compile_programs import train_program
    from meshrl.mesh import create_mesh
    from meshrl.models import resolve_model_config

    def program(minibatches, epochs):
        cfg = base_config("rl")
        cfg.job = "compile"
        cfg.rl.ppo_minibatches, cfg.rl.ppo_epochs = minibatches, epochs
        config = from_config_dict(cfg)
        devices = compile_job.target(config.compile)[0]
        return train_program(config, resolve_model_config(config.model),
                             create_mesh(config.mesh, devices))

    one, four, twice = program(1, 1), program(4, 1), program(2, 2)

    assert four.model_flops == pytest.approx(one.model_flops)  # 4 minibatches of 1/4 the rows
    assert twice.model_flops == pytest.approx(2 * one.model_flops)  # 2 epochs
    assert four.executed_flops == pytest.approx(one.executed_flops + one.model_flops / 3)


def test_split_placement_compiles_the_trainer_and_the_sampler_on_their_own_devices():
    cfg = base_config("rl")
    cfg.job, cfg.compile.programs = "compile", ("train", "decode")
    cfg.rl.placement, cfg.rl.sampler_devices = "split", 4
    cfg.mesh.data = 4  # the trainer's share: 4 of the 8 devices, as the RL job places it
    config = from_config_dict(cfg)

    train, decode = compile_job.compile_all(config, *compile_job.target(config.compile)[:2])

    assert train["mesh"]["data"] == 4 and decode["mesh"]["data"] == 4


def test_reference_program_is_the_rl_jobs_reference_apply_with_its_forward_microbatches():
    from meshrl.algorithms.batch import abstract_batch
    from meshrl.jobs.compile_programs import _train_params, abstract_tree, reference_program
    from meshrl.jobs.rl_setup import forward_microbatches
    from meshrl.mesh import create_mesh
    from meshrl.models import resolve_model_config
    from meshrl.trainer import decoder_forward
    from meshrl.trainer.reference import ReferencePolicy
    from meshrl.trainer.spec import rl_batch_size, rl_spec

    cfg = base_config("rl")
    cfg.job, cfg.rl.kl_coef, cfg.rl.ppo_minibatches = "compile", 0.1, 4
    config = from_config_dict(cfg)
    assert forward_microbatches(config) == 4 * config.trainer.microbatches
    mesh = create_mesh(config.mesh, compile_job.target(config.compile)[0])
    model_cfg = resolve_model_config(config.model)
    # As jobs/rl_setup.py builds it (base= stands in for the concrete frozen copy).
    graphdef, params, params_sh = _train_params(config, model_cfg, mesh)
    batch_sh, rows = rl_spec(config, mesh).batch_sh, rl_batch_size(config)
    run = ReferencePolicy(config.rl, decoder_forward(graphdef, config.trainer.logits_chunk),
                          None, params_sh, mesh, batch_sh, samples=rows,
                          temperature=config.sampler.temperature,
                          group_size=config.rollout.group_size,
                          microbatches=forward_microbatches(config), base=lambda: None)
    expected = run._apply.lower(abstract_tree(params, params_sh), abstract_batch(
        batch_sh.replace(ref_logprobs=None), rows, config.trainer.seq_len))

    compiled_here = reference_program(config, model_cfg, mesh)

    assert compiled_here.lowered.as_text() == expected.as_text()


def test_decode_collectives_count_per_model_step_like_their_bytes():
    from meshrl.aot import hlo
    from meshrl.jobs.compile_programs import BUILDERS
    from meshrl.mesh import create_mesh
    from meshrl.models import resolve_model_config

    cfg = base_config("rl")
    cfg.job, cfg.sampler.decode_chunk = "compile", 4
    cfg.mesh.data, cfg.mesh.tensor = 4, 2
    config = from_config_dict(cfg)
    mesh = create_mesh(config.mesh, compile_job.target(config.compile)[0])
    prog = BUILDERS["decode"](config, resolve_model_config(config.model), mesh)
    compiled = prog.lowered.compile()
    per_call = hlo.collectives(compiled.as_text()).to_json()
    assert prog.steps == 4 and per_call

    entry = compile_analysis.analyse(prog, compiled, None, mesh.devices.size, 0.0)

    for kind, stats in per_call.items():
        got = entry["collectives"][kind]
        assert got["count"] == pytest.approx(stats["count"] / 4), kind
        assert got["bytes"] == pytest.approx(stats["bytes"] / 4), kind
        assert got["largest"] == stats["largest"]  # one buffer, not a rate
    assert entry["unknown_replica_groups"] == []
