"""SLURM multi-node GPU recipe: an sbatch script whose srun step runs ``main.py`` once per node.

One task per node, owning all of that node's GPUs. The start is explicit, not
``distributed.initialize=auto``: jax's SLURM detection (jax/_src/clusters/slurm_cluster.py)
also pins each process to the single GPU ``SLURM_LOCALID`` names, which with one task per node
would leave the node's other GPUs idle, and it derives the coordinator port from the job id
where this recipe takes it as an argument. The coordinator is process 0's host: the first node of
``scontrol show hostnames "$SLURM_JOB_NODELIST"``, where srun's default block distribution puts
task 0. Each task reads its id and the task count from ``SLURM_PROCID`` / ``SLURM_NTASKS``,
which srun sets per task (the variables jax's own SLURM detection reads). Not yet run on a real
SLURM cluster (see BUILD_NOTES.md).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from meshrl.launch.recipes.common import (
    DISTRIBUTED,
    RecipeError,
    devices_text,
    main_argv,
    mesh_overrides,
    require_port,
    require_size,
    require_text,
    shell_path,
)

# Runs in each task: the per-task values are read there, after srun has set them.
_PER_TASK = (f'exec "$@" {DISTRIBUTED}num_processes="$SLURM_NTASKS" '
             f'{DISTRIBUTED}process_id="$SLURM_PROCID"')


def _sbatch_lines(job_name: str, nodes: int, gpus_per_node: int, partition: str | None,
                  time_limit: str | None, account: str | None) -> list[str]:
    require_text("job_name", job_name)
    lines = [f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}"]
    for flag, name, value in (("partition", "partition", partition),
                              ("time", "time_limit", time_limit), ("account", "account", account)):
        if value is not None:
            require_text(name, value)
            lines.append(f"#SBATCH --{flag}={value}")
    for line in lines:
        if any(c.isspace() for c in line[len("#SBATCH "):]):
            raise RecipeError(f"{line!r}: sbatch directive values may not contain whitespace")
    return lines


def slurm_gpu(*, nodes: int, gpus_per_node: int, config: str, workdir: str, repo_dir: str,
              port: int = 8476, job_name: str = "meshrl", partition: str | None = None,
              time_limit: str | None = None, account: str | None = None,
              setup: Sequence[str] = (), python: str = "python3",
              mesh: Mapping[str, int] | None = None, overrides: Sequence[str] = ()) -> str:
    """The sbatch script: ``nodes`` nodes x ``gpus_per_node`` GPUs, one ``main.py`` process per
    node. ``setup`` lines (``module load ...``, ``source venv/bin/activate``) run in the batch
    script before ``cd repo_dir``; ``port`` is any TCP port free on the first node; ``workdir``
    should be on a file system every node mounts."""
    require_size("nodes", nodes)
    require_size("gpus_per_node", gpus_per_node)
    require_port(port)
    require_text("repo_dir", repo_dir)
    for i, line in enumerate(setup):
        require_text(f"setup[{i}]", line)
    total, text = devices_text([(nodes, "nodes"), (gpus_per_node, "GPUs per node")])
    mesh_args = mesh_overrides(mesh or {}, total, text)
    coordinator = f"{DISTRIBUTED}coordinator_address=$COORDINATOR"
    argv = main_argv(python, config, workdir,
                     [*mesh_args, f"{DISTRIBUTED}initialize=explicit", coordinator], overrides)
    # Every word quoted but $COORDINATOR, which the batch script expands once for all tasks.
    words = [shlex.quote(a) for a in argv]
    words[argv.index(coordinator)] = f'{DISTRIBUTED}coordinator_address="$COORDINATOR"'
    return "\n".join([
        "#!/bin/bash",
        *_sbatch_lines(job_name, nodes, gpus_per_node, partition, time_limit, account),
        f"# meshrl recipe slurm_gpu: {text}, one process per node.",
        "set -euo pipefail",
        *setup,
        f"cd {shell_path(repo_dir)}",
        "# Process 0 runs on the first node of the allocation: it hosts the coordinator.",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'COORDINATOR="${{NODES[0]}}:{port}"',
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(_PER_TASK)} meshrl {' '.join(words)}",
        "",
    ])
