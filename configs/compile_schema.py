"""The ``compile`` section: what ``job = compile`` lowers and for which devices.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, field

PROGRAMS = ("train", "prefill", "decode", "reference", "reprefill", "reprefill_tail")
_TOPOLOGY = re.compile(r"^(v5e|v5p|v6e)-[1-9][0-9]*$")


@dataclasses.dataclass(frozen=True)
class CompileConfig(Section):
    """The compile job (``job = compile``): lowers and compiles the programs of ``compile.job``
    (nothing allocated, nothing run) for a TPU topology or the local devices, and reports each
    program's per-chip memory, collectives and a roofline step-time estimate."""

    _section = "compile"
    topology: str = field(
        "", "TPU slice to compile for, without its hardware (needs the tpu extra): v5e-N, v5p-N "
            "or v6e-N, named as Google Cloud names them (v5p-N has N/2 chips; v5e-N and v6e-N "
            "have N). Empty: the local devices.")
    programs: tuple[str, ...] = field(
        (), "Programs to compile, from train, prefill, decode, reference, reprefill (the "
            "sampler's re-prefill after a weight update mid-generation: every slot over "
            "sampler.max_len) and reprefill_tail (the paged cache's re-prefill after a group's "
            "shared prompt pages). (): those the job runs every step (sft: train; rl: train, "
            "prefill, decode, and reference when rl.kl_coef > 0).")
    job: Literal["sft", "rl"] = field(
        "rl", "The job whose programs are compiled; a config file sets it to its own job.")
    search: bool = field(
        False, "Try the valid mesh splits for the devices (data/FSDP, tensor, context, expert), "
               "keep the fastest that fits by the roofline, and list what was tried.")

    def validate(self) -> None:
        if self.topology and not _TOPOLOGY.match(self.topology):
            raise ConfigError(f"compile.topology = {self.topology!r}: must be v5e-N, v5p-N or "
                              f"v6e-N (e.g. 'v5p-8'), or empty for the local devices")
        bad = [p for p in self.programs if p not in PROGRAMS]
        if bad or len(set(self.programs)) != len(self.programs):
            raise ConfigError(f"compile.programs = {self.programs}: must be distinct names from "
                              f"{PROGRAMS}")
