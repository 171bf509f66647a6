"""Collectives and HBM traffic counted from HLO text, loop trip counts included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.aot import hlo

LOOP = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %ag = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[4,8] slice(%ag), slice={[0:4], [0:8]}
  ROOT %t = (s32[], f32[4,8]) tuple(%j, %y)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8] parameter(0)
  %start = s32[] constant(2)
  %t = (s32[], f32[4,8]) tuple(%start, %a)
  %w = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body
  %r = f32[4,8] get-tuple-element(%w), index=1
  ROOT %ar = f32[4,8] all-reduce(%r), replica_groups=[1,2]<=[2], to_apply=%add
}
"""


def test_collective_in_loop_counts_once_per_trip_from_the_condition():
    c = hlo.collectives(LOOP)
    ag, ar = c.by_kind["all-gather"], c.by_kind["all-reduce"]
    assert (ag.count, ag.bytes, ag.ici_bytes) == (3, 3 * 512, 3 * 512 * 3 / 4)  # i = 2, 3, 4
    assert (ar.count, ar.bytes, ar.ici_bytes) == (1, 128, 128)  # 2 (n-1)/n of 128 B, n = 2
    assert c.unknown_loops == []


COMBINED = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4,8], b: f32[16], c: bf16[2,8]) -> f32[16] {
  %a = f32[4,8] parameter(0)
  %b = f32[16] parameter(1)
  %c = bf16[2,8] parameter(2)
  %ar = (f32[4,8], f32[16]) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add
  %ags = ((bf16[2,8], f32[16]), (bf16[4,8], f32[32])) all-gather-start(%c, %b), replica_groups={{0,1}}, dimensions={0}
  %agd = (bf16[4,8], f32[32]) all-gather-done(%ags)
  ROOT %r = f32[16] get-tuple-element(%ar), index=1
}
"""


def test_a_combined_collective_counts_every_operand():
    c = hlo.collectives(COMBINED)
    assert c.by_kind["all-reduce"].bytes == 128 + 64  # both gradients, not the first alone
    assert c.by_kind["all-gather"].bytes == 64 + 128  # the gathered outputs, inputs left out


def test_stated_trip_count_wins_and_unreadable_loop_is_listed():
    stated = LOOP.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"7"}}')
    assert hlo.collectives(stated).by_kind["all-gather"].count == 7
    unreadable = LOOP.replace("direction=LT", "direction=NE")
    c = hlo.collectives(unreadable)
    assert c.by_kind["all-gather"].count == 1 and c.unknown_loops == ["w"]


def test_hbm_bytes_counts_loop_bodies_per_trip():
    # Per trip: all-gather reads 128 B and writes 512 B; the slice reads 512 B, writes 128 B;
    # the add reads two and writes one 4-byte scalar; the condition's compare (4 + 4 read, 1
    # written) runs once more than the body. Outside: the all-reduce 128 + 128.
    per_trip = (128 + 512) + (512 + 128) + 12
    assert hlo.hbm_bytes(LOOP) == 3 * per_trip + 4 * 9 + 256


def test_scanned_all_gather_of_a_compiled_cpu_program_has_exact_bytes():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    if len(mesh.devices.flat) < 4:
        pytest.skip("needs 4 devices: run under tests/conftest.py's 8 fake CPU devices")

    def layers(w_LxDxD: jax.Array, x_BxD: jax.Array) -> jax.Array:
        def body(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec()))
            return jnp.tanh(h @ w), None
        return jax.lax.scan(body, x_BxD, w_LxDxD)[0]

    w = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec(None, "data", None)))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    c = hlo.collectives(jax.jit(layers).lower(w, x).compile().as_text())
    ag = c.by_kind["all-gather"]
    assert (ag.count, ag.bytes, ag.largest) == (6, 6 * 64 * 64 * 4, 64 * 64 * 4)
    assert c.total_bytes == ag.bytes


def test_array_bytes_reads_tuples_layouts_and_dtypes():
    assert hlo.array_bytes("(bf16[2,3]{1,0:T(8,128)(2,1)}, s32[], pred[4])") == [12, 4, 4]


def _one_collective(op: str) -> str:
    """A module whose entry runs ``%r = f32[8,64] <op>`` on a parameter (``op``: the opcode
    and what follows its operand list)."""
    return ("HloModule m\n\n%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
            "  %y = f32[] parameter(1)\n  ROOT %s = f32[] add(%x, %y)\n}\n\n"
            "ENTRY %main (p: f32[8,64]) -> f32[8,64] {\n  %p = f32[8,64]{1,0} parameter(0)\n"
            f"  ROOT %r = f32[8,64]{{1,0}} {op}\n}}\n")


@pytest.mark.parametrize(("groups", "n"), [
    # The mesh form as the TPU and CPU compilers print it, with a device order of its own.
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}", 4),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}", 2),
    ("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(1,0,2)) {'axis_0','axis_1'}", 4),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", 8),
    ("mesh['axis_0'=8] {'axis_0':(2)4}", 4),  # a sub-axis: its own size
    ("mesh['axis_0'=8] {}", 1),  # an empty axis set: a one-device group (a no-op)
    ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("[2,4]<=[8]", 4)])
def test_all_reduce_link_bytes_follow_the_group_size_of_every_group_form(groups, n):
    c = hlo.collectives(_one_collective(f"all-reduce(%p), channel_id=1, replica_groups={groups}, "
                                        f"use_global_device_ids=true, to_apply=%add"))

    ar = c.by_kind["all-reduce"]
    assert (ar.count, ar.bytes) == (1, 2048)
    assert ar.ici_bytes == pytest.approx(2048 * 2 * (n - 1) / n)
    assert c.unknown_groups == []


@pytest.mark.parametrize("groups", ["{}", "mesh['axis_0'=8] {'axis_9'}", "future_form[8]"])
def test_unreadable_replica_groups_are_charged_the_ring_bound_and_listed(groups):
    c = hlo.collectives(_one_collective(f"all-gather(%p), channel_id=1, replica_groups={groups}, "
                                        f"dimensions={{0}}"))

    ag = c.by_kind["all-gather"]
    assert (ag.count, ag.bytes, ag.ici_bytes) == (1, 2048, 2048)  # never 0, as for n = 1
    assert c.unknown_groups == ["r"]


def test_collective_permute_needs_no_group_size():
    c = hlo.collectives(_one_collective(
        "collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}"))

    assert c.by_kind["collective-permute"].ici_bytes == 2048 and c.unknown_groups == []
