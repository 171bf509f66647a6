"""The named 5-axis device mesh: data, tensor, context, expert, expert_tensor.

Each axis has an ICI size (inside a slice/host) and a DCN size (across slices/hosts); the mesh
axis is their product, DCN outermost. One exception, hybrid sharding: with ``mesh.fsdp`` and a
DCN data size above 1 the data axis stays split, as an outer ``dcn_data`` axis and the ICI
``data`` axis, so the trainer can shard params over ICI and replicate them over DCN (HSDP).
Nothing here runs at import time: callers build the mesh explicitly and pass it down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding

from meshrl.configs.schema import DCN_DATA_AXIS, MESH_AXES, MeshConfig
from meshrl.utils.errors import UserError


class MeshShapeError(UserError, ValueError):
    """The configured axis sizes do not match the devices."""


def _describe(cfg: MeshConfig) -> str:
    ici = " ".join(f"{a}={s}" for a, s in zip(MESH_AXES, cfg.ici_shape))
    dcn = " ".join(f"dcn_{a}={s}" for a, s in zip(MESH_AXES, cfg.dcn_shape))
    return f"ICI [{ici}] x DCN [{dcn}]"


def _multislice(devices: Sequence[jax.Device]) -> bool:
    # CPU and single-slice devices may carry a slice_index too (all 0): then the processes are
    # the units DCN spans, not the one slice.
    slices = {getattr(d, "slice_index", None) for d in devices}
    return None not in slices and len(slices) > 1


def _num_granules(devices: Sequence[jax.Device]) -> int:
    """Slices on TPU multislice, else processes: the units DCN axes span."""
    if _multislice(devices):
        return len({d.slice_index for d in devices})
    return len({d.process_index for d in devices})


def _fill(sizes: tuple[int, ...], total: int, cfg: MeshConfig, what: str) -> tuple[int, ...]:
    """``sizes`` with its -1 (if any) so that they multiply to ``total`` (``what``: its unit)."""
    known = math.prod(s for s in sizes if s != -1)
    if -1 not in sizes:
        return sizes
    if known == 0 or total % known:
        raise MeshShapeError(f"mesh: cannot fill -1: {_describe(cfg)}: the other sizes of that "
                             f"list multiply to {known}, which does not divide {total} ({what})")
    return tuple(total // known if s == -1 else s for s in sizes)


def _units(devices: Sequence[jax.Device]) -> str:
    return "slices" if _multislice(devices) else "processes"


def resolve_shapes(cfg: MeshConfig, devices: Sequence[jax.Device]) -> tuple[
        tuple[int, ...], tuple[int, ...]]:
    """Resolve -1 fills to concrete ``(ici_shape, dcn_shape)``; fail on a device-count mismatch."""
    n, units = len(devices), _num_granules(devices)
    dcn = _fill(cfg.dcn_shape, units, cfg, f"the {units} {_units(devices)} DCN spans")
    if units > 1 and math.prod(dcn) not in (1, units):
        # Several hosts or slices: DCN axes must span exactly them, or the device array would
        # put "DCN" neighbours inside one host (the blocks below are for one process only).
        raise MeshShapeError(f"mesh: {_describe(cfg)}: the mesh.dcn_* sizes multiply to "
                             f"{math.prod(dcn)}, but the devices span {units} "
                             f"{_units(devices)}: make their product {units} (or 1), and size "
                             f"what lies within one in the ICI sizes")
    if n % math.prod(dcn):
        raise MeshShapeError(f"mesh: {_describe(cfg)} needs a multiple of {math.prod(dcn)} "
                             f"devices across DCN, but {n} devices are available: make the "
                             f"product of the mesh.dcn_* sizes divide {n}")
    ici = _fill(cfg.ici_shape, n // math.prod(dcn), cfg,
                f"the devices per DCN unit: {n} devices / {math.prod(dcn)}")
    if math.prod(ici) * math.prod(dcn) != n:
        want = math.prod(ici) * math.prod(dcn)
        hint = (f" (to rehearse it on a CPU, fake {want} devices: XLA_FLAGS="
                f"--xla_force_host_platform_device_count={want})"
                if want > n and devices[0].platform == "cpu" else "")
        raise MeshShapeError(
            f"mesh: {_describe(cfg)} multiplies to {want} devices, but {n} devices are "
            f"available: make the product of all axis sizes equal {n}{hint}")
    return ici, dcn


def _hybrid_device_array(ici: tuple[int, ...], dcn: tuple[int, ...],
                         devices: Sequence[jax.Device]) -> np.ndarray:
    if _multislice(devices):
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True)
    if len({d.process_index for d in devices}) == math.prod(dcn):
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True)
    # Fake CPU devices in one process have no slices: treat contiguous blocks of devices as the
    # DCN granules, so multi-slice layouts can be exercised in tests.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    arr = np.array(ordered, dtype=object).reshape(dcn + ici)
    k = len(ici)
    arr = arr.transpose([ax for i in range(k) for ax in (i, k + i)])
    return arr.reshape([d * i for d, i in zip(dcn, ici)])


def create_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the named mesh for ``cfg`` over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = resolve_shapes(cfg, devices)
    if math.prod(dcn) > 1:
        arr = _hybrid_device_array(ici, dcn, devices)
    else:
        arr = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    names = MESH_AXES
    if cfg.fsdp and dcn[0] > 1:
        # DCN is the outer part of `data` in the array, so splitting it keeps every device's
        # batch rows: (dcn_data, data) indexes the rows exactly as the combined axis did.
        arr = arr.reshape((dcn[0], ici[0]) + arr.shape[1:])
        names = (DCN_DATA_AXIS,) + MESH_AXES
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))


def describe_mesh(mesh: Mesh) -> str:
    return ", ".join(f"{name}={size}" for name, size in mesh.shape.items())


def check_process_rows(sharding: NamedSharding, cfg: MeshConfig,
                       process_of: Callable[[jax.Device], int] | None = None) -> None:
    """Raise ``MeshShapeError`` unless ``sharding`` (a ``[batch, length]`` batch's) gives each
    process whole rows of its own, as many as every other process: each process loads its own
    rows (``jax.make_array_from_process_local_data``; the rows of one host need not be
    adjacent, as on a TPU pod). A DCN axis the batch is not split over (tensor, context across
    hosts) gives every process every row, or a part of each."""
    process_of = process_of or (lambda d: d.process_index)
    devices = list(sharding.mesh.devices.flat)
    n = len({process_of(d) for d in devices})
    if n == 1:
        return
    side = len(devices) * n  # divisible by every split of the mesh
    held: dict[int, tuple[set[int], set[int]]] = {}
    for device, (rows, cols) in sharding.devices_indices_map((side, side)).items():
        mine = held.setdefault(process_of(device), (set(), set()))
        mine[0].update(range(*rows.indices(side)[:2]))
        mine[1].update(range(*cols.indices(side)[:2]))
    own = all(len(r) == side // n and len(c) == side for r, c in held.values())
    if not own or len(set().union(*(r for r, _ in held.values()))) < side:
        raise MeshShapeError(
            f"mesh: {_describe(cfg)}: the batch's rows (sharded {tuple(sharding.spec)}) are not "
            f"split across the {n} processes, whole rows to each (each process loads its own "
            f"rows): the batch size must divide over the axes that split its rows, and only "
            f"those (dcn_data, dcn_expert) may span processes; size tensor and context within "
            f"a host (the ICI sizes)")
