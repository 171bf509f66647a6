"""Explicit multi-process start-up. Never called at import: ``main`` calls it first thing."""

from __future__ import annotations

import jax

from meshrl.configs.schema import DistributedConfig
from meshrl.utils import log

_started = False


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Start JAX's multi-controller runtime as ``cfg`` says; True when it is running. Every job
    starts it this way, once (``jobs.dispatch.run``, before the job touches JAX); a second call
    is a no-op.

    Must run before anything touches a JAX backend (creating arrays, listing devices).
    """
    global _started
    if cfg.initialize == "never" or _started:
        return _started
    if cfg.initialize == "auto":
        # Cluster environments (TPU pods, SLURM, Open MPI) supply every argument.
        jax.distributed.initialize()
    else:
        # No cluster detection: under SLURM it would fill ``local_device_ids`` from
        # SLURM_LOCALID and pin each process to one GPU, whatever the node holds.
        jax.distributed.initialize(coordinator_address=cfg.coordinator_address,
                                   num_processes=cfg.num_processes, process_id=cfg.process_id,
                                   cluster_detection_method="deactivate")
    _started = True
    log.set_process_index(jax.process_index())
    log.get_logger("mesh").info("jax.distributed initialised: process %d of %d, %d devices",
                                jax.process_index(), jax.process_count(), jax.device_count())
    return True
