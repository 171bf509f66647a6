"""Mesh construction on 8 fake CPU devices: shapes, fills, DCN axes and mismatch errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshrl.configs import MESH_AXES, MeshConfig
from meshrl.mesh import MeshShapeError, create_mesh, resolve_shapes

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("kwargs, expected", [
    ({}, (8, 1, 1, 1, 1)),
    ({"data": 2, "tensor": 4}, (2, 4, 1, 1, 1)),
    ({"data": 1, "tensor": 8}, (1, 8, 1, 1, 1)),
    ({"data": 1, "tensor": -1, "context": 2}, (1, 4, 2, 1, 1)),
    ({"data": 1, "expert": 4, "expert_tensor": 2}, (1, 1, 1, 4, 2)),
    ({"data": 2, "tensor": 2, "context": 2}, (2, 2, 2, 1, 1)),
])
def test_mesh_has_five_named_axes_with_resolved_sizes(kwargs, expected):
    mesh = create_mesh(MeshConfig(**kwargs))
    assert mesh.axis_names == MESH_AXES
    assert tuple(mesh.shape[a] for a in MESH_AXES) == expected
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_mesh_axis_types_are_explicitly_auto():
    mesh = create_mesh(MeshConfig())
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_dcn_axis_multiplies_into_its_mesh_axis_outermost():
    mesh = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2))
    assert (mesh.shape["data"], mesh.shape["tensor"]) == (4, 2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    # Contiguous blocks of 4 devices are the two granules; DCN is the outer part of `data`.
    assert set(ids[:2].flat) == {0, 1, 2, 3}
    assert set(ids[2:].flat) == {4, 5, 6, 7}


def test_hsdp_mesh_splits_data_into_an_outer_dcn_axis_over_the_same_devices():
    flat = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2))
    hsdp = create_mesh(MeshConfig(data=2, tensor=2, dcn_data=2, fsdp=True))

    assert hsdp.axis_names == ("dcn_data", *MESH_AXES)
    assert (hsdp.shape["dcn_data"], hsdp.shape["data"], hsdp.shape["tensor"]) == (2, 2, 2)
    np.testing.assert_array_equal(hsdp.devices.reshape(flat.devices.shape), flat.devices)
    # Without DCN data there is nothing to replicate over: the five axes stay.
    assert create_mesh(MeshConfig(data=4, tensor=2, fsdp=True)).axis_names == MESH_AXES


def test_dcn_fill_takes_the_granule_count():
    ici, dcn = resolve_shapes(MeshConfig(data=-1, dcn_data=-1), jax.devices())
    assert dcn == (1, 1, 1, 1, 1)  # one process, no slices: one granule
    assert ici == (8, 1, 1, 1, 1)


def test_product_mismatch_names_every_axis_and_device_count():
    with pytest.raises(MeshShapeError) as info:
        create_mesh(MeshConfig(data=3))
    message = str(info.value)
    for axis in MESH_AXES:
        assert f"{axis}=" in message and f"dcn_{axis}=" in message
    assert "8 devices are available" in message and "data=3" in message


def test_fill_that_does_not_divide_is_an_error():
    with pytest.raises(MeshShapeError, match="cannot fill -1"):
        create_mesh(MeshConfig(data=-1, tensor=3))


def _two_hosts() -> list:
    """Stand-ins for 8 devices on 2 processes (what ``resolve_shapes`` reads of a device)."""
    import types

    return [types.SimpleNamespace(id=i, process_index=i // 4, platform="cpu") for i in range(8)]


def test_dcn_sizes_across_several_processes_must_span_exactly_them():
    with pytest.raises(MeshShapeError, match=r"the mesh.dcn_\* sizes multiply to 4, but the "
                                             r"devices span 2 processes: make their product 2"):
        resolve_shapes(MeshConfig(data=2, dcn_data=4), _two_hosts())

    assert resolve_shapes(MeshConfig(data=4, dcn_data=2), _two_hosts())[1] == (2, 1, 1, 1, 1)
    assert resolve_shapes(MeshConfig(data=8), _two_hosts())[1] == (1, 1, 1, 1, 1)


def test_a_dcn_fill_that_cannot_be_made_names_what_it_fills():
    with pytest.raises(MeshShapeError, match=r"the other sizes of that list multiply to 4, which "
                                             r"does not divide 2 \(the 2 processes DCN spans\)"):
        resolve_shapes(MeshConfig(data=-1, dcn_data=4, dcn_tensor=-1), _two_hosts())


def test_dcn_product_not_dividing_devices_is_an_error():
    with pytest.raises(MeshShapeError, match="needs a multiple of 3 devices across DCN"):
        create_mesh(MeshConfig(data=1, dcn_data=3))


def test_mesh_over_a_device_subset():
    mesh = create_mesh(MeshConfig(data=2, tensor=2), devices=jax.devices()[4:])
    assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]
