"""Regenerate docs/scale.md's tables: the compile job for each real-size recipe x TPU slice.

  python scripts/scale_table.py --out /tmp/meshrl_scale          # compile what is missing
  python scripts/scale_table.py --out /tmp/meshrl_scale --render  # tables only

Each row is ``python main.py --config configs/<file>.py:<variant>@<slice> --config.job=compile
--workdir <out>/<file>_<variant>_<slice> [--config.<override>]`` (its compile.json is kept and
reused), then one markdown table per recipe is printed, with the colocated RL peak
(``jobs.compile.colocated``) under each GRPO slice. Needs the tpu extra; every figure is an estimate.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (config file, variant, slice, overrides): the recipes as written; overrides are
# ``section.field=value`` settings on top of the recipe, shown in the mesh column.
Row = tuple[str, str, str, tuple[str, ...]]
ROWS: list[Row] = [
    ("llama3_8b", "grpo", "v5p-8", ()), ("llama3_8b", "grpo", "v5p-16", ()),
    ("llama3_8b", "grpo", "v6e-8", ()),
    ("llama3_8b", "sft", "v5p-8", ()), ("qwen3_8b", "grpo", "v5p-8", ()),
    ("qwen3_30b_a3b", "grpo", "v5p-16", ()), ("llama3_70b", "sft", "v5p-64", ())]


def _workdir(out: pathlib.Path, row: Row) -> pathlib.Path:
    name, variant, slice_, overrides = row
    tag = "".join(f"_{o.replace('=', '')}" for o in overrides)
    return out / f"{name}_{variant}_{slice_}{tag}"


def config_argv(row: Row) -> list[str]:
    """main.py's ``--config`` flags of a row: the recipe, the compile job, its overrides."""
    name, variant, slice_, overrides = row
    return ["--config", f"{ROOT / 'configs' / name}.py:{variant}@{slice_}",
            "--config.job=compile", *(f"--config.{o}" for o in overrides)]


def compile_row(out: pathlib.Path, row: Row) -> pathlib.Path:
    workdir = _workdir(out, row)
    if not (workdir / "compile.json").exists():
        cmd = [sys.executable, str(ROOT / "main.py"), *config_argv(row), f"--workdir={workdir}"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return workdir / "compile.json"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.1f}"


def row_lines(row: Row, report: dict) -> list[str]:
    name, variant, slice_, overrides = row
    lines = []
    for e in report["programs"]:
        mesh_s = _mesh_s(e.get("mesh") or {}, overrides)  # the sampler's may be its own
        r = e["roofline"] or {}
        fit = ("yes" if e["fits"] else "**no**") + (
            f" ({e['headroom']:+.0%})" if e["headroom"] is not None else "")
        coll = ", ".join(f"{k} {v['bytes'] / 1e9:.1f}" for k, v in e["collectives"].items()
                         if v["bytes"] >= 0.05e9)
        times = " / ".join(f"{r[k] * 1e3:.0f}" for k in ("compute_s", "hbm_s", "collective_s")
                           ) if r else "-"
        step = "-" if e["step_s_roofline"] is None else f"{e['step_s_roofline'] * 1e3:.0f}"
        mfu = "-" if e["mfu_roofline"] is None else f"{e['mfu_roofline']:.0%}"
        lines.append(
            f"| {slice_} | {mesh_s} | {e['program']} | {e['hbm_per_chip_gib']:.1f} of "
            f"{e['hbm_capacity_gib']:.0f} | {fit} | {times} | {step} | {mfu} | "
            f"{r.get('bound', '-')} | {_gb(e['hbm_traffic_bytes'])} | {coll or '-'} | "
            f"{e.get('advice', '')} |")
    both = _colocated(row, report)
    if both:
        mesh_s = _mesh_s(report["programs"][0].get("mesh") or {}, overrides)
        fit = ("yes" if both["fits"] else "**no**") + f" ({both['headroom']:+.0%})"
        lines.append(f"| {slice_} | {mesh_s} | **colocated RL** | {both['peak_gib']:.1f} of "
                     f"{both['hbm_capacity_gib']:.0f} | {fit} | | | | | | | "
                     f"{both.get('advice', '')} |")
    return lines


def _mesh_s(mesh: dict, overrides: tuple[str, ...]) -> str:
    return (", ".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "1 chip") + "".join(
        f", {o}" for o in overrides)


def _colocated(row: Row, report: dict) -> dict | None:
    """The colocated RL peak of a row (``jobs.compile.colocated`` on its config, parsed from the
    row's flags as main.py parses them: ``rl.x=false`` is False, not ``bool('false')``)."""
    from meshrl.configs.overrides import config_from_argv
    from meshrl.jobs.compile import colocated

    return colocated(config_from_argv(config_argv(row)), report["programs"])


HEADER = ("| slice | mesh | program | HBM/chip GiB | fits (headroom) | compute / HBM / "
          "collectives ms | step ms | MFU | bound | HBM GB/step | collectives GB/step | "
          "if it does not fit |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def render(out: pathlib.Path) -> str:
    parts = []
    for recipe in dict.fromkeys(r[:2] for r in ROWS):
        parts += [f"### `configs/{recipe[0]}.py:{recipe[1]}`", "", HEADER]
        for row in (r for r in ROWS if r[:2] == recipe):
            path = _workdir(out, row) / "compile.json"
            if path.exists():
                parts += row_lines(row, json.loads(path.read_text()))
        parts.append("")
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--render", action="store_true", help="only print the tables")
    args = ap.parse_args()
    if not args.render:
        for row in ROWS:
            compile_row(args.out, row)
    print(render(args.out))


if __name__ == "__main__":
    main()
