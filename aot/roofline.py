"""The roofline step-time estimate of one compiled program on one chip kind.

step_s = max(compute, HBM, collectives), each on one chip:
  * compute = FLOPs the program executes per chip (model FLOPs, plus the forward pass again
    under full rematerialisation) / the chip's bf16 peak;
  * HBM = bytes the compiled program reads and writes per chip (``hlo.hbm_bytes``) / HBM
    bandwidth;
  * collectives = bytes one chip sends (``hlo`` ring model) / its send bandwidth: on a torus a
    ring along one axis uses that axis's two ports, one direction each (2 x one port's
    one-way bandwidth); behind a switch (GPUs), half the bidirectional NVLink figure.
The max assumes perfect overlap, so ``step_s`` is a lower bound on the real step and
``mfu`` (model FLOPs / (step_s x peak x chips)) an upper bound on the real MFU. Everything
here is an estimate until it runs on the hardware.
"""

from __future__ import annotations

import dataclasses

from meshrl.aot.chips import Chip


@dataclasses.dataclass(frozen=True)
class Roofline:
    compute_s: float
    hbm_s: float
    collective_s: float
    model_flops: float  # per step, all chips
    executed_flops: float  # per step, all chips
    chips: int
    peak_flops: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.collective_s)

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_s, "hbm": self.hbm_s, "collectives": self.collective_s}
        return max(times, key=times.get)

    @property
    def exposed_collective_s(self) -> float:
        """Collective time not hidden behind compute, when both overlap fully."""
        return max(0.0, self.collective_s - self.compute_s)

    @property
    def mfu(self) -> float:
        step = self.step_s
        return self.model_flops / (step * self.peak_flops * self.chips) if step > 0 else 0.0

    def to_json(self) -> dict:
        return {"compute_s": self.compute_s, "hbm_s": self.hbm_s,
                "collective_s": self.collective_s,
                "exposed_collective_s": self.exposed_collective_s, "step_s": self.step_s,
                "bound": self.bound, "mfu": self.mfu, "model_flops": self.model_flops,
                "executed_flops": self.executed_flops}


def send_bandwidth(chip: Chip) -> float:
    """Bytes/s one chip sends in a ring collective (see the module docstring)."""
    return 2 * chip.link_bw if chip.torus_dims else chip.ici_bw / 2


def roofline(chip: Chip, chips: int, *, model_flops: float, executed_flops: float,
             hbm_bytes_per_chip: float, ici_bytes_per_chip: float) -> Roofline:
    return Roofline(compute_s=executed_flops / chips / chip.peak_flops,
                    hbm_s=hbm_bytes_per_chip / chip.hbm_bw,
                    collective_s=ici_bytes_per_chip / send_bandwidth(chip),
                    model_flops=model_flops, executed_flops=executed_flops, chips=chips,
                    peak_flops=chip.peak_flops)
