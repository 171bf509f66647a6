"""Print a launch recipe for given sizes; save it to a file and run it on the cluster.

  python launch/recipes/render.py tpu_pod --name my-tpu --zone ZONE --num_hosts 4 \\
      --devices_per_host 4 --config configs/default.py --workdir /shared/run \\
      --repo_dir meshrl --mesh data=8,tensor=2 -- --config.trainer.steps=1000 > run.sh

Subcommands: ``tpu_pod``, ``multislice``, ``slurm_gpu``, ``gke_jobset`` (``--help`` on each).
Arguments after ``--`` are ``--config.section.field=value`` overrides for ``main.py``. A bad
value prints one ``error:`` line naming it and the rule, and exits 2. None of the recipes has
been run on real hardware yet (see BUILD_NOTES.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from meshrl.launch.recipes.common import RecipeError
from meshrl.launch.recipes.jobset import gke_jobset
from meshrl.launch.recipes.slurm import slurm_gpu
from meshrl.launch.recipes.tpu import multislice, tpu_pod

RECIPES: dict[str, Callable[..., str]] = {
    "tpu_pod": tpu_pod, "multislice": multislice, "slurm_gpu": slurm_gpu,
    "gke_jobset": gke_jobset,
}


def parse_pairs(flag: str, text: str | None, value: Callable[[str], object] = str) -> dict:
    """``"a=1,b=2"`` -> ``{"a": value("1"), "b": value("2")}``."""
    out = {}
    for item in (text or "").split(","):
        key, sep, raw = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            parsed = value(raw.strip())
        except ValueError:
            raise RecipeError(f"--{flag} {text!r}: {item!r} must look like key=value"
                              f"{' with an integer value' if value is int else ''}") from None
        if key.strip() in out:
            raise RecipeError(f"--{flag} {text!r}: {key.strip()!r} is given twice")
        out[key.strip()] = parsed
    return out


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="main.py --config (on the hosts)")
    p.add_argument("--workdir", required=True, help="main.py --workdir, reachable by every host")
    p.add_argument("--repo_dir", required=True, help="the meshrl checkout on the hosts")
    p.add_argument("--python", default="python3", help="the interpreter on the hosts")
    p.add_argument("--mesh", help="mesh sizes, e.g. data=8,tensor=2 (dcn_* keys for DCN)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="recipe", required=True)
    p = sub.add_parser("tpu_pod", help="one TPU VM slice, every worker the same command")
    for flag in ("--name", "--zone"):
        p.add_argument(flag, required=True)
    p.add_argument("--project")
    p.add_argument("--num_hosts", type=int, required=True)
    p.add_argument("--devices_per_host", type=int, required=True)
    _common(p)
    p = sub.add_parser("multislice", help="N TPU slices joined over DCN (queued resources)")
    for flag in ("--name", "--zone", "--accelerator_type", "--runtime_version"):
        p.add_argument(flag, required=True)
    p.add_argument("--project")
    for flag in ("--num_slices", "--hosts_per_slice", "--devices_per_host"):
        p.add_argument(flag, type=int, required=True)
    _common(p)
    p = sub.add_parser("slurm_gpu", help="sbatch script, one process per GPU node")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus_per_node", type=int, required=True)
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--job_name", default="meshrl")
    for flag in ("--partition", "--time_limit", "--account"):
        p.add_argument(flag)
    p.add_argument("--setup", action="append", default=[],
                   help="a line the batch script runs first (repeatable)")
    _common(p)
    p = sub.add_parser("gke_jobset", help="JobSet YAML, one pod per host")
    for flag in ("--name", "--image", "--accelerator"):
        p.add_argument(flag, required=True)
    p.add_argument("--num_hosts", type=int, required=True)
    p.add_argument("--devices_per_host", type=int, required=True)
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--max_restarts", type=int, default=0)
    p.add_argument("--node_selector", help="label=value,... of the node pool")
    _common(p)
    return ap


def render(argv: Sequence[str]) -> str:
    """The recipe text for a command line (``--`` separates the main.py overrides)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = vars(_parser().parse_args(argv[:split]))
    recipe = RECIPES[args.pop("recipe")]
    args["mesh"] = parse_pairs("mesh", args["mesh"], int) if args["mesh"] else None
    if args.get("node_selector"):
        args["node_selector"] = parse_pairs("node_selector", args["node_selector"])
    return recipe(**args, overrides=argv[split + 1:])


def main(argv: Sequence[str] | None = None) -> int:
    try:
        text = render(sys.argv[1:] if argv is None else argv)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    # Through the package, so that RecipeError is the recipes' own class.
    from meshrl.launch.recipes.render import main as _main

    sys.exit(_main())
