"""Topology names, the chip table and the roofline arithmetic."""

from __future__ import annotations

import pytest

from meshrl.aot import chips
from meshrl.aot.roofline import roofline, send_bandwidth
from meshrl.utils.errors import UserError


@pytest.mark.parametrize(("name", "n", "shape", "libtpu"), [
    ("v5p-8", 4, "2x2x1", "v5p:2x2x1"), ("v5p-64", 32, "2x4x4", "v5p:2x4x4"),
    ("v5e-16", 16, "4x4", "v5e:4x4"), ("v6e-8", 8, "2x4", "v6e:2x4")])
def test_topology_counts_chips_as_google_cloud_names_them(name, n, shape, libtpu):
    topo = chips.topology(name)
    assert (topo.chips, topo.shape, topo.libtpu_name) == (n, shape, libtpu)


@pytest.mark.parametrize(("name", "options"), [
    ("v5e-8", {"chips_per_host_bounds": [2, 4, 1]}), ("v6e-8", {"chips_per_host_bounds": [2, 4, 1]}),
    ("v5e-4", {}), ("v6e-16", {}), ("v5p-8", {}), ("v5p-16", {})])
def test_only_the_8_chip_v5e_and_v6e_slices_ask_libtpu_for_one_host(name, options):
    # Google Cloud's v5e-8 and v6e-8 are one VM with 8 chips; libtpu's 2x4 default is two.
    assert chips.topology(name).libtpu_options == options


@pytest.mark.parametrize("name", ["v5p-6", "v5e-12", "v4-8", "v5p8"])
def test_unknown_topology_is_one_line_naming_it(name):
    with pytest.raises(UserError, match=f"compile.topology = '{name}'"):
        chips.topology(name)


def test_device_kind_maps_to_the_chip_and_cpu_to_none():
    assert chips.chip_for_kind("TPU v5 lite").name == "v5e"
    assert chips.chip_for_kind("TPU v5").name == "v5p"
    assert chips.chip_for_kind("NVIDIA H200").name == "h200"
    assert chips.chip_for_kind("cpu") is None


def test_roofline_takes_the_slowest_term_and_mfu_counts_model_flops_only():
    v5p = chips.CHIPS["v5p"]
    r = roofline(v5p, 4, model_flops=6e15, executed_flops=8e15, hbm_bytes_per_chip=2765e9 * 1.0,
                 ici_bytes_per_chip=send_bandwidth(v5p) * 0.5)
    assert r.compute_s == pytest.approx(8e15 / 4 / 459e12)
    assert (r.hbm_s, r.collective_s) == (pytest.approx(1.0), pytest.approx(0.5))
    assert r.bound == "compute" and r.step_s == r.compute_s
    assert r.mfu == pytest.approx(6 / 8)  # the remat recompute is not model FLOPs
    assert r.exposed_collective_s == 0.0
    assert send_bandwidth(v5p) == pytest.approx(2 * 1200e9 / 6 / 2)
