"""What every recipe shares: input checks and the ``main.py`` command line each host runs."""

from __future__ import annotations

import math
import shlex
import unicodedata
from collections.abc import Mapping, Sequence

from meshrl.configs.overrides import check_override_keys
from meshrl.configs.schema import MESH_AXES

MESH_KEYS = (*MESH_AXES, *(f"dcn_{a}" for a in MESH_AXES))
DISTRIBUTED = "--config.distributed."


class RecipeError(ValueError):
    """A recipe input that cannot give a working launch; the message names the value and rule."""


def require_size(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RecipeError(f"{name} = {value!r}: must be an integer >= {minimum}")


def require_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise RecipeError(f"{name} = {value!r}: must be a non-empty string")
    refuse_control_characters(name, value)


def refuse_control_characters(name: str, value: str) -> None:
    """Recipes put names, zones and comments into shell lines unquoted (comments, ``#SBATCH``):
    a newline there would start a line of its own that the script runs."""
    bad = sorted({c for c in value if unicodedata.category(c) == "Cc"})
    if bad:
        raise RecipeError(f"{name} = {value!r}: must not contain control characters (found "
                          f"{', '.join(repr(c) for c in bad)}): a recipe value is one line of "
                          f"text")


def require_port(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise RecipeError(f"port = {value!r}: must be a TCP port, an integer in 1..65535")


def shell_path(path: str) -> str:
    """``path`` quoted for bash, a leading ``~/`` left bare so that it still expands."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return "~/" + (shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def mesh_overrides(mesh: Mapping[str, int], devices: int, described: str) -> list[str]:
    """``--config.mesh.<key>=<size>`` for each entry of ``mesh`` (ICI keys ``data``..., DCN keys
    ``dcn_data``...; -1 fills). Keys left out keep the config file's values, so only what is
    always necessary is checked: at most one -1 per list and the given sizes divide ``devices``."""
    for key, size in mesh.items():
        if key not in MESH_KEYS:
            raise RecipeError(f"mesh key {key!r}: not a mesh axis; valid keys: "
                              f"{', '.join(MESH_KEYS)}")
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise RecipeError(f"mesh.{key} = {size!r}: must be an integer >= 1, or -1 to fill")
    for prefix, kind in (("dcn_", "DCN"), ("", "ICI")):
        fills = [k for k in mesh if k.startswith("dcn_") == bool(prefix) and mesh[k] == -1]
        if len(fills) > 1:
            raise RecipeError(f"mesh: at most one -1 fill per {kind} list, got -1 for "
                              f"{', '.join('mesh.' + k for k in fills)}")
    given = math.prod(s for s in mesh.values() if s != -1)
    if devices % given:
        sizes = " x ".join(f"{k}={s}" for k, s in mesh.items() if s != -1)
        raise RecipeError(f"mesh sizes {sizes} = {given} do not divide the {described}: "
                          f"the mesh sizes must multiply to the device count")
    ordered = sorted(mesh, key=MESH_KEYS.index)
    return [f"--config.mesh.{k}={mesh[k]}" for k in ordered]


def devices_text(parts: Sequence[tuple[int, str]]) -> tuple[int, str]:
    """``((4, 'hosts'), (8, 'devices per host'))`` -> ``(32, '32 devices (4 hosts x 8 devices
    per host)')``."""
    total = math.prod(n for n, _ in parts)
    return total, f"{total} devices ({' x '.join(f'{n} {what}' for n, what in parts)})"


def _key(arg: str) -> str:
    return arg.split("=", 1)[0]


def check_overrides(overrides: Sequence[str], recipe_args: Sequence[str]) -> None:
    """Each override is ``--config.section.field=value`` with a schema key, and none repeats a
    key the recipe sets itself (the mesh sizes, ``distributed.*``)."""
    for i, arg in enumerate(overrides):
        if not isinstance(arg, str) or not arg.startswith("--config.") or "=" not in arg:
            raise RecipeError(f"overrides[{i}] = {arg!r}: must look like "
                              f"--config.section.field=value")
        refuse_control_characters(f"overrides[{i}]", arg)
    error = check_override_keys(overrides)
    if error:
        raise RecipeError(error)
    owned = {_key(a) for a in recipe_args}
    for arg in overrides:
        if _key(arg) in owned or arg.startswith(DISTRIBUTED):
            raise RecipeError(f"override {arg!r}: the recipe sets {_key(arg)[9:]} itself (mesh "
                              f"sizes go in its mesh argument, distributed.* is its job)")


def main_argv(python: str, config: str, workdir: str, recipe_args: Sequence[str],
              overrides: Sequence[str]) -> list[str]:
    """``python main.py --config CFG --workdir W <recipe_args> <overrides>``, inputs checked."""
    require_text("python", python)
    require_text("config", config)
    require_text("workdir", workdir)
    check_overrides(overrides, recipe_args)
    return [python, "main.py", "--config", config, "--workdir", workdir, *recipe_args,
            *overrides]


def auto_start() -> list[str]:
    """Every argument of ``jax.distributed.initialize()`` comes from the cluster environment."""
    return [f"{DISTRIBUTED}initialize=auto"]


def explicit_start(coordinator: str, num_processes: str, process_id: str) -> list[str]:
    """The explicit start; the values may be shell or Kubernetes expressions."""
    return [f"{DISTRIBUTED}initialize=explicit", f"{DISTRIBUTED}coordinator_address={coordinator}",
            f"{DISTRIBUTED}num_processes={num_processes}", f"{DISTRIBUTED}process_id={process_id}"]
