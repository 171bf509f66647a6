"""A mesh larger than this CPU's devices says how to fake enough of them."""

from __future__ import annotations

import jax
import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.mesh import MeshShapeError, create_mesh


def test_mesh_over_more_devices_than_the_cpu_has_names_the_fake_device_flag():
    n = len(jax.devices())
    want = 2 * n

    with pytest.raises(MeshShapeError, match=rf"multiplies to {want} devices, but {n} devices "
                                             rf"are available: .* fake {want} devices: "
                                             rf"XLA_FLAGS=--xla_force_host_platform_device_"
                                             rf"count={want}\)"):
        create_mesh(MeshConfig(data=2, tensor=n))


def test_mesh_over_fewer_devices_gets_no_fake_device_hint():
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs at least 2 devices to ask for fewer")

    with pytest.raises(MeshShapeError) as err:
        create_mesh(MeshConfig(data=1, tensor=1))

    assert "xla_force_host_platform_device_count" not in str(err.value)
