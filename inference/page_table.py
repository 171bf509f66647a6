"""The sampler's paged KV cache (``sampler.kv_cache = "paged"``): the device page pool, the
host-side page allocator, and the page table each compiled call is handed.

A request gets its pages when it is admitted: enough for its prompt and its whole token budget
up front (``reserve``), so a decode chunk never needs a page the host has not granted and no
sequence is ever preempted. Its pages return to the pool when its slot empties. A request the
pool cannot hold yet waits at the head of the queue (by priority, then arrival). Decoding never
copies keys or values: each token is written once, into its slot's page.

The page table travels inside the ``PagedKVCache`` handed to the prefill and decode programs
(``bind``), so those programs are the dense sampler's own (``programs``) and depend only on
(slots, pages) sizes. A decode chunk's cache also carries the prefixes its slots share
(``bind_decode``, planned by ``prefix_plan``), whose shapes select the split program.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig, SamplerConfig
from meshrl.inference import paged_programs
from meshrl.inference.pages import PageAllocator
from meshrl.inference.prefix_cache import PrefixCache
from meshrl.inference.prefix_plan import PrefixPlan, plan_prefixes
from meshrl.inference.requests import Completion, Request, token_budget
from meshrl.inference.shapes import decodes_in_place
from meshrl.mesh.rules import Rules, logical_to_spec
from meshrl.models.cascade_attention import SharedPrefix
from meshrl.models.paged_attention import PagedKVCache


def pool_shards(cfg: SamplerConfig, num_pages: int, mesh: Mesh, rules: Rules,
                ) -> tuple[int, tuple[str, ...]]:
    """(shards, mesh axes) of the pool's pages: those of the slots (``cache_slots``), so each
    device holds the pages of the sequences it decodes; the page count must split as the
    slots do, each shard holding one ``max_len`` sequence at least."""
    axes = _axes(logical_to_spec(("cache_slots",), rules, mesh, (cfg.slots,))[0])
    shards = math.prod(mesh.shape[a] for a in axes)
    per_seq = cfg.max_len // cfg.page_size
    if num_pages % shards or num_pages // shards < per_seq:  # a slot takes its shard's pages
        raise ConfigError(f"sampler.num_pages = {num_pages}: the pool splits over the mesh "
                          f"axes {axes} like sampler.slots = {cfg.slots}, into {shards} shards, "
                          f"each holding one max_len sequence ({per_seq} pages): use a multiple "
                          f"of {shards} that is >= {shards * per_seq}, or 0")
    return shards, axes


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


class SlotPages:
    """Pages of the sampler's slots: ``alloc.table[s]`` lists slot ``s``'s pages."""

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, rules: Rules):
        self.cfg, self.model_cfg = cfg, model_cfg
        per_seq = cfg.max_len // cfg.page_size  # the schema checks that page_size divides it
        self.num_pages = cfg.num_pages or cfg.slots * per_seq
        # Decoding in place keeps keys and values in one interleaved pool (the TPU kernel's).
        self.in_place = decodes_in_place(cfg, mesh.devices.flat[0].platform)
        self.shards, self.page_axes = pool_shards(cfg, self.num_pages, mesh, rules)
        self.alloc = PageAllocator(self.num_pages, cfg.page_size, cfg.slots, per_seq,
                                   self.shards)
        self._table_sh = NamedSharding(mesh, PartitionSpec())
        pool_sh = PagedKVCache.shardings(model_cfg, self.num_pages, cfg.page_size, mesh, rules,
                                         stacked=model_cfg.scan_layers, combined=self.in_place,
                                         page_axes=self.page_axes)
        self.sharding = pool_sh.replace(page_table=self._table_sh)
        # Work counters (``prefix``): prompt rows prefilled from position 0 (admissions and
        # re-prefills), group members started from a leader's pages, and tails re-prefilled
        # over shared pages.
        self.prompt_prefills = self.fanouts = self.tail_prefills = 0
        self.cascade_chunks = 0  # decode chunks split over shared prefixes (``bind_decode``)
        self.prefix_cache = (PrefixCache(self.alloc, cfg.page_size, cfg.prefix_cache_pages)
                             if cfg.prefix_cache_pages else None)
        # What the pool's entries are computed under: new weights or a fresh (zero) pool start a
        # new epoch, and pages written in an older one are never shared or cached again.
        self.epoch = 0
        # slot -> (its prompt, the epoch its prompt pages were written in): what may be kept.
        self.owner: dict[int, tuple[Sequence[int], int]] = {}
        self.start: dict[int, int] = {}  # slot -> prompt positions the prefix cache supplied

    def build_jits(self, graphdef: nnx.GraphDef, max_len: int, st_sh: NamedSharding,
                   pass_tokens: int) -> None:
        """The shared-prefix programs (``paged_programs``) with the sampler's shardings; the
        prompt run after cached pages and a re-prefill tail's forward run in passes of at most
        ``pass_tokens`` tokens (a row at least)."""
        out_sh = (self.sharding, st_sh)
        self.extend = jax.jit(paged_programs.make_extend(graphdef, max_len, pass_tokens),
                              donate_argnums=(1, 2), out_shardings=(*out_sh, st_sh))
        self.tail = jax.jit(paged_programs.make_tail(graphdef, pass_tokens), donate_argnums=(1,),
                            out_shardings=self.sharding)
        self.gather = jax.jit(lambda cache: paged_programs.cascade_window(cache, cache.shared))

    def compile_count(self) -> int:
        return self.extend._cache_size() + self.tail._cache_size() + self.gather._cache_size()

    def new_epoch(self) -> None:
        """New weights, or a pool allocated again: every page written so far holds entries
        that are stale (computed under the old weights) or gone (the released pool)."""
        self.epoch += 1
        if self.prefix_cache:
            self.prefix_cache.clear()

    def _init(self) -> PagedKVCache:
        """A zero pool (stacked over layers for a ``scan_layers`` model) with an empty table."""
        pool = PagedKVCache.init(self.model_cfg, self.num_pages, self.cfg.page_size,
                                 self.cfg.dtype, stacked=self.model_cfg.scan_layers,
                                 combined=self.in_place, shards=self.shards,
                                 page_axes=self.page_axes)
        return pool.replace(page_table=jnp.full(self.alloc.table.shape, -1, jnp.int32))

    def init_cache(self) -> PagedKVCache:
        """The zero pool with an empty table, placed on the sampler's devices."""
        return jax.jit(self._init, out_shardings=self.sharding)()

    def abstract_cache(self) -> PagedKVCache:
        """The pool's shapes and dtypes, nothing allocated (the compile job lowers with it)."""
        return jax.eval_shape(self._init)

    def bind(self, cache: PagedKVCache) -> PagedKVCache:
        """``cache`` carrying the host's current page table (a copy: the host keeps editing
        its table while the call it was handed to may still be queued)."""
        return cache.replace(page_table=jax.device_put(self.alloc.table.copy(), self._table_sh))

    def bind_decode(self, cache: PagedKVCache, window: int, positions: Mapping[int, int]
                    ) -> PagedKVCache:
        """``bind`` for a decode chunk over ``window`` of the slots ``positions`` names (slot ->
        the position it feeds next), with the prefixes its slots share (``prefix_plan``) when
        attending over them once per prefix reads fewer entries than the plain window (a
        gathered window only: in place, each sequence reads its own pages)."""
        # A shared prefix row gathers its pages for members that may sit on any shard: the
        # cascade needs a pool every device holds whole.
        if self.in_place or self.shards > 1:
            return self.bind(cache)
        lens = {s: len(prompt) for s, (prompt, _) in self.owner.items()}
        plan = plan_prefixes(self.alloc.table, lens, positions, self.cfg.page_size, window,
                             self.cfg.decode_chunk)
        if plan is None:
            return self.bind(cache)
        self.cascade_chunks += 1
        return self.bind_plan(cache, plan)

    def bind_plan(self, cache: PagedKVCache, plan: PrefixPlan) -> PagedKVCache:
        """``bind`` with ``plan`` as the cache's ``shared`` prefixes (one transfer), their
        windows gathered (``paged_programs.cascade_window``)."""
        table, *shared = jax.device_put(
            (self.alloc.table.copy(), *plan.arrays()), self._table_sh)
        cache = cache.replace(page_table=table, shared=SharedPrefix(*shared))
        return cache.replace(shared=cache.shared.replace(window=self.gather(cache)))

    def tokens_needed(self, request: Request) -> int:
        """Positions a request writes: its prompt, then each generated token but the last
        (which is never fed back)."""
        return len(request.prompt_ids) + token_budget(request, self.cfg) - 1

    def shared_pages(self, request: Request) -> int:
        """Leading pages a prompt group shares: the full pages before the one holding the last
        prompt token (each member writes that token's entry again to get its first logits)."""
        return (len(request.prompt_ids) - 1) // self.cfg.page_size

    def reserve(self, slot: int, request: Request, leader: int | None = None) -> bool:
        """Give ``slot`` pages for ``request`` after listing the prompt pages it shares: its
        ``leader``'s, or those the prefix cache holds (``start[slot]``: positions they cover);
        False, nothing taken, when the pool is short even after evicting cached pages."""
        cached: list[int] = []
        if leader is not None:
            self.alloc.share(leader, slot, self.shared_pages(request))
        elif self.prefix_cache:
            cached = self.prefix_cache.match(request.prompt_ids, self.shared_pages(request),
                                             self.alloc.shard_of_slot(slot))
            self.alloc.adopt(slot, cached)
            self.start[slot] = len(cached) * self.cfg.page_size
        need = -(-self.tokens_needed(request) // self.cfg.page_size) - self.alloc.held(slot)
        if self.prefix_cache:
            self.prefix_cache.evict(need, self.alloc.shard_of_slot(slot))
        if self.alloc.reserve(slot, self.tokens_needed(request)):
            self.owner[slot] = (request.prompt_ids, self.epoch)
            if self.prefix_cache:
                self.prefix_cache.hits += len(cached)
            return True
        self.alloc.release(slot)
        self.start.pop(slot, None)
        return False

    def release(self, slots: Sequence[int]) -> None:
        """Return the pages of ``slots`` (sequences over, or certain to end in the round in
        flight: that round was dispatched first, so its writes land before any new owner's)."""
        for s in slots:
            prompt, epoch = self.owner.pop(s, ((), None))
            if self.prefix_cache and epoch == self.epoch:
                self.prefix_cache.insert(prompt, self.alloc.table[s])
            self.alloc.release(s)

    def release_empty(self, out: Sequence[Completion | None]) -> None:
        """Return the pages of every slot that holds no completion any more."""
        self.release([s for s, c in enumerate(out) if c is None and self.alloc.held(s)])

    @property
    def pages_in_use(self) -> int:
        return self.alloc.pages_in_use

    def prompt_pages(self, out: Sequence[Completion | None]) -> int:
        """Distinct pages holding the prompts of the live sequences (a group's shared pages
        count once)."""
        size = self.cfg.page_size
        return len({int(p) for s, c in enumerate(out) if c is not None
                    for p in self.alloc.table[s, :-(-len(c.request.prompt_ids) // size)]
                    if p >= 0})
