"""The ``sampler`` section: how the sampler (``inference/``) generates, for RL rollouts, RL
evaluation and the generate job: slots, cache length, buckets, sampling settings."""

from __future__ import annotations

import dataclasses
from typing import Literal

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
    min_p: float = field(0.0, "Min-p sampling: keep the tokens whose probability is at least "
                              "min_p times the most likely token's; 0 disables.", at_least(0.0))
    dtype: DType = field("float32", "Dtype of sampler params and KV cache.")
    decode_chunk: int = field(8, "Decode steps fused in one jitted call between slot checks.",
                              at_least(1))
    prompt_buckets: tuple[int, ...] = field((32, 64, 128), "Prompt length buckets (no recompiles).")
    readback: Literal["auto", "lagged", "immediate"] = field(
        "auto", "When the host reads a round's tokens. lagged: after dispatching the next round, "
                "so host work overlaps the device, but a sequence that stopped decodes one more "
                "chunk as an inactive row before its slot is refilled. immediate: as soon as "
                "the round is done, so the device waits for the host between rounds. auto: "
                "immediate on a CPU (host and device share its cores), lagged on an "
                "accelerator.")
    prefill_tokens: int = field(
        8192, "Cap on the prompt tokens one prefill pass runs. A prefill takes every slot's "
              "row, its prompts first, and runs as a loop of passes over the prompts only, a "
              "pass holding the longest prompt bucket's tokens (that many rows of shorter "
              "prompts, at least one row) or this many if fewer, inside the one prefill "
              "program per prompt length: the prompts' temporary keys/values and activations "
              "scale with a pass, and a lone admission costs one pass. 0: no cap.", at_least(0))
    kv_cache: Literal["dense", "paged"] = field(
        "dense", "KV-cache layout. dense: slots x max_len per layer, decode over length-bucketed "
                 "windows (the faster on a CPU). paged: one pool of fixed-size pages and a page "
                 "table per slot; pages are taken when a request is admitted (prompt + its whole "
                 "token budget) and returned when it finishes, a request waits (in admission "
                 "order: Request.priority, then arrival) while the pool is short, and a decode "
                 "program serves any mix of lengths (sampler.paged_decode).")
    paged_decode: Literal["auto", "window", "in_place"] = field(
        "auto", "How a paged cache's decode reads its pages (kv_cache = paged). window: each "
                "decode chunk gathers its slots' pages into a dense window over a bucketed "
                "length, decodes there and writes the chunk's entries back; slots sharing prompt "
                "pages read them once per group (a copy of the live cache per chunk; a program "
                "per window and sharing shape). in_place: every step attends over the pages "
                "where they lie (keys and values in one interleaved pool), one decode program "
                "for any mix of lengths: on a TPU JAX's ragged paged attention kernel, "
                "elsewhere a gather of each layer's pages per step (slower). auto: in_place on "
                "TPU, window elsewhere.")
    page_size: int = field(16, "Tokens per page of the paged KV cache (kv_cache = paged); must "
                               "divide sampler.max_len.", at_least(1))
    num_pages: int = field(
        0, "Pages in the paged KV cache pool (kv_cache = paged). 0: slots x max_len / page_size "
           "(never short); fewer makes admissions wait for pages; at least max_len / page_size. "
           "Where the slots split over mesh axes (data), the pages split with them: a multiple "
           "of that split, each shard holding max_len / page_size pages at least.",
        at_least(0))
    prefix_cache_pages: int = field(
        0, "kv_cache = paged: pages of finished prompts kept for later requests starting with "
           "the same tokens (least recently used dropped first, and when the pool is short; "
           "cleared by new weights and by a cache release). 0: off.", at_least(0))
    decode_row_buckets: tuple[int, ...] = field(
        (), "Row counts a decode call may run on: a call gathers the slots it names (the live "
            "ones when few are left, or a range of them ranked by length, see "
            "decode_split_windows) and decodes that many rows only. () = automatic, "
            "(slots // 8, slots // 4, slots // 2, slots) for slots >= 16; (slots,) = always all "
            "slots. Used only when the slots are not sharded over several devices.")
    decode_split_windows: bool = field(
        True, "With two or more row buckets: when live sequences need very different cache "
              "windows, cut them, ranked by length, into calls over their own windows (each on "
              "a row bucket below slots), so short sequences attend over short windows. A cut "
              "is taken only when the cache reads saved outweigh what one more call costs "
              "(decode_call_costs).")
    decode_call_costs: tuple[float, ...] = field(
        (), "(call, row): what a decode call costs per step beside reading its cache window, in "
            "KV-cache elements read: call once per call (dispatch, a pass over the weights, "
            "sampling), row for each row it runs, padding rows included. "
            "decode_split_windows weighs them against the cache reads a cut saves. (): "
            "measured when a decode plan first needs them (the decode program timed at three "
            "(rows, window) shapes on a scratch cache, once per process); a sampler spanning "
            "processes does not measure, and without them its chunks do not split.")
    decode_split_weights_pass: float = field(
        0.0, "Deprecated (removed in the next release): use decode_call_costs. A share s > 0 "
             "prices one more call at s passes over the weights, per row nothing: "
             "decode_call_costs = (s x the weights' element count, 0).", at_least(0.0))

    def validate(self) -> None:
        if self.decode_split_weights_pass == float("inf"):  # NaN fails at_least already
            raise ConfigError(f"sampler.decode_split_weights_pass = "
                              f"{self.decode_split_weights_pass}: must be finite (0: measured)")
        costs = self.decode_call_costs
        if costs and self.decode_split_weights_pass:
            raise ConfigError(f"sampler.decode_split_weights_pass = "
                              f"{self.decode_split_weights_pass}: deprecated, and "
                              f"sampler.decode_call_costs = {costs} is set too: keep only "
                              f"decode_call_costs")
        if costs and (len(costs) != 2 or not all(0 <= c < float("inf") for c in costs)):
            raise ConfigError(f"sampler.decode_call_costs = {costs}: must be () (measured) or "
                              f"(call, row), two finite numbers >= 0")
        if (any(not 1 <= b <= self.slots for b in self.decode_row_buckets)
                or list(self.decode_row_buckets) != sorted(set(self.decode_row_buckets))):
            raise ConfigError(f"sampler.decode_row_buckets = {self.decode_row_buckets}: must be "
                              f"ascending, distinct and in [1, sampler.slots = {self.slots}]")
        if self.kv_cache == "paged":
            self._validate_paged()
        if self.top_p > 1.0:
            raise ConfigError(f"sampler.top_p = {self.top_p}: must be in [0, 1]")
        if self.min_p > 1.0:
            raise ConfigError(f"sampler.min_p = {self.min_p}: must be in [0, 1]")
        if any(b <= 0 for b in self.prompt_buckets) or list(self.prompt_buckets) != sorted(
                self.prompt_buckets):
            raise ConfigError(f"sampler.prompt_buckets = {self.prompt_buckets}: must be positive "
                              f"and ascending")
        if self.prompt_buckets and self.prompt_buckets[-1] >= self.max_len:
            raise ConfigError(f"sampler.prompt_buckets = {self.prompt_buckets}: the largest must "
                              f"be < sampler.max_len = {self.max_len}")

    def _validate_paged(self) -> None:
        if self.max_len % self.page_size:
            raise ConfigError(f"sampler.page_size = {self.page_size}: must divide sampler.max_len"
                              f" = {self.max_len} (kv_cache = paged)")
        per_seq = self.max_len // self.page_size
        if 0 < self.num_pages < per_seq:
            raise ConfigError(f"sampler.num_pages = {self.num_pages}: one max_len sequence needs "
                              f"{per_seq} pages (max_len / page_size): use >= {per_seq} or 0")
