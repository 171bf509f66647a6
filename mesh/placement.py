"""Where the RL job's trainer and sampler run (``rl.placement``), as two meshes in one process.

Contract: ``create_meshes(config)`` returns ``(trainer mesh, sampler mesh)``. Colocated: both are
``create_mesh(config.mesh)`` over all devices, except that with ``rl.sampler_expert`` the
sampler mesh keeps the trainer's resolved tensor and expert_tensor sizes, takes that expert size
and fills ``data`` (the same devices, the expert weights sharded further). Split: the last
``rl.sampler_devices`` devices hold the sampler and ``mesh.*`` must multiply to the others; the
sampler mesh keeps the trainer's resolved tensor, expert (or ``rl.sampler_expert``) and
expert_tensor sizes and fills ``data``. A sampler mesh that does not fit its devices raises
``ConfigError`` naming ``rl.sampler_devices`` or ``rl.sampler_expert``; the RL job and
``jobs.dispatch.dry_run`` both call this, so the dry run rejects it too. With several processes
the sampler mesh is this process's devices alone (``_per_process_meshes``). Design:
docs/architecture.md, "Device placement and dispatch".
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config, MeshConfig
from meshrl.mesh import MeshShapeError, create_mesh

_MODEL_AXES = ("tensor", "expert", "expert_tensor")


def split_devices(config: Config, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """``(trainer devices, sampler devices)``: both all devices when colocated, else the first
    ``total - rl.sampler_devices`` and the last ``rl.sampler_devices``."""
    devices = list(jax.devices() if devices is None else devices)
    rl = config.rl
    if rl.placement == "colocated":
        return devices, devices
    n, total = rl.sampler_devices, len(devices)
    if not 0 < n < total:
        raise ConfigError(f"rl.sampler_devices = {n}: must be in [1, {total - 1}] with "
                          f"rl.placement = 'split' on {total} devices (the trainer needs at "
                          f"least one device of its own)")
    return devices[:total - n], devices[total - n:]


def sampler_mesh_config(config: Config, trainer_mesh: Mesh) -> MeshConfig:
    """The sampler's mesh config: ``config.mesh`` when colocated without
    ``rl.sampler_expert``; otherwise the trainer's resolved model-parallel sizes (expert:
    ``rl.sampler_expert`` when set) with ``data`` filling the sampler's devices."""
    if config.rl.placement == "colocated" and not config.rl.sampler_expert:
        return config.mesh
    return _model_parallel_of(trainer_mesh, config.rl.sampler_expert)


def _model_parallel_of(mesh: Mesh, expert: int = 0) -> MeshConfig:
    """``mesh``'s resolved tensor, expert (``expert`` when > 0) and expert_tensor sizes, with
    ``data`` filling."""
    sizes = {a: int(mesh.shape[a]) for a in _MODEL_AXES}
    return MeshConfig(data=-1, **{**sizes, **({"expert": expert} if expert else {})})


def process_sampler_mesh(global_mesh: Mesh, expert: int = 0) -> Mesh:
    """A sampler mesh over this process's devices alone, with ``global_mesh``'s resolved
    tensor, expert (``expert`` when > 0: ``rl.sampler_expert``) and expert_tensor sizes and
    ``data`` filling the rest: no collective crosses processes inside it, so each process
    schedules its decoding on its own. The RL and sample jobs use it when there are several
    processes."""
    sampler_cfg = _model_parallel_of(global_mesh, expert)
    local = jax.local_devices()
    try:
        return create_mesh(sampler_cfg, local)
    except MeshShapeError as e:
        sizes = ", ".join(f"{'rl.sampler_expert' if a == 'expert' and expert else 'mesh.' + a}"
                          f" = {getattr(sampler_cfg, a)}" for a in _MODEL_AXES)
        raise ConfigError(f"{sizes}: with several processes each process's sampler keeps "
                          f"these sizes on its own {len(local)} devices, so their product must "
                          f"divide {len(local)} ({e})") from e


def colocated_sampler_mesh(config: Config, trainer_mesh: Mesh,
                           devices: Sequence[jax.Device]) -> Mesh:
    """The colocated sampler's mesh over ``devices`` (the trainer's): ``trainer_mesh`` itself
    unless ``rl.sampler_expert`` reshapes it, which must then fit the devices."""
    n = config.rl.sampler_expert
    if not n:
        return trainer_mesh
    sampler_cfg = sampler_mesh_config(config, trainer_mesh)
    try:
        return create_mesh(sampler_cfg, devices)
    except MeshShapeError as e:
        raise ConfigError(f"rl.sampler_expert = {n}: with mesh.tensor = {sampler_cfg.tensor} "
                          f"and mesh.expert_tensor = {sampler_cfg.expert_tensor} the sampler "
                          f"needs a multiple of {n * sampler_cfg.tensor * sampler_cfg.expert_tensor}"
                          f" devices, and has {len(devices)} ({e})") from e


def _per_process_meshes(config: Config) -> tuple[Mesh, Mesh]:
    """Several processes: the trainer mesh over every device, and on each process a sampler
    mesh over its own devices (``process_sampler_mesh``)."""
    if config.rl.placement != "colocated":
        raise ConfigError(f"rl.placement = {config.rl.placement!r}: with "
                          f"{jax.process_count()} processes only 'colocated' is built (each "
                          f"process samples on its own devices)")
    trainer_mesh = create_mesh(config.mesh)
    return trainer_mesh, process_sampler_mesh(trainer_mesh, config.rl.sampler_expert)


def create_meshes(config: Config, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[Mesh, Mesh]:
    """``(trainer mesh, sampler mesh)`` for ``rl.placement``; a split that does not fit the
    devices raises ConfigError naming ``rl.sampler_devices`` and the mesh sizes."""
    if jax.process_count() > 1 and devices is None:
        return _per_process_meshes(config)
    trainer_devices, sampler_devices = split_devices(config, devices)
    if config.rl.placement == "colocated":
        trainer_mesh = create_mesh(config.mesh, trainer_devices)
        sampler_mesh = create_mesh(config.mesh, sampler_devices)
        return trainer_mesh, colocated_sampler_mesh(config, sampler_mesh, sampler_devices)
    n, total = config.rl.sampler_devices, len(trainer_devices) + len(sampler_devices)
    try:
        trainer_mesh = create_mesh(config.mesh, trainer_devices)
    except MeshShapeError as e:
        raise ConfigError(f"{e} -- rl.placement = 'split' with rl.sampler_devices = {n} leaves "
                          f"{len(trainer_devices)} of the {total} devices to the trainer; set "
                          f"mesh.* to multiply to {len(trainer_devices)} (or use a -1 fill)"
                          ) from e
    sampler_cfg = sampler_mesh_config(config, trainer_mesh)
    try:
        sampler_mesh = create_mesh(sampler_cfg, sampler_devices)
    except MeshShapeError as e:
        sizes = ", ".join(f"{a}={getattr(sampler_cfg, a)}" for a in _MODEL_AXES)
        kept = "its " if config.rl.sampler_expert else "the trainer's "
        raise ConfigError(f"rl.sampler_devices = {n}: the sampler keeps {kept}{sizes} "
                          f"and needs a multiple of their product in devices ({e})") from e
    return trainer_mesh, sampler_mesh
