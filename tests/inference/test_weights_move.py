"""``weights.move``: a move onto the same devices in another order waits for its array first
(moving one still being computed that way could abort the process); other moves do not wait."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrl.inference import weights


def test_move_waits_for_the_array_only_where_the_device_order_changes(monkeypatch):
    devices = np.array(jax.devices()[:4])
    here = Mesh(devices.reshape(2, 2), ("x", "y"))
    reversed_order = Mesh(devices[::-1].reshape(2, 2), ("x", "y"))
    other_devices = Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("x", "y"))
    x_4x4 = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(here, P("x", "y")))
    waits: list[int] = []
    wait = jax.block_until_ready
    monkeypatch.setattr(weights.jax, "block_until_ready", lambda a: waits.append(1) or wait(a))

    for mesh, spec, waited in [(reversed_order, P("x", "y"), 1), (here, P(None, "x"), 0),
                               (other_devices, P("x"), 0)]:
        before = len(waits)
        moved = weights.move(x_4x4, NamedSharding(mesh, spec))
        assert len(waits) - before == waited, (mesh.devices, spec)
        assert moved.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(moved), np.arange(16.0).reshape(4, 4))
