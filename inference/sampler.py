"""The sampler: static or paged KV cache, bucketed prefill, chunked decode, continuous batching.

Device state is one ``SlotState`` plus the KV cache (``slots x max_len``, or a page pool:
``page_table``, ``prefix``); host code only picks which compiled variant runs next and reads
each round's outputs in one transfer per ``decode_chunk`` steps, one round late. The design
is in docs/sampler.md; the programs live in ``programs``, their buckets in ``shapes``, the
read-back in ``readback``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.configs.schema import ModelConfig, SamplerConfig
from meshrl.inference import admission, cache_release, paged_programs, prefix, programs, readback
from meshrl.inference import weights as wts
from meshrl.inference.page_table import SlotPages
from meshrl.inference.programs import SlotState
from meshrl.inference.requests import (
    Completion,
    Request,
    RequestQueue,
    Round,
    buckets_up_to,
    request_sampling,
    slot_settings,
    start_sampling,
    token_budget,
    tokens_left,
    validate_request,
)
from meshrl.inference.sampling import FILTERED, SAMPLING_LEVELS
from meshrl.inference.schedule import CallCosts, lagged_readback, plan_calls, sampler_costs
from meshrl.inference.shapes import plan_shapes
from meshrl.inference.slots import SlotTable
from meshrl.inference.warmup import warm_up
from meshrl.mesh.rules import Rules, rules_for
from meshrl.models import KVCache, abstract_model, param_shardings, split_model
from meshrl.utils.buckets import bucket_for
from meshrl.utils.log import get_logger

log = get_logger("inference")

class Sampler:
    """Continuous-batching sampler over its own mesh (params tensor-parallel, slots over data).

    ``generate(requests)`` is the synchronous API; ``submit`` + ``step`` drive the loop one
    chunk at a time (the async facade runs them in a thread): ``step`` returns what finished in
    the round it reads back (lagged: one behind the one it dispatches), so drive it while
    ``has_work()``. ``update_weights`` may land between chunks: in-flight slots are
    re-prefilled under the new version.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh,
                 params: Any = None, *, version: int = 0, workdir: str | None = None,
                 rules: Rules | None = None, record_routing: bool = False):
        self.cfg, self.mesh, self.workdir, self.record_routing = cfg, mesh, workdir, record_routing
        self.rules = rules if rules is not None else rules_for("sample")
        self.model_cfg = programs.sampler_model_config(model_cfg, cfg)
        abstract = abstract_model(self.model_cfg, mesh=mesh, rules=self.rules)
        self.graphdef, abstract_state = split_model(abstract)
        self.weights = wts.SamplerWeights(abstract_state,
                                          param_shardings(abstract_state, mesh, self.rules))
        S, T = cfg.slots, cfg.max_len
        shapes = plan_shapes(self.model_cfg, cfg, mesh, self.rules)
        (self.prompt_buckets, self.pass_tokens, self.window_buckets, self.row_buckets,
         self._split) = dataclasses.astuple(shapes)  # _split: a chunk may split (schedule)
        self._lagged = lagged_readback(cfg, mesh.devices.flat[0].platform)
        self._repl = NamedSharding(mesh, PartitionSpec())
        self.pages = (SlotPages(self.model_cfg, cfg, mesh, self.rules)
                      if cfg.kv_cache == "paged" else None)
        self._cache_sh = (self.pages.sharding if self.pages else
                          KVCache.shardings(self.model_cfg, S, T, mesh, self.rules))
        self._weights_size = sum(math.prod(v.shape) for v in self.weights.expected.values())
        self._costs: CallCosts | None = None  # a decode call's costs (schedule), once known
        self._costs_known = False  # priced when a plan first needs them
        self._entry_size = 2 * self.model_cfg.num_layers * self.model_cfg.num_kv_heads * \
            self.model_cfg.resolved_head_dim  # keys + values of one position of one slot
        self.cache = self.pages.init_cache() if self.pages else self.dense_cache()
        self.state = jax.device_put(SlotState.init(S, start_sampling(cfg, mesh)), self._repl)
        self.window_trace_shapes: list[tuple[int, ...]] = []  # cache shapes decode was traced at
        self._build_jits()
        # Host-side scheduling mirror: which request sits in which slot, and what it produced.
        self._queue = RequestQueue()
        self.slots = SlotTable(S)
        self._inflight: Round | None = None  # dispatched, not read back yet
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.params: nnx.State | None = None
        self.version = -1
        if params is not None:
            self.update_weights(params, version)

    # ---- compiled functions --------------------------------------------------------------

    def _build_jits(self) -> None:
        T, chunk, rec = self.cfg.max_len, self.cfg.decode_chunk, self.record_routing
        prefill = programs.make_prefill(self.graphdef, self.model_cfg, T,
                                        max_tokens=self.pass_tokens, routing=rec)
        # The paged cache decodes over a window gathered from its pages, or over the pages in
        # place (paged_programs, sampler.paged_decode).
        make_decode = paged_programs.make_decode if self.pages else programs.make_decode
        decode = make_decode(self.graphdef, T, chunk, self.window_trace_shapes.append, rec)
        st_sh, cache_sh = self._repl, self._cache_sh
        self._prefill = jax.jit(prefill, donate_argnums=(1, 2),  # resample traced: one program
                                out_shardings=(cache_sh, st_sh, st_sh))
        self._decode = jax.jit(decode, static_argnames=("window",),
                               donate_argnums=(1, 2), out_shardings=(cache_sh, st_sh, st_sh))
        if self.pages:
            self.pages.build_jits(self.graphdef, T, st_sh, self.pass_tokens)

    def dense_cache(self) -> Any:
        """An empty ``slots x max_len`` cache laid out as the sampler's own."""
        return cache_release.dense_cache(self)

    @property
    def call_costs(self) -> CallCosts | None:
        """What a decode call costs beside its window (``schedule.CallCosts``; None: chunks do
        not split), priced when a plan first needs it (a measurement compiles and times decode
        shapes a run may not reach)."""
        if not self._costs_known and self.params is not None:
            self._costs, self._costs_known = sampler_costs(self), True
        return self._costs

    @call_costs.setter
    def call_costs(self, costs: CallCosts | None) -> None:
        self._costs, self._costs_known = costs, True

    def compile_count(self) -> int:
        """Compiled variants held by the jitted prefill/decode (grows only on a recompile)."""
        return (self._prefill._cache_size() + self._decode._cache_size()
                + (self.pages.compile_count() if self.pages else 0))

    def window_for(self, max_pos: int) -> int:
        """Cache window for a chunk whose largest active position is ``max_pos``."""
        return bucket_for(min(max_pos + self.cfg.decode_chunk, self.cfg.max_len),
                       self.window_buckets)

    # ---- weights -------------------------------------------------------------------------

    def _install(self, flat: dict[str, jax.Array], version: int) -> None:
        with self._lock:
            self.params = self.weights.tree(flat)
            self.version = int(version)
            self.slots.mark_stale()
            if self.pages:
                self.pages.new_epoch()

    def update_weights(self, params: Any, version: int) -> None:
        """In-process handoff: validate, reshard to the sampler, cast, copy; lands between
        chunks (in-flight sequences are re-prefilled under the new weights)."""
        self.install_weights(self.prepare_weights(params), version)

    def prepare_weights(self, params: Any) -> dict[str, jax.Array]:
        """``update_weights``' first half: validated, resharded, cast copies of ``params``
        (waits for whatever computes them); touches no sampler state, so decoding may go on."""
        return self.weights.handoff(params)

    def install_weights(self, flat: dict[str, jax.Array], version: int) -> None:
        """``update_weights``' second half: swap in the copies; in-flight slots re-prefill."""
        self._install(flat, version)
        log.debug("sampler weights -> version %d (in-process)", version)

    def load_weights(self, version: int, workdir: str | None = None) -> None:
        """Restore ``<workdir>/weights/<version>`` (published by the trainer) onto the sampler."""
        workdir = workdir or self.workdir
        if workdir is None:
            raise ValueError("load_weights needs a workdir (Sampler(workdir=...) or argument)")
        self._install(self.weights.restore(workdir, version), version)
        log.debug("sampler weights -> version %d (from %s)", version, workdir)

    # Free the KV cache while it is dead (across a weight update) / allocate it again.
    release_cache, restore_cache = cache_release.release, cache_release.restore

    # ---- scheduling ----------------------------------------------------------------------

    def submit(self, request: Request) -> Any:
        """Queue a request; returns its id (``request.id`` or a fresh integer)."""
        self.validate(request)
        return self._enqueue(request)

    def _enqueue(self, request: Request) -> Any:
        # A copy: the level is priced on the settings queued, whatever the caller's object does.
        request = dataclasses.replace(
            request, id=next(self._ids) if request.id is None else request.id)
        with self._lock:
            self._raise_sampling(request_sampling(request, self.cfg))
            self._queue.append(request)
        return request.id

    def _raise_sampling(self, level: int) -> None:
        """Let the programs sample at ``level``: the ones compiled so far stay for nothing, the
        next of each shape compiles at the higher level (levels never drop)."""
        if level > self.state.sampling:
            log.info("sampler: a request needs %s sampling, the programs so far %s: they "
                     "compile again", SAMPLING_LEVELS[level], SAMPLING_LEVELS[self.state.sampling])
            self.state = self.state.replace(sampling=level)

    def validate(self, request: Request) -> None:
        """Raise ValueError for a request this sampler cannot serve."""
        validate_request(request, self.cfg, self.prompt_buckets)

    def withdraw(self, request_id: Any) -> bool:
        """Drop a queued request (its caller gave up on it) before it takes a slot; False when
        it is not waiting (already admitted: it runs to its end, or unknown)."""
        with self._lock:
            return self._queue.remove(request_id)

    def has_work(self) -> bool:
        return bool(self._queue) or self._inflight is not None or self.slots.busy()

    def generate(self, requests: Sequence[Request], *, longest_first: bool = True
                 ) -> list[Completion]:
        """Run requests to completion with continuous batching; results in request order. All
        are validated before any is queued. Admission follows ``Request.priority``, then
        ``longest_first``: longest token budget first (ties in request order; a long request
        admitted late would decode alone after the rest); otherwise, as always for
        ``submit``, first come, first served."""
        for r in requests:
            self.validate(r)
        given = [r.id for r in requests if r.id is not None]
        if len(set(given)) < len(given):  # results are matched to requests by id
            dup = next(i for i in given if given.count(i) > 1)
            raise ValueError(f"request id {dup!r} is given to {given.count(dup)} requests: "
                             f"ids must be distinct (or None)")
        order = list(range(len(requests)))
        if longest_first:
            order.sort(key=lambda i: -token_budget(requests[i], self.cfg))
        ids = dict(zip(order, (self._enqueue(requests[i]) for i in order)))
        done: dict[Any, Completion] = {}
        while len(done) < len(ids) or self._inflight is not None:
            for c in self.step():
                done[c.request.id] = c
        return [done[ids[i]] for i in range(len(requests))]

    def step(self) -> list[Completion]:
        """One scheduling round: refresh stale caches, refill free slots, dispatch one decode
        chunk, then read back this round or, lagged (``sampler.readback``), the previous one.
        A lagged round k + 1 is planned before round k's tokens are known: its window allows
        for the tokens in flight, a slot certain to hit its length limit is left out, and one
        that stops on a stop id decodes one more chunk as an inactive row (it emits nothing)."""
        with self._lock:
            if self.params is None:
                raise RuntimeError("the sampler has no weights: call update_weights/load_weights")
            cache_release.check_cache(self)
            finished: list[Completion] = []
            if self.slots.stale:  # re-prefill needs every token, the in-flight ones included
                rnd, self._inflight = self._inflight, None
                finished += self._read(rnd)
                self._recompute()
            rnd = Round(self.version, self._admit(self._ending()))
            plan = self._plannable()
            if plan:
                self._dispatch_chunk(rnd, plan)
            read = rnd if rnd.admitted or rnd.calls else None
            if self._lagged:  # read the previous round while this one runs
                read, self._inflight = self._inflight, read
            return finished + self._read(read)

    def _read(self, rnd: Round | None) -> list[Completion]:
        """Read back one round (one transfer) and apply it: first tokens, then the chunk."""
        if rnd is None:
            return []
        got_admitted, got_chunk = jax.device_get(([o for o, _ in rnd.admitted], rnd.outs))
        finished: list[Completion] = []
        for (_, comps), out in zip(rnd.admitted, got_admitted):
            finished += readback.first_tokens(comps, *out)
        for comps, out in zip(rnd.rows, got_chunk):
            finished += readback.chunk_tokens(comps, rnd.version, *out)
        for c in finished:
            self.slots.release(c)
        if self.pages:
            self.pages.release_empty(self.slots.out)
        return finished

    def _bound(self, window: int = 0, live: Sequence[int] = ()) -> Any:
        """The cache as a program takes it: a paged one carries the current page table and, for
        a decode chunk of the ``live`` slots over ``window``, the prefixes they share."""
        if not self.pages:
            return self.cache
        if not live:
            return self.pages.bind(self.cache)
        return self.pages.bind_decode(self.cache, window, {s: self._pos(s) for s in live})

    def _run_prefill(self, seqs: Sequence[Sequence[int]], slots: Sequence[int],
                     reqs: Sequence[Request | None], bucket: int, resample: bool,
                     ) -> tuple[jax.Array, ...]:
        """Dispatch one prefill of up to ``slots`` sequences; returns its (not yet read)
        outputs (a row per slot, the sequences' first)."""
        S = self.cfg.slots
        assert len(seqs) <= S, (len(seqs), S)
        tokens_NxP = np.zeros((S, bucket), np.int32)
        lens_N = np.ones((S,), np.int32)
        slots_N = np.full((S,), S, np.int32)  # index S is out of range: the row is dropped
        for i, (seq, s) in enumerate(zip(seqs, slots)):
            tokens_NxP[i, :len(seq)] = seq
            lens_N[i], slots_N[i] = len(seq), s
        self.cache, self.state, out = self._prefill(
            self.params, self._bound(), self.state, tokens_NxP, lens_N, slots_N,
            slot_settings(reqs, S, self.cfg), np.asarray(resample), np.int32(len(seqs)))
        return out

    def _admit(self, ending: Sequence[int] = ()) -> list[tuple[tuple[jax.Array, ...],
                                                             list[Completion]]]:
        """Prefill queued requests into free slots and the ``ending`` ones (their sequence ends
        in the round in flight; the prefill runs after it). Returns each prefill's pending
        outputs with the completions it starts, whose first token is a placeholder until
        ``readback.first_tokens``."""
        free = sorted(self.slots.free() + list(ending))
        if self.pages:
            return prefix.admit(self, free, ending)
        picked = [(s, self._queue.popleft()) for s in free[:min(len(free), len(self._queue))]]
        return admission.prefill_admitted(self, picked)

    def _in_flight_chunk(self, c: Completion) -> bool:
        return self._inflight is not None and id(c) in self._inflight.decoding

    def _ahead(self, c: Completion) -> int:
        """Most tokens the chunk in flight may add to ``c``."""
        return min(self.cfg.decode_chunk, tokens_left(c, self.cfg)) if self._in_flight_chunk(c) else 0

    def _pos(self, slot: int) -> int:
        """Upper bound on the position of the token slot ``slot`` feeds next: its last known
        token's, plus the tokens a chunk still in flight may add."""
        c = self.slots.out[slot]
        return len(c.request.prompt_ids) + len(c.tokens) - 1 + self._ahead(c)

    def _plannable(self) -> list[int]:
        """Live slots that may still decode after the round in flight (the host knows each
        request's length limits, not whether a stop id comes)."""
        return [s for s, c in enumerate(self.slots.out)
                if c is not None and tokens_left(c, self.cfg) > self._ahead(c)]

    def _ending(self) -> list[int]:
        """Live slots whose sequence certainly ends, by length, in the round in flight: a new
        request may take them over now instead of one round later."""
        return [s for s, c in enumerate(self.slots.out)
                if c is not None and tokens_left(c, self.cfg) <= self._ahead(c)]

    def _plan_chunk(self, live: list[int]) -> list[tuple[list[int], int, int]]:
        """(slots, rows, window) of each decode call of the next chunk: the live slots ranked
        by length, cut into ranges over their own windows (``schedule.plan_calls``,
        docs/sampler.md); a call on every slot lists them all, in order."""
        S = self.cfg.slots
        pos = {s: self._pos(s) for s in live}
        ranked = sorted(live, key=lambda s: (-pos[s], s))
        windows = {self.window_for(pos[s]) for s in ranked}
        # One window for all: no cut can pay, and the call costs need not be priced.
        split = self._split and len(windows) > 1
        calls = plan_calls([pos[s] for s in ranked], self.row_buckets, self.window_for,
                           self.call_costs if split else None, self._entry_size)
        return [(list(range(S)) if rows == S else ranked[lo:hi], rows, window)
                for lo, hi, rows, window in calls]

    def _dispatch_chunk(self, rnd: Round, live: list[int]) -> None:
        """Dispatch the decode calls of one chunk over ``live`` into ``rnd``."""
        S = self.cfg.slots
        rnd.calls = self._plan_chunk(live)
        for slots, rows, window in rnd.calls:
            slots_R = np.full((rows,), S, np.int32)  # index S: a padding row
            slots_R[:len(slots)] = slots
            cache = self._bound(window, live)
            if getattr(cache, "shared", None) is not None:
                window = paged_programs.SPLIT_WINDOW  # the plan's shapes fix the program
            self.cache, self.state, out = self._decode(self.params, cache, self.state, slots_R,
                                                       window=window)
            rnd.outs.append(out)
            rnd.rows.append([self.slots.out[s] for s in slots] + [None] * (rows - len(slots)))
        rnd.decoding = {id(c) for row in rnd.rows for c in row if c is not None}

    def _recompute(self) -> None:
        """Re-prefill every in-flight slot's prompt + tokens so far (except the last, not yet
        in the cache) under the current weights; the next token then comes from the new version."""
        live = self.slots.take_stale()
        if self.pages:  # a prompt group re-prefills its shared pages once
            return prefix.recompute(self, live)
        admission.reprefill(self, live)

    @property
    def recompute_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.prompt_buckets) | set(buckets_up_to(self.cfg.max_len, 32))))

    def warmup(self, recompute: bool = False, sampling: int = FILTERED) -> None:
        """Compile every prefill (prompt bucket) and decode (window x row bucket) variant, on
        padding rows and inactive slots (``warmup.warm_up``); ``recompute`` also compiles the
        re-prefill variants used after a mid-generation weight update. The programs sample at
        ``sampling`` or the level reached so far if higher (``sampling.sampling_level``; the
        default: any request's, so nothing compiles after this call)."""
        with self._lock:
            if self.has_work():
                raise RuntimeError("warmup() needs an idle sampler")
            self._raise_sampling(sampling)
            warm_up(self, recompute)
        log.info("sampler warm: %d compiled variants", self.compile_count())
