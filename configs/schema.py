"""The canonical, typed config schema of meshrl.

Config files (``configs/*.py``) return an ``ml_collections.ConfigDict``; ``from_config_dict``
turns it into the frozen ``Config`` below and validates it (each section in its
``__post_init__``; rules across sections in ``Config.__post_init__``, see ``cross_section.py``).
Every section is a frozen dataclass whose fields are ordered: required, common optional, rare
optional, internal. Each field carries its documentation and constraint in ``metadata`` so
``scripts/gen_config_docs.py`` can render ``docs/config.md`` from this file alone.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

from meshrl.configs.compile_schema import CompileConfig
from meshrl.configs.cross_section import validate_config
from meshrl.configs.dpo_schema import DPOConfig
from meshrl.configs.evaluate_schema import EvaluateConfig
from meshrl.configs.export_schema import ExportConfig
from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
    greater_than,
    one_of_or_fill,
)
from meshrl.configs.model_schema import DType, ModelConfig
from meshrl.configs.rl_schema import RLConfig
from meshrl.configs.runtime_schema import RuntimeConfig
from meshrl.configs.sample_schema import SampleConfig


class Job(str, enum.Enum):
    """What ``main.py`` runs."""

    SFT = "sft"  # supervised fine-tuning with masked next-token cross-entropy
    RL = "rl"  # asynchronous RL (GRPO/PPO family) with an in-process sampler (rl.placement)
    SAMPLE = "sample"  # generate completions for prompts from a file
    EXPORT = "export"  # write a run's checkpoint or weight version as a HF checkpoint
    EVALUATE = "evaluate"  # evaluate each weight version an RL run publishes, as it appears
    COMPILE = "compile"  # compile compile.job's programs for a TPU topology or the local devices
    DPO = "dpo"  # preference training (DPO, IPO, SimPO) on (chosen, rejected) pairs


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
class OptimizerConfig(Section):
    _section = "optimizer"
    name: Literal["adamw", "sgd", "adafactor"] = field("adamw", "Optimizer.")
    schedule: Literal["constant", "cosine", "linear"] = field(
        "cosine", "Learning-rate decay after warmup.")
    warmup_steps: int = field(0, "Linear warmup steps from 0 to trainer.learning_rate.",
                              at_least(0))
    weight_decay: float = field(0.0, "Decoupled weight decay (never applied to norms or biases).",
                                at_least(0.0))
    grad_clip_norm: float = field(1.0, "Global-norm gradient clipping; 0 disables.", at_least(0.0))
    b1: float = field(0.9, "Adam beta1.", at_least(0.0))
    b2: float = field(0.95, "Adam beta2.", at_least(0.0))
    eps: float = field(1e-8, "Adam epsilon.", at_least(0.0))
    momentum: float = field(0.0, "SGD momentum; 0 is plain SGD.", at_least(0.0))
    min_lr_ratio: float = field(0.0, "Final learning rate as a fraction of the peak.",
                                at_least(0.0))


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    _section = "trainer"
    learning_rate: float = field(1e-3, "Peak learning rate.", at_least(0.0))
    steps: int = field(100, "Optimizer steps to run.", at_least(0))
    batch_size: int = field(8, "Global sequences per optimizer step.", at_least(1))
    seq_len: int = field(128, "Training sequence length (tokens).", at_least(2))
    seed: int = field(0, "Seed of params init, dropout-free RNG stream and data order.")
    microbatches: int = field(1, "Gradient-accumulation microbatches per step; must divide "
                                 "batch_size.", at_least(1))
    log_every: int = field(10, "Steps between metric writes (and RL console step lines); a "
                               "run's first step is written too.",
                           at_least(1))
    eval_every: int = field(0, "Steps between held-out evaluations; 0 disables.", at_least(0))
    on_nonfinite: Literal["raise", "skip"] = field(
        "raise", "A non-finite loss raises, or skips the update and counts it.")
    peak_flops: float = field(0.0, "Peak FLOP/s per device for MFU; 0 looks up the device.",
                              at_least(0.0))
    logits_chunk: int = field(
        1024, "Tokens (rows x positions, whole microbatch) whose float32 logits the loss, "
              "the KL reference and the eval compute at a time; the backward pass recomputes "
              "each chunk's logits instead of keeping them. 0: all at once (full [B, L, V] "
              "float32 logits). See docs/memory.md.", at_least(0))

    def validate(self) -> None:
        if self.batch_size % self.microbatches:
            raise ConfigError(f"trainer.microbatches = {self.microbatches}: must divide "
                              f"trainer.batch_size = {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class SamplerConfig(Section):
    _section = "sampler"
    max_len: int = field(256, "KV-cache length per slot (prompt + generated).", at_least(2))
    slots: int = field(32, "Concurrent sequences in the KV cache.", at_least(1))
    max_new_tokens: int = field(64, "Default cap on generated tokens per request.", at_least(1))
    temperature: float = field(1.0, "Sampling temperature; 0 is greedy.", at_least(0.0))
    top_k: int = field(0, "Keep the k most likely tokens; 0 disables.", at_least(0))
    top_p: float = field(1.0, "Nucleus sampling mass; 1 disables.", at_least(0.0))
    dtype: DType = field("float32", "Dtype of sampler params and KV cache.")
    decode_chunk: int = field(8, "Decode steps fused in one jitted call between slot checks.",
                              at_least(1))
    prompt_buckets: tuple[int, ...] = field((32, 64, 128), "Prompt length buckets (no recompiles).")
    prefill_tokens: int = field(
        8192, "Most prompt tokens (rows x prompt bucket) one prefill pass runs: a larger "
              "admission runs as a scan of passes over the largest divisor of its row count "
              "that fits (at least one row a pass), inside the one prefill program, so the "
              "prompts' temporary keys/values and activations scale with this, not with the "
              "admission. 0: one pass.", at_least(0))
    decode_row_buckets: tuple[int, ...] = field(
        (), "Slot counts a decode chunk may run on: when few sequences are left, the live slots "
            "are packed into the lowest ones and decode runs on that many rows only. () = "
            "automatic, (slots // 8, slots) for slots >= 16; (slots,) = always all slots. Used "
            "only when the slots are not sharded over several devices.")
    decode_split_windows: bool = field(
        True, "With two or more row buckets: when the longest live sequences (as many as the "
              "smallest row bucket) need a much longer cache window than the rest, decode them "
              "in a call of their own, so the rest attends over a shorter window. Taken only "
              "when the cache reads saved outweigh one more pass over the weights plus a "
              "fixed per-call cost (Sampler.split_call_overhead).")
    decode_split_weights_pass: float = field(
        0.0, "What one more pass over the weights costs per decode step, as a share of reading "
             "as many KV-cache elements; decode_split_windows weighs it against the cache reads "
             "a split saves. 0: 1 on an accelerator (both stream from HBM); on a CPU, where a "
             "small model's weights stay in cache, measured when the sampler's first weights "
             "land (a short timing of the decode program at two windows against a pass over "
             "the weights, once per process, clipped to [1/64, 1]).", at_least(0.0))

    def validate(self) -> None:
        if self.decode_split_weights_pass == float("inf"):  # NaN fails at_least already
            raise ConfigError(f"sampler.decode_split_weights_pass = "
                              f"{self.decode_split_weights_pass}: must be finite (0: measured)")
        if (any(not 1 <= b <= self.slots for b in self.decode_row_buckets)
                or list(self.decode_row_buckets) != sorted(set(self.decode_row_buckets))):
            raise ConfigError(f"sampler.decode_row_buckets = {self.decode_row_buckets}: must be "
                              f"ascending, distinct and in [1, sampler.slots = {self.slots}]")
        if self.top_p > 1.0:
            raise ConfigError(f"sampler.top_p = {self.top_p}: must be in [0, 1]")
        if any(b <= 0 for b in self.prompt_buckets) or list(self.prompt_buckets) != sorted(
                self.prompt_buckets):
            raise ConfigError(f"sampler.prompt_buckets = {self.prompt_buckets}: must be positive "
                              f"and ascending")
        if self.prompt_buckets and self.prompt_buckets[-1] >= self.max_len:
            raise ConfigError(f"sampler.prompt_buckets = {self.prompt_buckets}: the largest must "
                              f"be < sampler.max_len = {self.max_len}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    _section = "rollout"
    group_size: int = field(4, "Samples per prompt (a GRPO group).", at_least(1))
    prompts_per_step: int = field(8, "Prompts (groups) per optimizer step.", at_least(1))
    max_staleness: int = field(1, "Oldest allowed weight-version lag; 0 is synchronous RL.",
                               at_least(0))
    filter_equal_groups: bool = field(True, "Drop groups whose rewards are all equal (counted).")
    max_turns: int = field(1, "Model turns per episode; > 1 runs a multi-turn environment.",
                           at_least(1))
    max_failed_groups: int = field(64, "Groups in a row (as they finish) that raise, none "
                                       "succeeding in between, before the run stops with the last "
                                       "error; fast failures outpace slow successes, so keep it "
                                       "well above (max_staleness + 1) x prompts_per_step. A "
                                       "broken reward pool stops the run at once.", at_least(1))
    max_filtered_in_a_row: int = field(
        256, "Groups in a row, as they finish, whose samples all got the same reward before the "
             "run stops with one line naming the reward's answer format (the newest checkpoint "
             "kept); with filter_equal_groups off, the run stops when the first this many scored "
             "groups all got one and the same reward. 0: never stop.", at_least(0))
    status_every_s: float = field(30.0, "While the trainer waits for a batch, log the filtered, "
                                        "kept and in-flight groups this often, in seconds.",
                                  greater_than(0.0))


@dataclasses.dataclass(frozen=True)
class RewardConfig(Section):
    _section = "reward"
    names: tuple[str, ...] = field(("math",), "Registered reward functions to combine.")
    weights: tuple[float, ...] = field((1.0,), "Weight of each reward in names.")
    timeout_s: float = field(5.0, "Per-call timeout; a timeout gives reward 0 and is counted.",
                             at_least(0.001))
    num_workers: int = field(2, "Reward process-pool size.", at_least(1))
    format_template: str = field("<think>...</think><answer>...</answer>",
                                 "Template of the 'format' reward; '...' is any non-blank text.")
    deadline_s: float = field(60.0, "A scoring call's pairs still queued this long after it was "
                                    "submitted score 0, counted in reward/deadline_zeros (bounds "
                                    "what bad completions add to a step); 0: no deadline.",
                              at_least(0.0))
    worker_memory_mb: int = field(4096, "Address-space limit (RLIMIT_AS) of each reward worker, "
                                        "MiB; a reward needing more scores a counted 0. 0: no "
                                        "limit.",
                                  ("must be 0 (no limit) or >= 256 (a worker needs ~100 MiB to "
                                   "start)", lambda v: v == 0 or v >= 256))

    def validate(self) -> None:
        if len(self.names) != len(self.weights):
            raise ConfigError(f"reward.weights = {self.weights}: needs one weight per name in "
                              f"reward.names = {self.names}")


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    _section = "data"
    source: Literal["arithmetic", "countdown", "jsonl", "parquet"] = field(
        "arithmetic", "Synthetic task or file format of data.path.")
    path: str = field("", "Local JSONL/Parquet file (for source jsonl/parquet).")
    eval_path: str = field("", "Local held-out file in the same format (file sources); empty: no "
                               "held-out set. Synthetic sources hold out a disjoint seed stream.")
    prompt_field: str = field("question", "Record field with the prompt.")
    answer_field: str = field("answer", "Record field with the ground truth.")
    max_prompt_len: int = field(128, "Longest prompt in tokens.", at_least(1))
    on_overlong: Literal["drop", "raise"] = field("drop", "Over-long prompts (and SFT sequences "
                                                          "over trainer.seq_len): drop and count, "
                                                          "or raise.")
    num_examples: int = field(2000, "Synthetic examples to generate.", at_least(1))
    eval_examples: int = field(200, "Held-out examples (synthetic, or first rows of "
                                    "data.eval_path).", at_least(0))
    difficulty: int = field(2, "Synthetic difficulty: arithmetic operand digits; countdown "
                               "uses difficulty + 1 numbers.", at_least(1))
    ops: tuple[str, ...] = field(("+",), "Arithmetic operators to sample from ('+', '-', '*').")
    pack: bool = field(True, "SFT: pack several examples into each row (segment ids keep them "
                             "apart); False: one example per row.")
    shuffle_seed: int = field(0, "Seed of synthetic generation; mixed with trainer.seed for the "
                                 "deterministic shuffle.")

    def validate(self) -> None:
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ConfigError(f"data.path = '': required when data.source = {self.source!r}")
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ConfigError(f"data.ops = {self.ops}: must be a non-empty subset of "
                              f"('+', '-', '*')")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    _section = "checkpoint"
    every_steps: int = field(50, "Steps between checkpoints; 0 saves only at the end.",
                             at_least(0))
    keep: int = field(3, "Checkpoints kept.", at_least(1))
    async_save: bool = field(True, "Write checkpoints in the background.")
    publish_every: int = field(10, "Steps between Orbax weight versions for the sampler.",
                               at_least(1))
    keep_versions: int = field(
        3, "Published weight versions kept under <workdir>/weights: the newest ones up to the "
           "version just published; older ones are renamed aside and deleted once the new one "
           "is complete. 0 keeps all (an evaluate job that may fall behind needs 0 or enough).",
        at_least(0))
    on_unverified: Literal["stop", "restart"] = field(
        "stop", "When checkpoints exist but none matches its manifest: stop (nothing moved or "
                "deleted) or restart (move them all aside as corrupt.<step>.<ns> and train from "
                "scratch in this workdir).")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    _section = "logging"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = field("INFO", "Log level.")
    tensorboard: bool = field(True, "Write tensorboardX events under <workdir>/tb (process 0).")
    progress_bar: bool = field(True, "Show a progress bar on process 0.")
    profile_steps: tuple[int, ...] = field(
        (), "(first, last): write a jax.profiler trace of training steps first..last "
            "(inclusive; for RL its own steps, not the warm start) under "
            "<workdir>/profile/process_<i> (TensorBoard's profile plugin, Perfetto); (): none.")
    wandb_project: str = field("", "Also log metrics to this Weights & Biases project from "
                                   "process 0 (needs the wandb extra); empty: off.")
    wandb_run_name: str = field("", "The Weights & Biases run name; empty: the workdir's name.")

    def validate(self) -> None:
        p = self.profile_steps
        if p and (len(p) != 2 or not 1 <= p[0] <= p[1]):
            raise ConfigError(f"logging.profile_steps = {p}: must be () or (first, last) with "
                              f"1 <= first <= last")


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


SECTIONS: dict[str, type[Section]] = {
    cls._section: cls
    for cls in (MeshConfig, ModelConfig, OptimizerConfig, TrainerConfig, SamplerConfig,
                RolloutConfig, RLConfig, RewardConfig, DataConfig, CheckpointConfig, LoggingConfig,
                DistributedConfig, RuntimeConfig, SampleConfig, ExportConfig, EvaluateConfig,
                CompileConfig, DPOConfig)
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole resolved config; build it with ``from_config_dict``."""

    job: Job
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = dataclasses.field(default_factory=EvaluateConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)

    def __post_init__(self) -> None:
        validate_config(self)  # the rules that span sections (configs/cross_section.py)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job.value}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out
