"""The one table of accelerator figures the roofline uses, and the TPU topologies by name.

Every figure is a vendor's published per-chip value (bf16 dense peak; ICI bandwidth bidirectional
per chip, spread over its ports). HBM capacity in GiB: the docs write "16 GB" and "32 GB" for
v5e and v6e, and the TPU compiler works with 16 GiB and 32 GiB chips (less what it reserves):
  v5e: cloud.google.com/tpu/docs/v5e (197 TFLOP/s, 16 GB, 819 GB/s, ICI 400 GB/s over 4 ports)
  v5p: cloud.google.com/tpu/docs/v5p (459 TFLOP/s, 95 GiB, 2,765 GB/s, ICI 1,200 GB/s, 6 ports)
  v6e: cloud.google.com/tpu/docs/v6e (918 TFLOP/s, 32 GB, 1,638 GB/s, ICI 800 GB/s, 4 ports)
  H100 SXM / H200 SXM: NVIDIA's datasheets (989 TFLOP/s dense bf16; 80 GB at 3.35 TB/s / 141 GB
  at 4.8 TB/s; NVLink 900 GB/s bidirectional per GPU, modelled as one port)
A topology name counts as Google Cloud does: v5p-N has N TensorCores (2 per chip, N/2 chips);
v5e-N and v6e-N have N chips. Hosts too: the TPU API's v5e-8 and v6e-8 are one VM with all 8
chips, where libtpu's 2x4 topology defaults to two hosts of 4 (the GKE variant); larger v5e and
v6e slices have 4 chips a host and v5p 4 chips a host, libtpu's defaults. The hosts matter:
each is a process of the run, which loads its own rows of the batch.
"""

from __future__ import annotations

import dataclasses
import re

from meshrl.utils.errors import UserError

GB, GiB = 10 ** 9, 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # bf16 dense FLOP/s per chip
    hbm_bytes: float  # HBM capacity per chip
    hbm_bw: float  # HBM bytes/s per chip
    ici_bw: float  # bidirectional ICI (or NVLink) bytes/s per chip, all ports together
    ici_ports: int
    torus_dims: int  # 2: a 2D torus (v5e, v6e); 3: 3D (v5p); 0: a switch (GPUs)
    source: str

    @property
    def link_bw(self) -> float:
        """One direction of one port, bytes/s."""
        return self.ici_bw / self.ici_ports / 2


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v5e", 197e12, 16 * GiB, 819 * GB, 400 * GB, 4, 2, "cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", 459e12, 95 * GiB, 2765 * GB, 1200 * GB, 6, 3, "cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", 918e12, 32 * GiB, 1638 * GB, 800 * GB, 4, 2, "cloud.google.com/tpu/docs/v6e"),
    Chip("h100", 989e12, 80 * GB, 3350 * GB, 900 * GB, 1, 0, "NVIDIA H100 SXM datasheet"),
    Chip("h200", 989e12, 141 * GB, 4800 * GB, 900 * GB, 1, 0, "NVIDIA H200 SXM datasheet"),
)}

# device_kind strings as JAX reports them -> the table's name.
_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e", "NVIDIA H100": "h100", "NVIDIA H200": "h200"}

# Slice shapes of the single-slice sizes Google Cloud offers, by chip count.
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
_NAME = re.compile(r"^(v5e|v5p|v6e)-([1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # e.g. "v5p-8"
    chip: Chip
    chips: int
    shape: str  # e.g. "2x2x1"

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.name}:{self.shape}"

    @property
    def libtpu_options(self) -> dict[str, list[int]]:
        """Options of libtpu's topology description beyond the name: one host for the 8-chip
        v5e and v6e slices (module docstring)."""
        if self.chip.torus_dims == 2 and self.chips == 8:
            return {"chips_per_host_bounds": [2, 4, 1]}
        return {}


def topology(name: str) -> Topology:
    """The slice ``name`` (``v5p-8``, ``v6e-16``, ...) or a one-line ``UserError``."""
    m = _NAME.match(name)
    if not m:
        raise UserError(f"compile.topology = {name!r}: must be v5e-N, v5p-N or v6e-N")
    kind, n = m.group(1), int(m.group(2))
    chips = n // 2 if kind == "v5p" else n
    shapes = _SHAPES_3D if kind == "v5p" else _SHAPES_2D
    if kind == "v5p" and n % 2 or chips not in shapes:
        sizes = sorted(c * 2 if kind == "v5p" else c for c in shapes)
        raise UserError(f"compile.topology = {name!r}: {kind} slices here are "
                        f"{', '.join(f'{kind}-{s}' for s in sizes)}")
    return Topology(name, CHIPS[kind], chips, shapes[chips])


def chip_for_kind(device_kind: str) -> Chip | None:
    """The table's chip for a JAX ``device_kind`` (prefix match), or None (CPU, unknown)."""
    for kind, name in sorted(_KINDS.items(), key=lambda kv: -len(kv[0])):
        if device_kind.startswith(kind):
            return CHIPS[name]
    return None
