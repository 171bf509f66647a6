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
import re
import time
from typing import Any

import jax

from meshrl.aot import chips, hlo
from meshrl.aot.roofline import roofline
from meshrl.configs.schema import CompileConfig, Config
from meshrl.jobs.compile_programs import BUILDERS, Program, default_programs
from meshrl.jobs.compile_report import table
from meshrl.mesh import create_mesh
from meshrl.models import resolve_model_config
from meshrl.utils import log, paths
from meshrl.utils.errors import UserError

_log = log.get_logger("compile")
GiB = 2 ** 30
XLA_COST_NOTE = ("XLA's cost model: counts a loop body (scanned layers, decode steps) once and "
                 "does not see inside custom kernels; not a step time")


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

    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.libtpu_name)
    return list(desc.devices), topo.chip, f"{topo.name} ({topo.chips} chips, {topo.shape})"


def _xla_cost(compiled: Any) -> dict[str, Any]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else (cost or {})
    keep = ("flops", "bytes accessed", "optimal_seconds")
    return {**{k: float(cost[k]) for k in keep if k in cost}, "note": XLA_COST_NOTE}


def analyse(prog: Program, compiled: Any, chip: chips.Chip | None, n_chips: int,
            seconds: float) -> dict[str, Any]:
    """compile.json's object for one compiled program (figures per step on one chip)."""
    mem = compiled.memory_analysis()
    parts = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
             "temps": mem.temp_size_in_bytes, "aliased": mem.alias_size_in_bytes,
             "code": mem.generated_code_size_in_bytes}
    used = (parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temps"]
            + parts["code"])
    text = compiled.as_text()
    coll, traffic = hlo.collectives(text), hlo.hbm_bytes(text)
    out: dict[str, Any] = {
        "program": prog.name, "compile_s": round(seconds, 2), "steps_per_call": prog.steps,
        "hbm_per_chip_gib": used / GiB,
        "hbm_capacity_gib": chip.hbm_bytes / GiB if chip else None,
        "fits": used <= chip.hbm_bytes if chip else None,
        "headroom": 1 - used / chip.hbm_bytes if chip else None,
        "memory_gib": {k: v / GiB for k, v in parts.items()},
        "collectives": {k: {**v, "bytes": v["bytes"] / prog.steps,
                            "ici_bytes": v["ici_bytes"] / prog.steps}
                        for k, v in coll.to_json().items()},
        "collective_bytes": coll.total_bytes / prog.steps,
        "unknown_trip_count_loops": coll.unknown_loops,
        "model_flops": prog.model_flops / prog.steps,
        "hbm_traffic_bytes": traffic / prog.steps,
        "weights_bytes_per_chip": prog.weights_bytes, "state_bytes_per_chip": prog.state_bytes,
        "step_s_roofline": None, "mfu_roofline": None, "roofline": None,
        "xla_cost_analysis": _xla_cost(compiled), "warnings": list(prog.warnings),
        "estimate": True}
    if chip is not None:
        r = roofline(chip, n_chips, model_flops=prog.model_flops / prog.steps,
                     executed_flops=prog.executed_flops / prog.steps,
                     hbm_bytes_per_chip=traffic / prog.steps,
                     ici_bytes_per_chip=coll.total_ici_bytes / prog.steps)
        out.update(step_s_roofline=r.step_s, mfu_roofline=r.mfu, roofline=r.to_json())
    return out


_OOM = re.compile(r"\(([0-9.]+)G\) exceeds available HBM \(([0-9.]+)G\)")
def advice(config: Config, program: str) -> str:
    """The settings that shrink ``program``'s memory, leaving out those already taken."""
    m, t = config.mesh, config.trainer
    more = ["more chips (a larger compile.topology)"]
    if program in ("train", "reference"):
        more.append(f"trainer.microbatches = {2 * t.microbatches}")
        if program == "train" and config.model.remat != "full":
            more.append("model.remat = 'full'")
    elif program == "prefill":
        more.append(f"sampler.prefill_tokens = {max(1, config.sampler.prefill_tokens // 2)}")
    else:
        more.append(f"sampler.slots = {max(1, config.sampler.slots // 2)} or a shorter "
                    f"sampler.max_len (the KV cache)")
    if m.tensor == 1:
        more.append("mesh.tensor > 1 (shards the weights the data axis replicates)")
    return "; ".join(more)


def over_capacity(prog: Program, error: Exception, chip: chips.Chip | None, seconds: float,
                  hint: str) -> dict[str, Any]:
    """compile.json's object for a program the TPU compiler refused for lack of HBM: the
    temporaries it asked for plus the program's own weights and state, and what to change."""
    first = str(error).strip().splitlines()[0]
    m = _OOM.search(first)
    temps = float(m.group(1)) if m else float("nan")
    needed = temps + (prog.weights_bytes + prog.state_bytes) / GiB
    cap = chip.hbm_bytes / GiB if chip else None
    return {"program": prog.name, "compile_s": round(seconds, 2), "steps_per_call": prog.steps,
            "fits": False, "hbm_per_chip_gib": needed, "hbm_capacity_gib": cap,
            "headroom": 1 - needed / cap if cap else None, "error": first,
            "advice": hint, "memory_gib": {"temps": temps}, "collectives": {},
            "collective_bytes": None, "unknown_trip_count_loops": [],
            "model_flops": prog.model_flops / prog.steps, "hbm_traffic_bytes": None,
            "weights_bytes_per_chip": prog.weights_bytes,
            "state_bytes_per_chip": prog.state_bytes, "step_s_roofline": None,
            "mfu_roofline": None, "roofline": None, "xla_cost_analysis": None,
            "warnings": list(prog.warnings), "estimate": True}


def compile_all(config: Config, devices: list[Any], chip: chips.Chip | None,
                names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Compile ``names`` (default: ``compile.programs`` or the job's) on the run's mesh over
    ``devices``; one compile.json object each."""
    model_cfg = resolve_model_config(config.model)
    mesh = create_mesh(config.mesh, devices)
    names = names or config.compile.programs or default_programs(config)
    results = []
    for name in names:
        t0 = time.perf_counter()
        prog = BUILDERS[name](config, model_cfg, mesh)
        try:
            compiled = prog.lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler checks the chip's HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            results.append(over_capacity(prog, e, chip, time.perf_counter() - t0,
                                         advice(config, name)))
        else:
            results.append(analyse(prog, compiled, chip, len(devices),
                                   time.perf_counter() - t0))
            if results[-1]["fits"] is False:
                results[-1]["advice"] = advice(config, name)
        results[-1]["mesh"] = dict(mesh.shape)
    return results


def colocated(config: Config, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """RL with a colocated sampler keeps the train state, the sampler's weights and its KV cache
    in HBM together, and runs one program at a time: its peak per chip is that resident set
    plus the largest program's own temporaries. None when that does not apply or a program is
    missing."""
    by = {r["program"]: r for r in results}
    if (config.compile.job != "rl" or config.rl.placement != "colocated"
            or not {"train", "decode"} <= set(by) or any(r.get("error") for r in results)):
        return None
    resident = (by["train"]["weights_bytes_per_chip"] + by["train"]["state_bytes_per_chip"]
                + by["decode"]["weights_bytes_per_chip"] + by["decode"]["state_bytes_per_chip"])
    if "reference" in by:
        resident += by["reference"]["weights_bytes_per_chip"]  # the frozen copy
    # A program's own share: what it needs beyond the resident buffers it takes as arguments.
    own = {r["program"]: r["hbm_per_chip_gib"] * GiB - r["weights_bytes_per_chip"]
           - r["state_bytes_per_chip"] for r in results}
    peak = resident + max(own.values())
    cap = results[0]["hbm_capacity_gib"]
    out = {"resident_gib": resident / GiB, "peak_gib": peak / GiB,
           "largest_program": max(own, key=own.get), "hbm_capacity_gib": cap,
           "fits": None if cap is None else peak / GiB <= cap,
           "headroom": None if cap is None else 1 - peak / GiB / cap}
    if out["fits"] is False:
        kv = by["decode"]["state_bytes_per_chip"] / GiB
        out["advice"] = (f"{out['peak_gib'] - cap:.1f} GiB over: half the sampler.slots (or "
                         f"sampler.max_len) frees {kv / 2:.1f} GiB of KV cache per chip; or a "
                         f"slice with twice the chips; or rl.placement = 'split'")
    return out


def run(config: Config, workdir: str) -> list[dict[str, Any]]:
    devices, chip, label = target(config.compile)
    _log.info("compiling %s's programs for %s", config.compile.job, label)
    if config.compile.search:
        from meshrl.jobs.compile_search import search

        results, tried = search(config, devices, chip)
    else:
        results, tried = compile_all(config, devices, chip), []
    report = {"target": label, "topology": config.compile.topology or None,
              "chip": chip.name if chip else None, "chip_source": chip.source if chip else None,
              "chips": len(devices), "job": config.compile.job, "programs": results,
              "colocated": colocated(config, results), "search": tried}
    if jax.process_index() == 0:
        path = paths.as_path(workdir) / "compile.json"
        paths.write_text_atomic(path, json.dumps(report, indent=2))
        _log.info("%s\nwritten: %s", table(report), path)
    return results
