"""Cloud TPU VM recipes: one TPU pod slice, and several slices joined over DCN (multislice).

Both start JAX with ``distributed.initialize=auto``: every worker runs the same command and
``jax.distributed.initialize()`` reads the rest from the TPU VM (jax/_src/clusters/
cloud_tpu_cluster.py, ``GceTpuCluster``): the worker number and the slice's worker list from the
GCE metadata, and on multislice ``MEGASCALE_COORDINATOR_ADDRESS``, ``MEGASCALE_NUM_SLICES`` and
``MEGASCALE_SLICE_ID`` from the environment or the VM's ``tpu-env`` metadata. Per jax's comment
there, queued resources set those for multislice nodes; the recipe sets no MEGASCALE variable.
Neither recipe has been run on real TPUs (see BUILD_NOTES.md).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from meshrl.launch.recipes.common import (
    RecipeError,
    auto_start,
    devices_text,
    main_argv,
    mesh_overrides,
    require_size,
    require_text,
    shell_path,
)


def _remote_command(repo_dir: str, argv: Sequence[str]) -> str:
    require_text("repo_dir", repo_dir)
    return f"cd {shell_path(repo_dir)} && {shlex.join(argv)}"


def _ssh(node: str, zone: str, project: str | None, command: str) -> str:
    project_flag = f" --project={shlex.quote(project)}" if project else ""
    return (f"gcloud compute tpus tpu-vm ssh {shlex.quote(node)} --zone={shlex.quote(zone)}"
            f"{project_flag} --worker=all --command={shlex.quote(command)}")


def _check_place(name: str, zone: str, project: str | None) -> None:
    require_text("name", name)
    require_text("zone", zone)
    if project is not None:
        require_text("project", project)


def tpu_pod(*, name: str, zone: str, num_hosts: int, devices_per_host: int, config: str,
            workdir: str, repo_dir: str, project: str | None = None, python: str = "python3",
            mesh: Mapping[str, int] | None = None, overrides: Sequence[str] = ()) -> str:
    """A bash script running ``main.py`` on every worker of the TPU VM ``name`` at once
    (``gcloud ... ssh --worker=all``): the same command on all ``num_hosts`` workers, so nothing
    in it depends on the worker. ``devices_per_host`` (JAX devices per worker) only checks
    ``mesh``; ``repo_dir`` is the meshrl checkout on the workers and ``workdir`` should be storage
    every worker reaches."""
    _check_place(name, zone, project)
    require_size("num_hosts", num_hosts)
    require_size("devices_per_host", devices_per_host)
    total, text = devices_text([(num_hosts, "hosts"), (devices_per_host, "devices per host")])
    argv = main_argv(python, config, workdir,
                     [*mesh_overrides(mesh or {}, total, text), *auto_start()], overrides)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# meshrl recipe tpu_pod: TPU VM {name}, {text}.",
        "# Every worker runs the same command; jax.distributed.initialize() takes the process id",
        "# and the coordinator from the TPU VM metadata (distributed.initialize=auto).",
        "set -euo pipefail",
        _ssh(name, zone, project, _remote_command(repo_dir, argv)),
        "",
    ])


def multislice(*, name: str, zone: str, num_slices: int, hosts_per_slice: int,
               devices_per_host: int, accelerator_type: str, runtime_version: str, config: str,
               workdir: str, repo_dir: str, project: str | None = None,
               python: str = "python3", mesh: Mapping[str, int] | None = None,
               overrides: Sequence[str] = ()) -> str:
    """A bash script running ``main.py`` on every worker of ``num_slices`` TPU slices at once,
    with a hybrid mesh: ``mesh`` holds the ICI sizes within a slice, and the recipe adds
    ``mesh.dcn_data = num_slices`` (the data axis spans the slices over DCN).

    The slices are the nodes ``<name>-0`` .. ``<name>-<num_slices - 1>`` of the queued resource
    ``name``, which the comment at the top of the script requests (``--node-count``,
    ``--node-prefix=<name>``: the TPU API names multislice nodes ``<prefix>-<i>``). The per-slice
    ssh calls run in the background together, since no process gets past start-up until all have
    joined; the script exits 1 when any of them fails.
    """
    _check_place(name, zone, project)
    require_size("num_slices", num_slices, minimum=2)
    require_size("hosts_per_slice", hosts_per_slice)
    require_size("devices_per_host", devices_per_host)
    require_text("accelerator_type", accelerator_type)
    require_text("runtime_version", runtime_version)
    mesh = dict(mesh or {})
    dcn = [k for k in mesh if k.startswith("dcn_")]
    if dcn:
        raise RecipeError(f"mesh key {dcn[0]!r}: the multislice recipe sets the DCN sizes "
                          f"itself (mesh.dcn_data = num_slices); give only ICI sizes")
    total, text = devices_text([(num_slices, "slices"), (hosts_per_slice, "hosts per slice"),
                                (devices_per_host, "devices per host")])
    mesh_args = mesh_overrides({**mesh, "dcn_data": num_slices}, total, text)
    command = _remote_command(repo_dir, main_argv(python, config, workdir,
                                                  [*mesh_args, *auto_start()], overrides))
    project_flag = f" --project={shlex.quote(project)}" if project else ""
    create = (f"gcloud compute tpus queued-resources create {shlex.quote(name)} "
              f"--zone={shlex.quote(zone)}{project_flag} "
              f"--accelerator-type={shlex.quote(accelerator_type)} "
              f"--runtime-version={shlex.quote(runtime_version)} --node-count={num_slices} "
              f"--node-prefix={shlex.quote(name)}")
    lines = [
        "#!/usr/bin/env bash",
        f"# meshrl recipe multislice: {name}-0 .. {name}-{num_slices - 1}, {text}; "
        f"mesh.dcn_data = {num_slices}.",
        "# Request the slices once, then wait until `gcloud compute tpus queued-resources "
        f"describe {name} --zone={zone}` says ACTIVE:",
        f"#   {create}",
        "# Every worker of every slice runs the same command (distributed.initialize=auto).",
        "set -uo pipefail",
        "pids=()",
    ]
    for i in range(num_slices):
        lines += [f"{_ssh(f'{name}-{i}', zone, project, command)} &", "pids+=($!)"]
    lines += ["status=0", 'for pid in "${pids[@]}"; do wait "$pid" || status=1; done',
              'exit "$status"', ""]
    return "\n".join(lines)
