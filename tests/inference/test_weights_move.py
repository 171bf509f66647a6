"""``weights.move_all``: a move onto the same devices in another order waits for its array first
(moving one still being computed that way could abort the process); other moves do not wait.
The handoff copies and casts leaves in groups (one program call each) cut at a byte budget and
where the leaves' devices or their order change, with the same values as a leaf-by-leaf copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrl.inference import weights
from meshrl.utils.params import flat_params


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
        (moved,) = weights.move_all([x_4x4], [NamedSharding(mesh, spec)])
        assert len(waits) - before == waited, (mesh.devices, spec)
        assert moved.sharding == NamedSharding(mesh, spec)
        np.testing.assert_array_equal(np.asarray(moved), np.arange(16.0).reshape(4, 4))
    (same,) = weights.move_all([x_4x4], [x_4x4.sharding])
    assert same is x_4x4  # already in place: no transfer, no wait


def _leaf(shape, devices, dtype=np.float32):
    mesh = Mesh(np.array(devices), ("x",))
    return jax.device_put(np.ones(shape, dtype), NamedSharding(mesh, P()))


def test_copy_groups_cut_at_the_byte_budget_and_where_the_devices_change(monkeypatch):
    monkeypatch.setattr(weights, "GROUP_BYTES", 512)
    one, two = jax.devices()[:1], jax.devices()[1:3]
    flat = {"a": _leaf((64,), one), "b": _leaf((64,), one), "c": _leaf((32,), one),
            "d": _leaf((64,), two)}
    expected = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16 if k == "c" else v.dtype)
                for k, v in flat.items()}

    # a + b fill the 512 bytes; d sits on other devices.
    assert weights.copy_groups(flat, expected) == [["a", "b"], ["c"], ["d"]]

    # A leaf over the budget raises it to its own copy's bytes (2,400): c's copy is bfloat16.
    flat |= {"e": _leaf((600,), two), "f": _leaf((8,), two)}
    expected |= {k: jax.ShapeDtypeStruct(flat[k].shape, np.float32) for k in "ef"}
    assert weights.copy_groups(flat, expected) == [["a", "b", "c"], ["d"], ["e"], ["f"]]


def test_leaves_on_the_same_devices_in_another_order_copy_in_their_own_group():
    devices = jax.devices()[:4]
    flat = {"a": _leaf((8,), devices), "b": _leaf((8,), devices[::-1]),
            "c": _leaf((8,), devices[::-1])}
    flat = {k: v * (i + 1) for i, (k, v) in enumerate(flat.items())}
    expected = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16) for k, v in flat.items()}
    target = NamedSharding(Mesh(np.array(jax.devices()[4:8]), ("x",)), P())

    # One jitted call takes its arguments on one device order: a and b cannot share a call.
    assert weights.copy_groups(flat, expected) == [["a"], ["b", "c"]]
    out = weights.reshard_cast(flat, expected, dict.fromkeys(flat, target),
                               weights.make_copy_cast({k: jnp.bfloat16 for k in flat}))

    for i, k in enumerate(flat):
        assert out[k].sharding == target and out[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out[k], np.float32), np.full(8, i + 1.0))


def test_handoff_in_one_call_or_in_groups_copies_the_same_values(monkeypatch, tiny_params):
    _, params = tiny_params
    flat = flat_params(params)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16), params)
    shardings = jax.tree.map(lambda v: v.sharding, params)
    sampler_weights = weights.SamplerWeights(abstract, shardings)
    calls: list[int] = []
    copy_cast = sampler_weights.copy_cast
    sampler_weights.copy_cast = lambda names, leaves: calls.append(len(names)) or copy_cast(
        names, leaves)

    whole = sampler_weights.handoff(params)
    monkeypatch.setattr(weights, "GROUP_BYTES", 1)  # groups up to the largest leaf's copy
    grouped = sampler_weights.handoff(params)

    assert calls[0] == len(flat)  # one program call for the whole tiny model
    assert len(calls) > 2 and sum(calls[1:]) == len(flat)
    for name, leaf in flat.items():
        assert whole[name].dtype == jnp.bfloat16
        assert whole[name].unsafe_buffer_pointer() != leaf.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(whole[name]), np.asarray(grouped[name]))
        np.testing.assert_array_equal(np.asarray(whole[name]),
                                      np.asarray(leaf.astype(jnp.bfloat16)))
