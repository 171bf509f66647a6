"""The ``sampler`` section: how the sampler (``inference/``) generates, for RL rollouts, RL
evaluation and the generate job: slots, cache length, buckets, sampling settings."""

from __future__ import annotations

import dataclasses

from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
)
from meshrl.configs.model_schema import DType


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
