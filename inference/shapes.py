"""The sampler's compiled shapes, fixed when it is built: every bucket a prefill or decode call
is padded to, so a run compiles a bounded set of programs and never recompiles after them. A
prefill call always takes ``slots`` rows (its prompt count is a value: ``prefill_rows``).

Pure planning from the sampler config, the model config and how the mesh shards the KV cache;
``Sampler`` compiles each variant when a run first reaches it (``warmup`` compiles them all).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig, SamplerConfig
from meshrl.inference.requests import buckets_up_to
from meshrl.mesh.rules import Rules
from meshrl.models import KVCache


@dataclasses.dataclass(frozen=True)
class SamplerShapes:
    prompt_buckets: tuple[int, ...]  # padded prompt lengths of a prefill
    prefill_rows: int  # rows a prefill pass runs (a call runs as many passes as it has prompts)
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
    S, T = cfg.slots, cfg.max_len
    if cfg.kv_cache == "paged":
        return paged_shapes(cfg)
    rows = decode_row_buckets(model_cfg, cfg, mesh, rules)
    # A chunk may split into calls over ranges of its ranking with their own windows.
    split = cfg.decode_split_windows and len(rows) > 1
    return SamplerShapes(prompt_buckets=tuple(cfg.prompt_buckets) or buckets_up_to(T - 1, 16),
                         prefill_rows=prefill_pass_rows(S), window_buckets=buckets_up_to(T, 32),
                         row_buckets=rows, split=split)


def prefill_pass_rows(slots: int) -> int:
    """Rows of one prefill pass: slots / 8 (at least 1), the smallest decode row bucket. Every
    prefill call takes ``slots`` rows, prompts first, and runs only the passes holding
    prompts, so admitting a few requests costs a few passes and one program serves any count;
    on a CPU, passes of a few rows also ran as fast per token as one pass of every slot."""
    return max(1, slots // 8)


def paged_shapes(cfg: SamplerConfig) -> SamplerShapes:
    """A paged cache decodes every slot in one call (lengths are data, not shapes) over the
    first columns of the page table: windows are the dense ones rounded up to whole pages
    (``PagedKVCache.window``; max_len is whole pages). No row buckets or splits: the page
    table, not the slot order, says where a sequence lives."""
    S, T, size = cfg.slots, cfg.max_len, cfg.page_size
    windows = tuple(sorted({-(-w // size) * size for w in buckets_up_to(T, 32)}))
    return SamplerShapes(prompt_buckets=tuple(cfg.prompt_buckets) or buckets_up_to(T - 1, 16),
                         prefill_rows=prefill_pass_rows(S),
                         window_buckets=windows, row_buckets=(S,), split=False)
