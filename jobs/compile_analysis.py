"""One compiled program's entry in compile.json: per-chip HBM against the chip's capacity,
collectives and HBM traffic counted from the compiled HLO, the roofline estimate, XLA's own cost
analysis; or, for a program the TPU compiler refused for lack of HBM, what it asked for and the
settings to change."""

from __future__ import annotations

import re
from typing import Any

from meshrl.aot import chips, hlo
from meshrl.aot.roofline import roofline
from meshrl.configs.schema import Config
from meshrl.jobs.compile_programs import Program

GiB = 2 ** 30
XLA_COST_NOTE = ("XLA's cost model, per chip and per call: counts a loop body (scanned layers, "
                 "decode steps) once and does not see inside custom kernels; not a step time")


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
        # Per model step, like every other figure: a decode chunk's collectives over its steps
        # (``largest`` is one buffer, not a rate). A count outside the chunk's loop shows as a
        # fraction of a step.
        "collectives": {k: {**v, "count": v["count"] / prog.steps,
                            "bytes": v["bytes"] / prog.steps,
                            "ici_bytes": v["ici_bytes"] / prog.steps}
                        for k, v in coll.to_json().items()},
        "collective_bytes": coll.total_bytes / prog.steps,
        "unknown_trip_count_loops": coll.unknown_loops,
        "unknown_replica_groups": coll.unknown_groups,
        "model_flops": prog.model_flops / prog.steps,  # all chips; the rest is per chip
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
    elif program in ("prefill", "reprefill", "reprefill_tail"):
        more.append(f"sampler.prefill_tokens = {max(1, config.sampler.prefill_tokens // 2)}")
    else:
        more.append(f"sampler.slots = {max(1, config.sampler.slots // 2)} or a shorter "
                    f"sampler.max_len (the KV cache)")
    if m.tensor == 1:
        more.append("mesh.tensor > 1 (shards the weights the data axis replicates)")
    return "; ".join(more)


def over_capacity(prog: Program, error: Exception, chip: chips.Chip | None, seconds: float,
                  hint: str) -> dict[str, Any]:
    """compile.json's object for a program the TPU compiler refused for lack of HBM: what it
    asked for, and what to change. The compiler's figure ("HLO temporaries (X G)") is already
    the whole footprint, its arguments included (checked by tests/jobs/test_compile_tpu.py)."""
    first = str(error).strip().splitlines()[0]
    m = _OOM.search(first)
    needed = float(m.group(1)) if m else float("nan")
    cap = chip.hbm_bytes / GiB if chip else None
    return {"program": prog.name, "compile_s": round(seconds, 2), "steps_per_call": prog.steps,
            "fits": False, "hbm_per_chip_gib": needed, "hbm_capacity_gib": cap,
            "headroom": 1 - needed / cap if cap else None, "error": first,
            "advice": hint, "memory_gib": {"total": needed}, "collectives": {},
            "collective_bytes": None, "unknown_trip_count_loops": [],
            "unknown_replica_groups": [],
            "model_flops": prog.model_flops / prog.steps, "hbm_traffic_bytes": None,
            "weights_bytes_per_chip": prog.weights_bytes,
            "state_bytes_per_chip": prog.state_bytes, "step_s_roofline": None,
            "mfu_roofline": None, "roofline": None, "xla_cost_analysis": None,
            "warnings": list(prog.warnings), "estimate": True}
