"""The sampler's compiled shapes, fixed when it is built: every bucket a prefill or decode call
is padded to, so a run compiles a bounded set of programs and never recompiles after them. A
prefill call always takes ``slots`` rows (its prompt count is a value) and runs passes of at most
``pass_tokens`` tokens.

Pure planning from the sampler config, the model config and how the mesh shards the KV cache;
``Sampler`` compiles each variant when a run first reaches it (``warmup`` compiles them all).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig, SamplerConfig
from meshrl.inference.requests import buckets_up_to
from meshrl.mesh.rules import Rules
from meshrl.models import KVCache


@dataclasses.dataclass(frozen=True)
class SamplerShapes:
    prompt_buckets: tuple[int, ...]  # padded prompt lengths of a prefill
    pass_tokens: int  # most tokens a prefill pass runs (a call runs the passes holding prompts)
    window_buckets: tuple[int, ...]  # cache entries a decode call attends over
    row_buckets: tuple[int, ...]  # rows of a decode call (the last: every slot)
    split: bool  # whether a chunk may cut its ranking into calls over their own windows


def decode_row_buckets(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh,
                       rules: Rules) -> tuple[int, ...]:
    """Row counts a decode call gathers its slots into: the slots of a range of the live
    ranking, or every slot (``schedule.plan_calls``)."""
    S = cfg.slots
    if KVCache.slots_per_shard(model_cfg, S, cfg.max_len, mesh, rules) < S:
        return (S,)  # a call on some slots would gather them across shards
    if cfg.decode_row_buckets:
        return tuple(sorted(set(cfg.decode_row_buckets) | {S}))
    return (S // 8, S // 4, S // 2, S) if S >= 16 else (S,)


def plan_shapes(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, rules: Rules,
                ) -> SamplerShapes:
    """The buckets of a sampler with ``cfg`` on ``mesh``."""
    T = cfg.max_len
    if cfg.kv_cache == "paged":
        return paged_shapes(cfg, decodes_in_place(cfg, mesh.devices.flat[0].platform))
    prompts = prompt_buckets(cfg)
    rows = decode_row_buckets(model_cfg, cfg, mesh, rules)
    # A chunk may split into calls over ranges of its ranking with their own windows.
    split = cfg.decode_split_windows and len(rows) > 1
    return SamplerShapes(prompt_buckets=prompts, pass_tokens=prefill_pass_tokens(cfg, prompts),
                         window_buckets=buckets_up_to(T, 32),
                         row_buckets=rows, split=split)


def prompt_buckets(cfg: SamplerConfig) -> tuple[int, ...]:
    """``sampler.prompt_buckets``, or (empty) powers of two from 16 up to ``max_len - 1``."""
    return tuple(cfg.prompt_buckets) or buckets_up_to(cfg.max_len - 1, 16)


def prefill_pass_tokens(cfg: SamplerConfig, prompt_buckets: Sequence[int]) -> int:
    """Most tokens a prefill pass runs: the longest prompt bucket's, fewer where
    ``sampler.prefill_tokens`` caps it. A pass takes as many rows of the call's length as fit,
    at least one; a call takes ``slots`` rows and runs only the passes holding its prompts, so a
    lone admission costs one pass and one program per length serves any count."""
    longest = max(prompt_buckets)
    return min(longest, cfg.prefill_tokens) if cfg.prefill_tokens > 0 else longest


def decodes_in_place(cfg: SamplerConfig, platform: str) -> bool:
    """Whether a paged cache's decode attends over its pages in place (``sampler.paged_decode``;
    auto: on a TPU, where the ragged paged attention kernel reads them)."""
    if cfg.paged_decode == "auto":
        return platform == "tpu"
    return cfg.paged_decode == "in_place"


def paged_shapes(cfg: SamplerConfig, in_place: bool = False) -> SamplerShapes:
    """A paged cache decodes every slot in one call (lengths are data, not shapes) over the
    first columns of the page table: windows are the dense ones rounded up to whole pages
    (``PagedKVCache.window``; max_len is whole pages), or, decoding ``in_place``, the whole
    table (one program). No row buckets or splits: the page table, not the slot order, says
    where a sequence lives."""
    S, T, size = cfg.slots, cfg.max_len, cfg.page_size
    prompts = prompt_buckets(cfg)
    windows = (T,) if in_place else tuple(sorted({-(-w // size) * size
                                                  for w in buckets_up_to(T, 32)}))
    return SamplerShapes(prompt_buckets=prompts, pass_tokens=prefill_pass_tokens(cfg, prompts),
                         window_buckets=windows, row_buckets=(S,), split=False)
