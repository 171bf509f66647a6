"""The compile job's mesh search (``compile.search = true``).

Enumerates the ICI splits of the trainer's devices (all of them, or with ``rl.placement =
'split'`` all but ``rl.sampler_devices``) over ``data`` (FSDP: params sharded over it),
``tensor``, ``context`` and ``expert`` (this last one for MoE models only), the config's
``mesh.dcn_*`` sizes kept (the ICI sizes cover the devices within one DCN unit). A split is
refused before compiling when the config's rules refuse it (``ConfigError``: e.g. tensor must
divide the KV heads, expert the experts) or the run would (its meshes, and ``TrainEngine``'s
check that each process loads whole rows of the batch: ``program_meshes``). Of the others it
compiles at most ``MAX_COMPILED`` train steps, fewest model-parallel devices first (a cheap
prior: pure FSDP moves the fewest bytes per step when it fits), and picks the fastest that fits
by the roofline. Then it compiles the job's programs on that mesh. Every candidate, compiled or
refused, is listed with its reason in compile.json's ``search``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from meshrl.aot.chips import Chip
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.jobs.compile_programs import program_meshes
from meshrl.mesh import MeshShapeError
from meshrl.mesh.mesh import resolve_shapes
from meshrl.mesh.placement import split_devices
from meshrl.utils import log
from meshrl.utils.errors import UserError

_log = log.get_logger("compile")
MAX_COMPILED = 6  # train-step compiles a search may spend (tens of seconds each at 8B+)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ici_devices(config: Config, devices: list[Any]) -> int:
    """Devices the search splits over the ICI axes: the trainer's devices (``split_devices``
    for RL) over the product of the config's resolved ``mesh.dcn_*`` sizes, which it keeps."""
    trainer = split_devices(config, devices)[0] if config.compile.job == "rl" else devices
    only_dcn = dataclasses.replace(config.mesh, data=-1, tensor=1, context=1, expert=1,
                                   expert_tensor=1)
    _, dcn = resolve_shapes(only_dcn, trainer)
    return len(trainer) // math.prod(dcn)


def candidates(config: Config, n: int) -> list[tuple[Config | None, dict[str, int], str]]:
    """(config with that mesh or None, the split, why refused) for every split of ``n`` ICI
    devices (``ici_devices``); the config's DCN sizes stay."""
    moe = config.model.num_experts > 0
    out = []
    for tensor, context, expert in itertools.product(_divisors(n), repeat=3):
        if n % (tensor * context * expert) or (expert > 1 and not moe):
            continue
        split = {"data": n // (tensor * context * expert), "tensor": tensor,
                 "context": context, "expert": expert}
        mesh = dataclasses.replace(config.mesh, **split, expert_tensor=1,
                                   fsdp=split["data"] > 1 or config.mesh.fsdp)
        try:
            out.append((dataclasses.replace(config, mesh=mesh), split, ""))
        except ConfigError as e:
            out.append((None, split, str(e)))
    # Fewest model-parallel devices first; among equals, experts before tensor before context.
    out.sort(key=lambda c: (c[1]["data"] == 0, -c[1]["data"], c[1]["context"], c[1]["tensor"]))
    return out


CompileAll = Callable[..., list[dict[str, Any]]]  # jobs.compile.compile_all


def search(config: Config, devices: list[Any], chip: Chip | None, compile_all: CompileAll
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the job's programs compiled on the chosen mesh, the table of what was tried);
    ``compile_all(config, devices, chip, programs=...)`` compiles one candidate."""

    if chip is None:
        raise UserError("compile.search = True: needs a chip's figures (a compile.topology, "
                        "or a local TPU/GPU), for the roofline that ranks the meshes")
    tried, best = [], None
    for cand, split, why in candidates(config, ici_devices(config, devices)):
        row: dict[str, Any] = {"mesh": split, "compiled": False, "refused": why or None}
        if cand is not None:
            try:
                program_meshes(cand, devices)  # the run's meshes and batch-row check
            except (MeshShapeError, ConfigError) as e:
                cand, row["refused"] = None, str(e)
        if cand is None:
            _log.info("mesh %s: refused: %s", split, row["refused"])
        elif sum(r["compiled"] for r in tried) < MAX_COMPILED:
            t0 = time.perf_counter()
            try:
                (train,) = compile_all(cand, devices, chip, ("train",))
            except (ValueError, TypeError) as e:  # a split the model code cannot shard
                row["refused"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            else:
                # A program the compiler refused for HBM has no roofline: it does not fit.
                roofline = train["roofline"] or {}
                row.update(compiled=True, fits=train["fits"], headroom=train["headroom"],
                           hbm_per_chip_gib=train["hbm_per_chip_gib"],
                           step_s_roofline=train["step_s_roofline"],
                           mfu_roofline=train["mfu_roofline"], bound=roofline.get("bound"))
                if train["fits"] and (best is None or train["step_s_roofline"]
                                      < best[1]["step_s_roofline"]):
                    best = (cand, row)
            _log.info("mesh %s: %s (%.0f s)", split, _summary(row), time.perf_counter() - t0)
        else:
            row["refused"] = f"not compiled: the search compiles at most {MAX_COMPILED}"
        tried.append(row)
    if not any(r["compiled"] for r in tried):
        raise UserError(f"compile.search: none of the {len(tried)} meshes is valid on "
                        f"{len(devices)} x {chip.name}: each was refused before its train step "
                        f"compiled (logged above); the first: {tried[0]['refused']}")
    if best is None:
        raise UserError(f"compile.search: none of the {len(tried)} meshes tried fits on "
                        f"{len(devices)} x {chip.name}; see the table above: a larger topology, "
                        f"fewer sequences per step (trainer.microbatches), or model.remat=full")
    best[1]["chosen"] = True
    return compile_all(best[0], devices, chip), tried


def _summary(row: dict[str, Any]) -> str:
    if not row["compiled"]:
        return f"refused: {row['refused']}"
    if row["step_s_roofline"] is None:
        return f"{row['hbm_per_chip_gib']:.1f} GiB/chip asked: refused by the compiler"
    return (f"{row['hbm_per_chip_gib']:.1f} GiB/chip, fits {row['fits']}, roofline step "
            f"{row['step_s_roofline'] * 1e3:.1f} ms, MFU {row['mfu_roofline']:.0%}, "
            f"{row['bound']}-bound")
