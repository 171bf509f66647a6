"""The TPU code paths compiled for a v5e 2x2 slice without its hardware (libtpu's topology
description; nothing runs), and the collectives each promises, read from the compiled HLO."""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.aot import hlo
from meshrl.jobs import compile as compile_job
from meshrl.jobs.compile_programs import BUILDERS
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import KVCache, paged_kernel, resolve_model_config
from meshrl.models.kv_cache import TIME_MAJOR
from meshrl.tests.jobs.compile_configs import compile_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler is not installed: pip install -e '.[tpu]' -c constraints.txt")


def _config(job: str, **fields: object):
    return compile_config(job, **{"compile__topology": "v5e-4", **fields})


def _compiled(config, program: str):
    devices, chip, _ = compile_job.target(config.compile)
    assert devices[0].platform == "tpu" and chip.name == "v5e"
    mesh = create_mesh(config.mesh, devices)
    prog = BUILDERS[program](config, resolve_model_config(config.model), mesh)
    return prog.lowered.compile()


def test_fsdp_train_step_gathers_one_layer_at_a_time():
    config = _config("sft", mesh__data=4, mesh__fsdp=True, model__scan_layers=True,
                     model__num_layers=4)
    text = _compiled(config, "train").as_text()
    c = hlo.collectives(text)
    m = config.model
    stacked_mlp = m.num_layers * m.hidden_size * m.intermediate_size * 4  # float32 params
    assert c.by_kind["all-gather"].count >= m.num_layers  # inside the scanned layer
    assert c.by_kind["all-gather"].largest < stacked_mlp  # never all layers' weights at once
    assert c.by_kind["reduce-scatter"].count > 0  # gradients leave sharded


def test_splash_attention_compiles_to_the_tpu_kernel():
    config = _config("sft", mesh__data=4, model__attention="splash", trainer__seq_len=256,
                     model__head_dim=128)
    assert "tpu_custom_call" in _compiled(config, "train").as_text()


def test_ring_context_attention_passes_keys_round_the_ring():
    config = _config("sft", mesh__data=1, mesh__context=4, model__context_attention="ring",
                     trainer__seq_len=256)
    c = hlo.collectives(_compiled(config, "train").as_text())
    assert c.by_kind["collective-permute"].count >= 3 * config.model.num_layers  # 3 hops each


def test_ragged_dot_moe_with_expert_parallelism_exchanges_tokens_all_to_all():
    config = _config("sft", mesh__data=1, mesh__expert=4, model__arch="qwen3_moe",
                     model__num_experts=8, model__num_experts_per_tok=2,
                     model__moe_intermediate_size=64, model__moe_impl="ragged_dot")
    c = hlo.collectives(_compiled(config, "train").as_text())
    assert c.by_kind["all-to-all"].count > 0


def test_sampler_prefill_and_decode_compile_tensor_parallel_with_known_loops(tmp_path):
    config = _config("rl", mesh__data=1, mesh__tensor=4, model__num_kv_heads=4,
                     compile__programs=("prefill", "decode"))
    results = compile_job.run(config, str(tmp_path))
    assert [r["program"] for r in results] == ["prefill", "decode"]
    for r in results:
        assert r["fits"] and r["unknown_trip_count_loops"] == []
        assert "all-reduce" in r["collectives"]  # tensor-parallel projections
        assert r["step_s_roofline"] > 0 and 0 < r["mfu_roofline"] <= 1
    decode = results[1]
    chunk = config.sampler.decode_chunk
    assert decode["steps_per_call"] == chunk and math.isfinite(decode["hbm_traffic_bytes"])
    assert jax.devices()[0].platform == "cpu"  # the runtime backend is untouched


def test_decode_reads_the_key_cache_in_place_in_the_tpu_key_layout(tmp_path):
    # A cache larger than a v5e core's VMEM, so the compiler streams it from HBM as on a real
    # model; with keys stored transposed the program copied the whole key cache (temporaries
    # of one key cache, 1.30x weights + KV per step).
    config = _config("rl", mesh__data=1, mesh__tensor=4, model__num_kv_heads=4,
                     model__head_dim=128, sampler__dtype="bfloat16", sampler__slots=128,
                     sampler__max_len=4096, compile__programs=("decode",))
    devices, _, _ = compile_job.target(config.compile)
    mesh = create_mesh(config.mesh, devices)
    assert KVCache.shardings(resolve_model_config(config.model), 4, 8, mesh,
                             rules_for("sample")).key_layout == TIME_MAJOR

    (decode,) = compile_job.run(config, str(tmp_path))

    kv_bytes = decode["state_bytes_per_chip"]  # keys + values, one chip
    assert decode["memory_gib"]["temps"] * 2**30 < kv_bytes / 20  # no key-cache copy
    moved = decode["hbm_traffic_bytes"] / (decode["weights_bytes_per_chip"] + kv_bytes)
    assert moved <= 1.15, moved


def test_decode_keeps_the_cache_layout_where_each_chip_holds_every_kv_head(tmp_path):
    # data=4: a chip holds all kv heads of its slots. Scattering each new token's [K, H] as one
    # window made the compiler lay the cache out [B, T, K, H] for the scatter and copy the whole
    # stacked cache, keys and values, to it and back on every call (temporaries of one more
    # cache); one row of head_dim per (slot, kv head, position) takes no copy.
    config = _config("rl", mesh__data=4, model__num_kv_heads=4, model__head_dim=128,
                     model__scan_layers=True, sampler__dtype="bfloat16", sampler__slots=128,
                     sampler__max_len=4096, compile__programs=("decode",))

    (decode,) = compile_job.run(config, str(tmp_path))

    kv_bytes = decode["state_bytes_per_chip"]  # keys + values, one chip
    assert decode["mesh"]["data"] == 4 and kv_bytes >= 2**28
    assert decode["memory_gib"]["temps"] * 2**30 < kv_bytes / 20  # no cache copy


def test_ragged_paged_attention_kernel_compiles_for_the_slice_within_its_mesh():
    config = _config("rl", mesh__data=1)
    devices, _, _ = compile_job.target(config.compile)
    mesh = create_mesh(config.mesh, devices[:1])
    B, N, K, H, S, M, P = 8, 8, 2, 128, 16, 8, 64  # decode: one query per sequence
    repl = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=repl) for shape, dtype in [
        ((B, 1, N, H), jnp.bfloat16), ((P, S, 2 * K, H), jnp.bfloat16), ((B, M), jnp.int32),
        ((B, 1), jnp.int32)]]
    jitted = jax.jit(paged_kernel.ragged_paged_attention)

    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
        jitted.lower(*args)  # the Mosaic lowering asks the host's default device
    with paged_kernel.lowering_for(mesh):
        text = jitted.lower(*args).compile().as_text()

    assert "tpu_custom_call" in text


@pytest.mark.parametrize("scan_layers", [False, True], ids=["per_layer", "stacked"])
def test_paged_decode_on_a_tpu_reads_pages_in_place_through_the_kernel(scan_layers):
    # sampler.paged_decode = auto: in place on a TPU. Gathering the slots' pages into a window
    # per chunk held a copy of the live cache in temporaries (42 GiB a chip for 8B on v6e-8);
    # a stacked pool handed to the kernel one layer slice at a time copied that layer's pool.
    config = _config("rl", mesh__data=1, mesh__tensor=4, model__num_kv_heads=4,
                     model__scan_layers=scan_layers,
                     model__head_dim=128, sampler__dtype="bfloat16", sampler__slots=64,
                     sampler__max_len=2048, sampler__kv_cache="paged",
                     compile__programs=("decode",))

    compiled = _compiled(config, "decode")

    assert "tpu_custom_call" in compiled.as_text()  # the ragged paged attention kernel
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < memory.output_size_in_bytes / 20, memory


def test_prefill_into_a_data_sharded_stacked_cache_gathers_no_cache():
    # Scattering the prompts into the stacked cache with the layer as a vmapped dimension made
    # the partitioner all-gather the slot-sharded cache (8B on v5p-8: 64 GiB a chip for each
    # of keys and values; the prefill was refused at 159 GiB).
    config = _config("rl", mesh__data=4, mesh__tensor=1, model__num_kv_heads=4,
                     model__scan_layers=True, model__head_dim=128, sampler__dtype="bfloat16",
                     sampler__slots=64, sampler__max_len=2048, compile__programs=("prefill",))

    memory = _compiled(config, "prefill").memory_analysis()

    assert memory.temp_size_in_bytes < memory.output_size_in_bytes / 20, memory


def test_paged_prefill_on_a_tpu_writes_a_stacked_pool_in_place():
    # Writing the prompts into a stacked pool with the layer as a vmapped scatter dimension
    # made the TPU compiler lay the pool out anew inside the prefill loop: a copy of the whole
    # pool in and one out (34 GiB of temporaries a chip for 8B on v6e-8, the dense prefill 0.1).
    # (Two layers and one pass kept the layout; 8 layers in passes of 2,048 tokens did not.)
    config = _config("rl", mesh__data=1, mesh__tensor=4, model__num_kv_heads=4,
                     model__scan_layers=True, model__num_layers=8, model__head_dim=128,
                     sampler__dtype="bfloat16", sampler__slots=64, sampler__max_len=2048,
                     sampler__kv_cache="paged", sampler__prefill_tokens=2048,
                     compile__programs=("prefill",))

    memory = _compiled(config, "prefill").memory_analysis()

    assert memory.temp_size_in_bytes < memory.output_size_in_bytes / 20, memory


def test_paged_pool_shards_over_data_with_its_slots(tmp_path):
    # data=4: each chip holds the pages of its own slots. A pool replicated over data held
    # every page on every chip and copied it (8B GRPO on v5p-8 asked 287.5 GiB a chip).
    config = _config("rl", mesh__data=4, mesh__tensor=1, model__num_kv_heads=4,
                     model__scan_layers=True, model__head_dim=128, sampler__dtype="bfloat16",
                     sampler__slots=64, sampler__max_len=2048, sampler__kv_cache="paged",
                     compile__programs=("prefill", "decode", "reprefill_tail"))
    m = resolve_model_config(config.model)
    pool = m.num_layers * 64 * 2048 * 2 * 4 * 128 * 2  # layers x slots x len x (k, v) x K x H

    results = compile_job.run(config, str(tmp_path))

    for r in results:
        assert r["mesh"]["data"] == 4 and r["fits"], r
        held = r["state_bytes_per_chip"]  # the chip's pages and the (replicated) page table
        assert pool // 4 <= held < pool // 4 + 2**20, (r["program"], held)
        assert r["memory_gib"]["temps"] * 2**30 < pool / 4, r  # no copy of the chip's pool


@pytest.mark.slow  # ~17 s: three compiles; the TPU code paths above stay in the default run
def test_mesh_search_lists_every_split_and_keeps_the_fastest_that_fits(tmp_path, monkeypatch):
    from meshrl.jobs import compile_search

    monkeypatch.setattr(compile_search, "MAX_COMPILED", 2)
    config = _config("sft", compile__search=True, model__num_kv_heads=4)
    results = compile_job.run(config, str(tmp_path))
    import json

    report = json.loads((tmp_path / "compile.json").read_text())
    tried = report["search"]
    assert len(tried) == 6  # data x tensor x context splits of 4 devices (dense: expert 1)
    compiled = [r for r in tried if r["compiled"]]
    assert len(compiled) == 2 and all(r["refused"] for r in tried if not r["compiled"])
    chosen = [r for r in tried if r.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["step_s_roofline"] == min(
        r["step_s_roofline"] for r in compiled if r["fits"])
    assert {k: results[0]["mesh"][k] for k in chosen[0]["mesh"]} == chosen[0]["mesh"]


def test_tpu_compiler_installed_leaves_a_cpu_run_quiet():
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TPU_") and k != "JAX_PLATFORMS"}  # as a user's shell has it
    proc = subprocess.run([sys.executable, str(root / "main.py"), "--config",
                           str(root / "configs" / "default.py"), "--dry_run"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# mesh (1 devices, cpu)" in proc.stdout or ", cpu)" in proc.stdout
    for noise in ("TPU_WORKER_HOSTNAMES", "libtpu", "backend 'tpu'", "host bounds"):
        assert noise not in proc.stderr, proc.stderr[-2000:]


def test_the_compilers_refusal_names_the_whole_footprint_arguments_included():
    # 12 GiB of arguments and a 4 GiB sort on one 16 GiB v5e chip: refused at 12 + 2 + 4.
    from meshrl.aot.chips import CHIPS
    from meshrl.jobs import compile_analysis
    from meshrl.jobs.compile_programs import Program

    devices, _, _ = compile_job.target(_config("sft").compile)
    one = NamedSharding(jax.sharding.Mesh(devices[:1], ("d",)), PartitionSpec())
    gib = 2 ** 30 // 4  # float32 elements in a GiB
    args = (jax.ShapeDtypeStruct((12 * gib,), jnp.float32, sharding=one),
            jax.ShapeDtypeStruct((2 * gib,), jnp.float32, sharding=one))
    lowered = jax.jit(lambda x, y: x.sum() + jnp.sort(y)[::1024].sum()).lower(*args)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as info:
        lowered.compile()

    prog = Program("train", lowered, 1, 1.0, 1.0, 12 * 2 ** 30, 2 * 2 ** 30)
    e = compile_analysis.over_capacity(prog, info.value, CHIPS["v5e"], 1.0, "")

    assert e["hbm_per_chip_gib"] == pytest.approx(18.0, abs=0.01)
