"""The sampler's device programs: per-slot state, prefill, chunked windowed decode.

Pure functions over (params, KV cache, ``SlotState``); ``Sampler`` jits them with donation and
decides from host-side lengths which compiled variant runs next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from meshrl.configs.schema import ModelConfig, SamplerConfig
from meshrl.inference.sampling import FILTERED, sample_kept
from meshrl.models import KVCache
from meshrl.models.decoder import apply_head, forward, model_config

MAX_STOP_IDS = 8  # static width of the per-slot stop-id table
RUNNING, STOP, LENGTH = 0, 1, 2


@struct.dataclass
class SlotState:
    token_B: jax.Array  # noqa: N815 -- last sampled token, fed at pos_B by the next decode step
    pos_B: jax.Array  # noqa: N815
    active_B: jax.Array  # noqa: N815
    reason_B: jax.Array  # noqa: N815
    n_gen_B: jax.Array  # noqa: N815
    max_new_B: jax.Array  # noqa: N815
    min_new_B: jax.Array  # noqa: N815 -- no stop id among the first min_new_B tokens
    stop_BxS: jax.Array  # noqa: N815
    temperature_B: jax.Array  # noqa: N815
    top_k_B: jax.Array  # noqa: N815
    top_p_B: jax.Array  # noqa: N815
    seed_B: jax.Array  # noqa: N815
    min_p_B: jax.Array  # noqa: N815
    # What every slot's settings stay within (``sampling.sampling_level``); static, so each
    # level is its own program and the programs of a lower one compile no sort or draw.
    sampling: int = struct.field(pytree_node=False, default=FILTERED)

    @classmethod
    def init(cls, slots: int, sampling: int = FILTERED) -> SlotState:
        # Distinct buffers per field: the decode/prefill jits donate the whole state.
        def i() -> jax.Array:
            return jnp.zeros((slots,), jnp.int32)
        return cls(i(), i(), jnp.zeros((slots,), bool), i(), i(), i(), i(),
                   jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32),
                   jnp.zeros((slots,), jnp.float32), i(), jnp.ones((slots,), jnp.float32), i(),
                   jnp.zeros((slots,), jnp.float32), sampling)


def banned_stops(st: SlotState) -> jax.Array:
    """[B, S] stop ids the next token may not be (-1: none): all of a slot's stop ids while it
    has generated fewer than its ``min_new_B`` tokens."""
    return jnp.where((st.n_gen_B < st.min_new_B)[:, None], st.stop_BxS, -1)


def finish(st: SlotState, emit_B: jax.Array, tok_B: jax.Array, new_pos_B: jax.Array,
           max_len: int) -> SlotState:
    """Advance the slots that emitted ``tok_B`` and retire those that hit a stop or a limit."""
    n_gen_B = st.n_gen_B + emit_B
    stop_B = jnp.any(tok_B[:, None] == st.stop_BxS, axis=-1)
    # prompt + generated never exceeds max_len (the last token is never fed back).
    length_B = (n_gen_B >= st.max_new_B) | (new_pos_B >= max_len - 1)
    done_B = emit_B & (stop_B | length_B)
    reason_B = jnp.where(done_B, jnp.where(stop_B, STOP, LENGTH), st.reason_B)
    return st.replace(token_B=jnp.where(emit_B, tok_B, st.token_B),
                      pos_B=jnp.where(emit_B, new_pos_B, st.pos_B),
                      active_B=st.active_B & ~done_B, reason_B=reason_B, n_gen_B=n_gen_B)


def real_tokens(graphdef: nnx.GraphDef, params: nnx.State, real_BxL: jax.Array
                ) -> jax.Array | None:
    """Segment ids for a cached forward: 1 on real tokens, 0 on padding, so that padding takes
    no MoE expert capacity (a cached forward's attention never reads them); None where no
    capacity is kept (dense, or dropless routing): the forward's default, every token real."""
    m = model_config(graphdef, params)
    return real_BxL.astype(jnp.int32) if m.num_experts and m.capacity_factor else None


def sampler_model_config(model_cfg: ModelConfig, cfg: SamplerConfig) -> ModelConfig:
    """The model as the sampler runs it: params and compute in ``sampler.dtype``, no remat."""
    return dataclasses.replace(model_cfg, param_dtype=cfg.dtype, compute_dtype=cfg.dtype,
                               remat="none")


def make_prefill(graphdef: nnx.GraphDef, cfg: ModelConfig, max_len: int, *,
                 all_positions: bool = False, max_tokens: int = 0,
                 routing: bool = False) -> Callable:
    """prefill(params, cache, st, tokens_NxP, lens_N, slots_N, settings, resample, n_rows).

    Writes the prompts' keys/values into ``slots_N`` and samples each prompt's next token from
    the logits at its last position only; ``resample`` (a traced bool) false keeps the slot
    state as it is (a re-prefill): one compiled program serves admission and re-prefill alike,
    at the price of a sampling the re-prefill drops. The head runs on N hidden states, not
    N x P (the [N, P, V] logits of a long prompt bucket would dwarf the cache it fills).
    The rows run in passes of R (``pass_rows``: at most ``max_tokens`` tokens, 0: one pass),
    the cache and slot state carried, so the temporary ``[R, P]`` keys/values and activations
    are all a pass holds; ``n_rows`` (traced; None: N) says how many leading rows are prompts,
    and only their passes run (``in_passes``), so one program per prompt length serves any
    number of prompts. ``all_positions`` is the
    reference program (head on every position, then the last row kept, one pass), same tokens
    and logprobs; benchmarks/memory.py measures what it costs. ``routing``: one more output,
    the experts [N, layers, k] of each prompt's last position (what routed its first token).
    """

    def one_pass(params: nnx.State, cache: KVCache, st: SlotState, tokens_NxP: jax.Array,
                 lens_N: jax.Array, slots_N: jax.Array, settings: dict[str, jax.Array],
                 resample: Any) -> tuple[KVCache, SlotState, tuple[jax.Array, ...]]:
        N, P = tokens_NxP.shape
        pos_NxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (N, P))
        # The prompt's cache in the sampler's key layout: put_slots then copies, not transposes.
        tmp = KVCache.init(cfg, N, P, cfg.compute_dtype,
                           getattr(cache, "key_layout", KVCache.key_layout))
        real_NxP = (pos_NxP < lens_N[:, None]) & (slots_N < st.pos_B.shape[0])[:, None]
        out_NxPxX, tmp, *rout = forward(graphdef, params, tokens_NxP, pos_NxP,
                                        real_tokens(graphdef, params, real_NxP), tmp,
                                        return_hidden=not all_positions, return_routing=routing)
        # Padding rows use slot index S: every scatter below drops them.
        cache = cache.put_slots(tmp, slots_N)
        last_NxX = jnp.take_along_axis(out_NxPxX, (lens_N - 1)[:, None, None], axis=1)[:, 0]
        last_NxV = last_NxX if all_positions else apply_head(graphdef, params, last_NxX)
        assert last_NxV.shape == (N, cfg.vocab_size), last_NxV.shape
        # Out of range (slot S): a re-prefill's state writes are dropped.
        state_slots_N = jnp.where(resample, slots_N, st.pos_B.shape[0])
        st, out = first_token(st, last_NxV, lens_N, state_slots_N, settings, max_len)
        if routing:  # [layers, N, P, k] -> the last prompt position's [N, layers, k]
            last = jnp.take_along_axis(rout[0], (lens_N - 1)[None, :, None, None], axis=2)
            out = (*out, last[:, :, 0].swapaxes(0, 1))
        return cache, st, out

    def prefill(params: nnx.State, cache: KVCache, st: SlotState, tokens_NxP: jax.Array,
                lens_N: jax.Array, slots_N: jax.Array, settings: dict[str, jax.Array],
                resample: Any, n_rows: Any = None,
                ) -> tuple[KVCache, SlotState, tuple[jax.Array, ...]]:
        N, P = tokens_NxP.shape
        R = N if all_positions else pass_rows(N, P, max_tokens)

        def run(carry: tuple[KVCache, SlotState], rows: tuple) -> tuple[tuple, tuple]:
            cache, st, out = one_pass(params, *carry, *rows, resample)
            return (cache, st), out

        (cache, st), out = in_passes(run, (cache, st), (tokens_NxP, lens_N, slots_N, settings),
                                     n_rows, R)
        return cache, st, out

    return prefill


def in_passes(one_pass: Callable[[Any, Any], tuple[Any, Any]], carry: Any, rows: Any,
              n_rows: Any, R: int) -> tuple[Any, Any]:
    """``one_pass(carry, rows of a pass) -> (carry, outputs of its rows)`` over ``rows`` (a tree
    of arrays with N leading rows), R rows a pass: rows [i R, (i + 1) R) in pass i. With
    ``n_rows`` (traced) only the ceil(n_rows / R) passes holding rows below it run (a loop with
    a traced trip count: any count in one program), and the outputs of rows past them are 0;
    None: every pass. Returns (carry, outputs with N rows, in row order)."""
    N = jax.tree.leaves(rows)[0].shape[0]
    assert N % R == 0, (N, R)
    if n_rows is None and R == N:
        return one_pass(carry, rows)

    def rows_of_pass(i: jax.Array) -> Any:
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * R, R), rows)

    if n_rows is None:
        passes = jax.tree.map(lambda x: x.reshape(N // R, R, *x.shape[1:]), rows)
        carry, outs = jax.lax.scan(one_pass, carry, passes)
        return carry, jax.tree.map(lambda x: x.reshape(N, *x.shape[2:]), outs)
    shapes = jax.eval_shape(lambda c, r: one_pass(c, r)[1], carry, rows_of_pass(0))
    outs = jax.tree.map(lambda s: jnp.zeros((N, *s.shape[1:]), s.dtype), shapes)

    def body(i: jax.Array, state: tuple[Any, Any]) -> tuple[Any, Any]:
        carry, outs = one_pass(state[0], rows_of_pass(i))
        return carry, jax.tree.map(
            lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, i * R, 0),
            state[1], outs)

    count = (jnp.asarray(n_rows, jnp.int32) + R - 1) // R
    return jax.lax.fori_loop(0, count, body, (carry, outs))


def first_token(st: SlotState, last_NxV: jax.Array, lens_N: jax.Array, slots_N: jax.Array,
                settings: dict[str, jax.Array], max_len: int,
                ) -> tuple[SlotState, tuple[jax.Array, ...]]:
    """Start slots ``slots_N`` (out of range: padding rows, dropped) on the token sampled from
    the logits after their prompts of ``lens_N`` tokens; returns the state and the outputs
    ``readback.first_tokens`` reads."""
    sub = st.replace(
        pos_B=lens_N, active_B=jnp.ones_like(lens_N, bool),
        reason_B=jnp.zeros_like(lens_N), n_gen_B=jnp.zeros_like(lens_N), **settings)
    tok_N, lp_N, raw_N, kept_N = sample_kept(last_NxV, sub.temperature_B, sub.top_k_B,
                                             sub.top_p_B, sub.seed_B, lens_N,
                                             banned_stops(sub), sub.min_p_B, st.sampling)
    sub = finish(sub.replace(token_B=tok_N), jnp.ones_like(lens_N, bool), tok_N, lens_N,
                 max_len)
    st = jax.tree.map(lambda full, part: full.at[slots_N].set(part, mode="drop"), st, sub)
    return st, (tok_N, lp_N, raw_N, sub.active_B, sub.reason_B, kept_N)


def pass_rows(n: int, length: int, max_tokens: int) -> int:
    """Rows per pass of ``n`` rows of ``length`` tokens: the largest divisor of ``n`` whose pass
    holds at most ``max_tokens`` tokens, at least 1 (0: all ``n``)."""
    if max_tokens <= 0 or n * length <= max_tokens:
        return n
    top = max(1, max_tokens // length)
    return next(r for r in range(top, 0, -1) if n % r == 0)


def make_decode(graphdef: nnx.GraphDef, max_len: int, chunk: int,
                on_trace: Callable[[tuple[int, ...]], Any], routing: bool = False) -> Callable:
    """decode(params, cache, st, slots_R, window): ``chunk`` steps of the slots ``slots_R``
    (R rows; the slot count S marks a padding row) over cache entries [0, window); ``on_trace``
    sees each traced window's key shape. R = S means every slot in order (the caller passes
    ``arange(S)``): no gather, and a whole-cache window is the cache itself. ``routing``: one
    more output, the experts [R, chunk, layers, k] that routed the forward each token was
    sampled from."""

    def decode(params: nnx.State, cache: KVCache, full_st: SlotState, slots_R: jax.Array,
               window: int) -> tuple[KVCache, SlotState, tuple[jax.Array, ...]]:
        rows = slots_R.shape[0]
        every = rows == cache.slots
        # A window of the whole cache is the cache itself: no copy, no write-back.
        whole = every and window == cache.max_len
        pick = None if every else slots_R
        win = cache if whole else cache.window(window, pick)
        on_trace(win.k[0].shape)
        st = full_st if every else take_slots(full_st, slots_R)
        start_B = st.pos_B
        out0 = (jnp.full((rows, chunk), -1, jnp.int32), jnp.zeros((rows, chunk), jnp.float32),
                jnp.zeros((rows, chunk), jnp.float32), jnp.zeros((rows, chunk), jnp.int32))
        m = model_config(graphdef, params)
        rout0 = ((jnp.full((rows, chunk, m.num_layers, m.num_experts_per_tok), -1, jnp.int32),)
                 if routing else ())

        def step(i: jax.Array, carry: tuple) -> tuple:
            win, st, (tok_BxC, lp_BxC, raw_BxC, kept_BxC), rout = carry
            logits_Bx1xV, win, *layers = forward(graphdef, params, st.token_B[:, None],
                                                 st.pos_B[:, None],
                                                 real_tokens(graphdef, params,
                                                             st.active_B[:, None]),
                                                 win, return_routing=routing)
            if layers:  # [layers, B, 1, k] -> row i of [B, C, layers, k]
                rout = (rout[0].at[:, i].set(layers[0][:, :, 0].swapaxes(0, 1)),)
            new_pos_B = st.pos_B + 1
            tok_B, lp_B, raw_B, kept_B = sample_kept(logits_Bx1xV[:, 0], st.temperature_B,
                                                     st.top_k_B, st.top_p_B, st.seed_B,
                                                     new_pos_B, banned_stops(st), st.min_p_B,
                                                     st.sampling)
            emit_B = st.active_B
            st = finish(st, emit_B, tok_B, new_pos_B, max_len)
            tok_BxC = tok_BxC.at[:, i].set(jnp.where(emit_B, tok_B, -1))
            return win, st, (tok_BxC, lp_BxC.at[:, i].set(lp_B), raw_BxC.at[:, i].set(raw_B),
                             kept_BxC.at[:, i].set(kept_B)), rout

        win, st, out, rout = jax.lax.fori_loop(0, chunk, step, (win, st, out0, rout0))
        # A row writes only at positions [start, start + chunk): copying back that band instead
        # of the whole window halves the cache traffic of a long-window chunk.
        cache = win if whole else cache.put_band(win, start_B, chunk, pick)
        full_st = st if every else jax.tree.map(
            lambda f, p: f.at[slots_R].set(p, mode="drop"), full_st, st)
        tok_BxC, lp_BxC, raw_BxC, kept_BxC = out  # the kept counts last: readback's order
        return cache, full_st, (tok_BxC, lp_BxC, raw_BxC, st.active_B, st.reason_B, kept_BxC,
                                *rout)

    return decode


def take_slots(st: SlotState, slots_R: jax.Array) -> SlotState:
    """The state of slots ``slots_R`` as R rows; a padding row (index S) is inactive, so it
    emits nothing and its writes are dropped."""
    S = st.pos_B.shape[0]
    sub = jax.tree.map(lambda x: jnp.take(x, slots_R, axis=0, mode="clip"), st)
    return sub.replace(active_B=sub.active_B & (slots_R < S))
