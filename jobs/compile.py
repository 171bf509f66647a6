"""The compile job: ``python main.py --config CFG --config.job=compile
[--config.compile.topology=v5p-8] [--config.compile.programs=train,decode]``.

Lowers and compiles ``compile.job``'s programs (``jobs/compile_programs.py``) for the devices of
a TPU slice (libtpu's topology description: no TPU needed, nothing runs) or the local devices,
on the run's mesh built with the same rules and checks as a real run. Writes
``<workdir>/compile.json`` (one object per program: per-chip HBM against the chip's capacity,
collectives per step counted from the compiled HLO, model FLOPs, HBM traffic, the roofline
estimate, XLA's own cost analysis) and logs a table. Every time and MFU in it is an estimate
(``aot/roofline.py``); docs/scale.md says what it does and does not see.
"""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Any

import jax

from meshrl.aot import chips
from meshrl.configs.schema import CompileConfig, Config
from meshrl.jobs.compile_analysis import advice, analyse, over_capacity
from meshrl.jobs.compile_programs import (
    BUILDERS,
    SAMPLING_PHASE,
    TRAIN_PHASE,
    default_programs,
    program_meshes,
)
from meshrl.jobs.compile_report import table
from meshrl.jobs.compile_search import search
from meshrl.models import resolve_model_config
from meshrl.utils import log, paths
from meshrl.utils.errors import UserError

_log = log.get_logger("compile")
GiB = 2 ** 30


def target(cfg: CompileConfig) -> tuple[list[Any], chips.Chip | None, str]:
    """(devices, their chip's figures or None, a label): a TPU slice's devices from libtpu's
    topology description, or the local devices."""
    if not cfg.topology:
        devices = jax.devices()
        kind = devices[0].device_kind
        return devices, chips.chip_for_kind(kind), f"{len(devices)} local {kind} device(s)"
    topo = chips.topology(cfg.topology)
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"compile.topology = {cfg.topology!r}: compiling for a TPU needs the "
                        f"TPU compiler: pip install -e \".[tpu]\" -c constraints.txt")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.libtpu_name,
                                        **topo.libtpu_options)
    return list(desc.devices), topo.chip, f"{topo.name} ({topo.chips} chips, {topo.shape})"


def compile_all(config: Config, devices: list[Any], chip: chips.Chip | None,
                names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Compile ``names`` (default: ``compile.programs`` or the job's) on the run's meshes over
    ``devices`` (``program_meshes``: a mesh the run's checks refuse raises); one compile.json
    object each."""
    model_cfg = resolve_model_config(config.model)
    meshes = program_meshes(config, devices)
    names = names or config.compile.programs or default_programs(config)
    results = []
    for name in names:
        t0 = time.perf_counter()
        prog = BUILDERS[name](config, model_cfg, meshes[name])
        try:
            compiled = prog.lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler checks the chip's HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            results.append(over_capacity(prog, e, chip, time.perf_counter() - t0,
                                         advice(config, name)))
        else:
            results.append(analyse(prog, compiled, chip, meshes[name].devices.size,
                                   time.perf_counter() - t0))
            if results[-1]["fits"] is False:
                results[-1]["advice"] = advice(config, name)
        results[-1]["mesh"] = dict(meshes[name].shape)
    return results


def colocated(config: Config, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The per-chip peak of RL with a colocated sampler, which runs one program at a time. The
    train state (and the KL reference's frozen copy) stay resident. With
    ``rl.release_sampler_cache`` the KV cache is freed for the train step (``trainer.rl_loop``),
    so the peak is the larger of two phases: train (resident + the train/reference programs'
    own temporaries) and sampling (resident + the sampler's weights + KV cache + the
    prefill/decode programs' own); the sampler's weights are resident in the train phase too
    unless ``rl.release_sampler_weights`` frees them for the step. Without the cache release
    everything is resident and the largest program's own share comes on top. None when that
    does not apply (SFT, a split placement, a program the compiler refused) or a program it
    needs is missing (``colocated_needs``): with the KL on, the reference's frozen copy and its
    own share are part of the train phase, and a peak without them would read low."""
    by = {r["program"]: r for r in results}
    if (config.compile.job != "rl" or config.rl.placement != "colocated"
            or not set(colocated_needs(config)) <= set(by)
            or any(r.get("error") for r in results)):
        return None
    trainer = by["train"]["weights_bytes_per_chip"] + by["train"]["state_bytes_per_chip"]
    if config.rl.kl_coef > 0 and config.lora.rank == 0:
        # The frozen copy; a LoRA run's reference reads the trainer's frozen base instead.
        trainer += by["reference"]["weights_bytes_per_chip"]
    sampler_weights = by["decode"]["weights_bytes_per_chip"]
    resident, kv = trainer + sampler_weights, by["decode"]["state_bytes_per_chip"]
    # A program's own share: what it needs beyond the resident buffers it takes as arguments.
    own = {r["program"]: r["hbm_per_chip_gib"] * GiB - r["weights_bytes_per_chip"]
           - r["state_bytes_per_chip"] for r in results}
    released = config.rl.release_sampler_cache
    weights_out = released and config.rl.release_sampler_weights  # the schema's rule too
    phases = {"train": (trainer if weights_out else resident, TRAIN_PHASE),
              "sampling": (resident + kv, SAMPLING_PHASE)}
    if not released:
        phases = {"all": (resident + kv, tuple(own))}
    peaks = {}
    for phase, (held, names) in phases.items():
        largest = max((n for n in names if n in own), key=own.get)
        peaks[phase] = (held + own[largest], held, largest)
    phase = max(peaks, key=lambda k: peaks[k][0])
    peak, held, largest = peaks[phase]
    cap = results[0]["hbm_capacity_gib"]
    out = {"kv_cache_released": released, "sampler_weights_released": weights_out,
           "peak_phase": phase, "phases_gib": {k: v[0] / GiB for k, v in peaks.items()},
           "resident_gib": held / GiB, "kv_cache_gib": kv / GiB,
           "sampler_weights_gib": sampler_weights / GiB, "peak_gib": peak / GiB,
           "largest_program": largest, "hbm_capacity_gib": cap,
           "fits": None if cap is None else peak / GiB <= cap,
           "headroom": None if cap is None else 1 - peak / GiB / cap}
    if out["fits"] is False:
        out["advice"] = _colocated_advice(out, phase, config)
    return out


def colocated_needs(config: Config) -> tuple[str, ...]:
    """The programs the colocated peak is computed from: the train step, the decode chunk, and
    the KL reference's forward when the run has one."""
    return ("train", "decode") + (("reference",) if config.rl.kl_coef > 0 else ())


def _colocated_advice(out: dict[str, Any], phase: str, config: Config) -> str:
    over = f"{out['peak_gib'] - out['hbm_capacity_gib']:.1f} GiB over in the {phase} phase"
    if phase == "train" and not out["sampler_weights_released"]:
        return (f"{over}, where the sampler's weights hold {out['sampler_weights_gib']:.1f} GiB "
                f"a chip: rl.release_sampler_weights = true frees them for the step; or a slice "
                f"with twice the chips; or more trainer.microbatches where the step's own share "
                f"is activations; or rl.placement = 'split'")
    if phase == "train":
        return (f"{over} (the sampler's weights are freed for the step already): a slice with "
                f"twice the chips; or more trainer.microbatches where the step's own share is "
                f"activations; or rl.placement = 'split'")
    now = config.rl.sampler_expert or "0, the trainer's mesh.expert"
    experts = (f"; or a larger rl.sampler_expert (now {now}) shards the sampler's "
               f"{out['sampler_weights_gib']:.1f} GiB of weights a chip over more chips"
               if config.model.num_experts else "")
    return (f"{over}: half the sampler.slots (or sampler.max_len) frees "
            f"{out['kv_cache_gib'] / 2:.1f} GiB of KV cache per chip{experts}; or a slice with "
            f"twice the chips; or rl.placement = 'split'")


def run(config: Config, workdir: str) -> list[dict[str, Any]]:
    devices, chip, label = target(config.compile)
    _log.info("compiling %s's programs for %s", config.compile.job, label)
    if config.compile.search:
        results, tried = search(config, devices, chip, compile_all)
    else:
        results, tried = compile_all(config, devices, chip), []
    both = colocated(config, results)
    missing = [n for n in colocated_needs(config) if n not in {r["program"] for r in results}]
    if config.compile.job == "rl" and config.rl.placement == "colocated" and missing:
        _log.warning("no colocated RL peak: it needs %s compiled too (compile.programs)",
                     ", ".join(missing))
    report = {"target": label, "topology": config.compile.topology or None,
              "chip": chip.name if chip else None, "chip_source": chip.source if chip else None,
              "chips": len(devices), "job": config.compile.job, "programs": results,
              "colocated": both, "search": tried}
    if jax.process_index() == 0:
        path = paths.as_path(workdir) / "compile.json"
        paths.write_text_atomic(path, json.dumps(report, indent=2))
        _log.info("%s\nwritten: %s", table(report), path)
    return results
