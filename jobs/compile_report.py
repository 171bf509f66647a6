"""The compile job's console table: pure text from compile.json's report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
          "collective-permute": "CP"}


def _collectives(entry: Mapping[str, Any]) -> str:
    parts = [f"{_SHORT[k]} {v['bytes'] / 1e9:.3g} GB" for k, v in entry["collectives"].items()]
    return ", ".join(parts) or "none"


def _fit(entry: Mapping[str, Any]) -> str:
    if entry["fits"] is None:
        return "n/a"
    return f"{'yes' if entry['fits'] else 'NO'} ({entry['headroom']:+.0%})"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3g}"


def _colocated_line(both: Mapping[str, Any], fit: str) -> str:
    """The colocated RL peak: per phase when the KV cache is freed for the train step."""
    tail = (f"peak {both['peak_gib']:.1f} GiB/chip in the {both['peak_phase']} phase "
            f"({both['resident_gib']:.1f} held + {both['largest_program']}'s temporaries): "
            f"{fit}" + (f"; {both['advice']}" if both.get("advice") else ""))
    if not both["kv_cache_released"]:
        return ("colocated RL (train state + sampler weights + KV cache resident, then the "
                "largest program): " + tail)
    ph, w = both["phases_gib"], both["sampler_weights_gib"]
    if both.get("sampler_weights_released"):
        return (f"colocated RL, KV cache and sampler weights freed for the train step: train "
                f"phase {ph['train']:.1f} GiB (train state + step temporaries), sampling phase "
                f"{ph['sampling']:.1f} GiB (+ {w:.1f} sampler weights + "
                f"{both['kv_cache_gib']:.1f} KV cache + sampler temporaries); " + tail)
    return (f"colocated RL, KV cache freed for the train step: train phase {ph['train']:.1f} "
            f"GiB (train state + {w:.1f} sampler weights + step temporaries), sampling phase "
            f"{ph['sampling']:.1f} GiB (+ {both['kv_cache_gib']:.1f} KV cache + sampler "
            f"temporaries); " + tail)


def table(report: Mapping[str, Any]) -> str:
    """One header line (target, chip figures and source), one line per program, and the line
    that says these are estimates."""
    chip = report["chip"]
    lines = [f"compile: {report['job']} programs for {report['target']}"
             + (f"; chip {chip} figures from {report['chip_source']}" if chip else
                "; no chip figures for this device kind: memory and collectives only")]
    head = (f"{'program':<14} {'HBM/chip GiB':>12} {'of':>6} {'fits':>12} {'TFLOP/step*':>11} "
            f"{'HBM GB/step':>11} {'compute/hbm/coll ms':>22} {'step ms':>8} {'MFU':>5} "
            f"{'bound':>11}  collectives/step")
    lines.append(head)
    for e in report["programs"]:
        if e.get("error"):
            lines.append(f"{e['program']:<14} {e['hbm_per_chip_gib']:>12.3f} "
                         f"{e['hbm_capacity_gib'] or 0:>6.1f} {_fit(e):>12}  refused by the "
                         f"compiler: {e['error'][:120]}")
            continue
        r = e["roofline"] or {}
        times = "/".join(_ms(r.get(k)) for k in ("compute_s", "hbm_s", "collective_s"))
        cap = "-" if e["hbm_capacity_gib"] is None else f"{e['hbm_capacity_gib']:.1f}"
        mfu = "-" if e["mfu_roofline"] is None else f"{e['mfu_roofline']:.0%}"
        lines.append(
            f"{e['program']:<14} {e['hbm_per_chip_gib']:>12.3f} {cap:>6} {_fit(e):>12} "
            f"{e['model_flops'] / 1e12:>11.4g} {e['hbm_traffic_bytes'] / 1e9:>11.4g} "
            f"{times:>22} {_ms(e['step_s_roofline']):>8} {mfu:>5} {r.get('bound', '-'):>11}  "
            f"{_collectives(e)}")
    for e in report["programs"]:
        if e.get("advice"):
            over = e["hbm_per_chip_gib"] - (e["hbm_capacity_gib"] or 0)
            lines.append(f"  {e['program']} does not fit: {over:.1f} GiB per chip over; try "
                         f"{e['advice']}")
        for w in e.get("warnings", []):
            lines.append(f"  {e['program']}: {w}")
        if e["unknown_trip_count_loops"]:
            lines.append(f"  {e['program']}: loops counted once (trip count unknown): "
                         f"{', '.join(e['unknown_trip_count_loops'][:5])}")
        if e.get("unknown_replica_groups"):
            lines.append(f"  {e['program']}: collectives whose replica groups could not be read "
                         f"(link bytes charged as the whole buffer, an upper bound): "
                         f"{', '.join(e['unknown_replica_groups'][:5])}")
    both = report.get("colocated")
    if both:
        fit = "n/a" if both["fits"] is None else (
            f"{'fits' if both['fits'] else 'DOES NOT FIT'} ({both['headroom']:+.0%})")
        lines.append(_colocated_line(both, fit))
    if report.get("search"):
        lines.append(f"mesh search: {len(report['search'])} meshes tried (compile.json 'search')")
    lines.append("Per step on one chip, except *: the model's TFLOP a step on all chips. Step "
                 "time and MFU are roofline estimates (max of compute, HBM and collective "
                 "time, perfect overlap), not measurements.")
    return "\n".join(lines)
