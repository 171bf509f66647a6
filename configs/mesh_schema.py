"""The device sections: the named mesh (``mesh``) and how processes join one run
(``distributed``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
    one_of_or_fill,
)

MESH_AXES = ("data", "tensor", "context", "expert", "expert_tensor")
# Hybrid sharding (mesh.fsdp with mesh.dcn_data > 1) splits `data` into this outer DCN axis and
# the ICI `data` axis: params shard over `data` and replicate over this one (HSDP).
DCN_DATA_AXIS = "dcn_data"


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """The device mesh: each axis has an ICI size (within a slice or host) and a DCN size
    (across slices or hosts); the mesh axis is their product, DCN outermost, and the product of
    all sizes equals the device count. Hybrid sharding (HSDP): with ``fsdp`` and ``dcn_data``
    above 1, the trainer shards params and optimizer state over the ICI ``data`` axis only and
    replicates them over DCN (the mesh then holds a separate outer ``dcn_data`` axis), so the
    FSDP all-gathers stay inside a slice and only the gradient reduction crosses DCN; the batch
    splits over both."""
    _section = "mesh"
    data: int = field(-1, "ICI size of the data axis (batch; FSDP shards params here).",
                      one_of_or_fill)
    tensor: int = field(1, "ICI size of the tensor axis (heads, MLP hidden, vocab).", one_of_or_fill)
    context: int = field(1, "ICI size of the context axis (sequence length in training).",
                         one_of_or_fill)
    expert: int = field(1, "ICI size of the expert axis (MoE experts; extra batch for dense).",
                        one_of_or_fill)
    expert_tensor: int = field(1, "ICI size of the expert_tensor axis (each expert's FFN hidden).",
                               one_of_or_fill)
    fsdp: bool = field(False, "Trainer role shards params and optimizer state over the ICI data "
                       "axis (ZeRO-3); with dcn_data > 1 they replicate over DCN (HSDP).")
    dcn_data: int = field(1, "DCN (across slices/hosts) size of the data axis.", one_of_or_fill)
    dcn_tensor: int = field(1, "DCN size of the tensor axis.", one_of_or_fill)
    dcn_context: int = field(1, "DCN size of the context axis.", one_of_or_fill)
    dcn_expert: int = field(1, "DCN size of the expert axis.", one_of_or_fill)
    dcn_expert_tensor: int = field(1, "DCN size of the expert_tensor axis.", one_of_or_fill)

    def validate(self) -> None:
        for prefix in ("", "dcn_"):
            names = [prefix + a for a in MESH_AXES]
            fills = [n for n in names if getattr(self, n) == -1]
            if len(fills) > 1:
                raise ConfigError(
                    f"mesh: at most one -1 fill per {'DCN' if prefix else 'ICI'} list, got -1 for "
                    f"{', '.join('mesh.' + n for n in fills)}")

    @property
    def ici_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, "dcn_" + a) for a in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Section):
    _section = "distributed"
    initialize: Literal["never", "auto", "explicit"] = field(
        "never", "Call jax.distributed.initialize: never, auto (cluster env), or explicit.")
    coordinator_address: str = field("", "host:port of process 0 (explicit mode).")
    num_processes: int = field(1, "Processes in the job (explicit mode).", at_least(1))
    process_id: int = field(0, "This process's index (explicit mode).", at_least(0))
    step_timeout_s: float = field(
        1800.0, "Hang watchdog: when no training step completes for this long after the first "
                "one, every process logs its last completed step and last launched program, "
                "dumps all thread stacks and exits with code 124; 0 disables the watchdog.",
        at_least(0.0))
    first_step_timeout_s: float = field(
        3600.0, "The watchdog's limit from the start of the training loop to the first "
                "completed step (its compilation included), and on the checkpoint restore at "
                "start-up; 0: no limit before the first step.",
        at_least(0.0))

    def validate(self) -> None:
        if self.initialize == "explicit" and not self.coordinator_address:
            raise ConfigError("distributed.coordinator_address = '': required when "
                              "distributed.initialize = 'explicit'")
        if self.process_id >= self.num_processes:
            raise ConfigError(f"distributed.process_id = {self.process_id}: must be < "
                              f"distributed.num_processes = {self.num_processes}")
