"""Core sampler behaviour: greedy parity with a full forward, batching, stops, compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.inference.sampler import Request
from meshrl.inference.schedule import CallCosts
from meshrl.tests.inference.tiny import make_sampler, reference_greedy


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def test_greedy_matches_full_forward_argmax_and_logprobs(tiny_params):
    graphdef, params = tiny_params
    sampler = make_sampler(params, max_new_tokens=10)
    prompts = _prompts(3, seed=1)

    outs = sampler.generate([Request(p) for p in prompts])

    for p, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = reference_greedy(graphdef, params, p, 10)
        assert out.tokens == ref_tokens
        np.testing.assert_allclose(out.raw_logprobs, ref_lps, rtol=1e-4, atol=1e-5)
        # Greedy is a point mass: the sampled token has logprob 0 under it.
        np.testing.assert_allclose(out.logprobs, 0.0, atol=1e-6)
        assert out.finish_reason == "length"
        assert out.versions == [0] * 10
        assert out.token_versions[:len(p)] == [-1] * len(p)


def test_continuous_batching_more_requests_than_slots_matches_solo_generation(tiny_params):
    _, params = tiny_params
    prompts = _prompts(9, seed=2)
    budgets = [3, 11, 5, 17, 2, 9, 13, 1, 7]  # slots finish and refill at different chunks
    sampler = make_sampler(params, slots=4)

    outs = sampler.generate([Request(p, max_new_tokens=b)
                             for p, b in zip(prompts, budgets, strict=True)])

    for p, b, out in zip(prompts, budgets, outs, strict=True):
        alone = sampler.generate([Request(p, max_new_tokens=b)])[0]
        assert out.tokens == alone.tokens
        assert len(out.tokens) == b
        np.testing.assert_allclose(out.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_calls_on_the_live_slots_decode_them_where_they_sit_like_solo_generation(tiny_params):
    _, params = tiny_params
    prompts = _prompts(3, seed=7)
    budgets = [9, 3, 14]  # admitted into slots 0, 1, 2; slot 1 ends first, then slot 0
    sampler = make_sampler(params, slots=8, decode_row_buckets=(2, 4),
                           decode_split_windows=False)
    solo = make_sampler(params, slots=8, decode_row_buckets=(8,))
    plans = []
    plan_chunk = sampler._plan_chunk
    sampler._plan_chunk = lambda live: plans.append(plan_chunk(live)) or plans[-1]

    outs = sampler.generate([Request(p, max_new_tokens=b)
                             for p, b in zip(prompts, budgets, strict=True)],
                            longest_first=False)

    assert [(sorted(slots), rows) for (slots, rows, _), in plans[:1]] == [([0, 1, 2], 4)]
    assert [(slots, rows) for (slots, rows, _), in plans[-1:]] == [([2], 2)]  # never moved
    for p, b, out in zip(prompts, budgets, outs, strict=True):
        alone = solo.generate([Request(p, max_new_tokens=b)])[0]
        assert out.tokens == alone.tokens and len(out.tokens) == b
        np.testing.assert_allclose(out.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~30 s; the doubling-row-bucket test checks packed tokens in the default run
def test_packing_live_slots_into_fewer_rows_matches_solo_generation(tiny_params):
    _, params = tiny_params
    prompts = _prompts(7, seed=4)
    budgets = [2, 30, 3, 25, 4, 5, 6]  # two long requests outlive the rest, in high slots
    sampler = make_sampler(params, slots=8, decode_row_buckets=(2,), max_len=48,
                           decode_split_windows=False)
    solo = make_sampler(params, slots=8, decode_row_buckets=(8,), max_len=48)
    assert sampler.row_buckets == (2, 8)
    sampler.warmup()
    compiled = sampler.compile_count()

    outs = sampler.generate([Request(p, max_new_tokens=b)
                             for p, b in zip(prompts, budgets, strict=True)],
                            longest_first=False)

    assert {shape[0] for shape in sampler.window_trace_shapes} == {2, 8}
    assert sampler.compile_count() == compiled  # packed chunks reuse warm variants
    for p, b, out in zip(prompts, budgets, outs, strict=True):
        alone = solo.generate([Request(p, max_new_tokens=b)])[0]
        assert out.tokens == alone.tokens
        np.testing.assert_allclose(out.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)
    assert all(c is None for c in sampler.slots.out)
    assert not np.asarray(sampler.state.active_B).any()  # every slot was retired


@pytest.mark.slow  # scheduling detail, seconds of compiles
def test_doubling_row_buckets_run_each_chunk_on_the_smallest_bucket_holding_its_rows(
        tiny_params):
    _, params = tiny_params
    # Live counts fall from 9 to 1 as the budgets run out, one per chunk.
    budgets = [4, 8, 12, 16, 20, 24, 28, 32, 40]
    sampler = make_sampler(params, slots=16, max_len=64, max_new_tokens=40,
                           decode_row_buckets=(2, 4, 8), decode_split_windows=False)
    assert sampler.row_buckets == (2, 4, 8, 16)
    solo = make_sampler(params, slots=16, max_len=64, max_new_tokens=40,
                        decode_row_buckets=(16,))
    plans: list[tuple[int, list]] = []
    plan_chunk = sampler._plan_chunk
    sampler._plan_chunk = lambda live: plans.append((len(live), plan_chunk(live))) or plans[-1][1]

    # Arrival order: the longest requests sit in high slots; calls gather them as rows end.
    outs = sampler.generate([Request(p, max_new_tokens=b)
                             for p, b in zip(_prompts(9, seed=6), budgets, strict=True)],
                            longest_first=False)

    assert [len(o.tokens) for o in outs] == budgets
    for p, b, out in zip(_prompts(9, seed=6), budgets, outs, strict=True):
        assert out.tokens == solo.generate([Request(p, max_new_tokens=b)])[0].tokens
    assert {calls[0][1] for _, calls in plans} == {2, 4, 8, 16}
    for live, calls in plans:
        (slots, rows, _), = calls
        assert live <= rows < max(2 * live, 3), (live, calls)
        assert len(slots) == (live if rows < 16 else 16)  # every slot: all 16, in order


@pytest.mark.slow  # ~40-50 s of decode-window compiles; the split's planning is covered by
# tests/inference/test_schedule.py, split decoding by the three-range test below
def test_long_sequences_decoding_in_their_own_call_match_one_window_decoding(tiny_params):
    _, params = tiny_params
    prompts = _prompts(30, seed=5)
    # Two long requests, admitted into high slots, outlive many short ones: their window
    # outgrows the rest's and they decode in a call of their own, wherever their slots are.
    budgets = [13, 25, 14, 110, 26, 12, 100] + [10 + 7 * i % 19 for i in range(23)]
    requests = [Request(p, max_new_tokens=b) for p, b in zip(prompts, budgets, strict=True)]
    sampler = make_sampler(params, slots=8, decode_row_buckets=(2,), max_len=128,
                           max_new_tokens=110, prompt_buckets=(16,))
    assert sampler.row_buckets == (2, 8)
    sampler.call_costs = CallCosts(0, 0)  # the tiny model's windows are too short to pay a call
    sampler.warmup()
    compiled = sampler.compile_count()
    plans = []
    plan_chunk = sampler._plan_chunk
    sampler._plan_chunk = lambda live: plans.append(plan_chunk(live)) or plans[-1]

    outs = sampler.generate(requests, longest_first=False)
    sampler._split = False  # reference: every 8-row chunk decodes over one window
    refs = sampler.generate(requests, longest_first=False)

    split = [p for p in plans if len(p) >= 2]
    assert split, plans
    assert all(p[0][1] == 2 and p[0][2] > p[-1][2] for p in split)
    assert all(rows < 8 for p in split for _, rows, _ in p)  # only a sole call takes all 8
    assert sampler.compile_count() == compiled
    for out, ref in zip(outs, refs, strict=True):
        assert out.tokens == ref.tokens
        np.testing.assert_allclose(out.raw_logprobs, ref.raw_logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~23 s; the two-range split (the one the scheduler makes) stays in the
# default run: test_long_sequences_decoding_in_their_own_call_match_one_window_decoding
def test_chunk_split_into_three_slot_ranges_decodes_like_one_window(tiny_params):
    _, params = tiny_params
    # Refills at different chunks leave live sequences at three position levels; with no
    # fixed call cost every level decodes over its own window, in a call on its own slots.
    # Two long requests first, two middle ones after 20 short ones, then short ones again.
    budgets = [55, 54] + [3 + i % 5 for i in range(20)] + [40, 40] + [3 + i % 5 for i in range(30)]
    requests = [Request(p, max_new_tokens=b)
                for p, b in zip(_prompts(len(budgets), seed=6, hi=8), budgets, strict=True)]
    sampler = make_sampler(params, slots=8, decode_row_buckets=(2, 4), max_len=64,
                           max_new_tokens=55, prompt_buckets=(8,))
    sampler.call_costs = CallCosts(0, 0)  # a call costs only what it reads
    plans = []
    plan_chunk = sampler._plan_chunk
    sampler._plan_chunk = lambda live: plans.append(plan_chunk(live)) or plans[-1]

    outs = sampler.generate(requests, longest_first=False)
    sampler._split = False
    refs = sampler.generate(requests, longest_first=False)

    assert any(len(p) == 3 for p in plans), plans
    for p in plans:  # longest first, each slot in one call
        slots = [s for call, _, _ in p for s in call]
        assert len(slots) == len(set(slots)) and [w for *_, w in p] == sorted(
            (w for *_, w in p), reverse=True)
    for out, ref, b in zip(outs, refs, budgets, strict=True):
        assert out.tokens == ref.tokens and len(out.tokens) == b
        np.testing.assert_allclose(out.raw_logprobs, ref.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_slots_sharded_over_devices_decode_all_rows(tiny_params):
    from meshrl.configs.schema import MeshConfig
    _, params = tiny_params
    sharded = make_sampler(params, slots=16, mesh_cfg=MeshConfig(data=2, tensor=1))
    alone = make_sampler(params, slots=16)
    rng = np.random.default_rng(3)
    requests = [Request(rng.integers(3, 90, int(n)).tolist(), max_new_tokens=6)
                for n in rng.integers(2, 12, 16)]

    got, want = sharded.generate(requests), alone.generate(requests)

    assert sharded.row_buckets == (16,)  # no smaller buckets when slots are sharded
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert all(len(o.tokens) == 6 or o.finish_reason == "stop" for o in got)


def test_stop_token_ends_sequence_with_reason_stop(tiny_params):
    graphdef, params = tiny_params
    prompt = _prompts(1, seed=3)[0]
    ref, _ = reference_greedy(graphdef, params, prompt, 6)
    sampler = make_sampler(params)

    out = sampler.generate([Request(prompt, max_new_tokens=20, stop_ids=(ref[4],))])[0]

    cut = ref.index(ref[4]) + 1
    assert out.tokens == ref[:cut]
    assert out.finish_reason == "stop"


def test_min_new_tokens_masks_stop_ids_until_reached(tiny_params):
    graphdef, params = tiny_params
    prompt = _prompts(1, seed=3)[0]
    ref, _ = reference_greedy(graphdef, params, prompt, 6)
    sampler = make_sampler(params)
    stop = (ref[0],)  # greedy would stop at once

    free = sampler.generate([Request(prompt, max_new_tokens=20, stop_ids=stop)])[0]
    held = sampler.generate([Request(prompt, max_new_tokens=20, stop_ids=stop,
                                     min_new_tokens=5)])[0]

    assert free.tokens == ref[:1] and free.finish_reason == "stop"
    assert stop[0] not in held.tokens[:5]
    assert len(held.tokens) >= 5
    assert held.finish_reason == ("stop" if stop[0] in held.tokens else "length")


def test_min_new_equal_to_max_new_gives_exactly_that_many_tokens(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, slots=4)
    prompts = _prompts(6, seed=5)
    # Every id a tiny random model may emit early is a stop id: only the mask keeps it going.
    stops = tuple(range(3, 11))

    outs = sampler.generate([Request(p, max_new_tokens=9, min_new_tokens=9, stop_ids=stops,
                                     temperature=1.0, seed=i) for i, p in enumerate(prompts)])

    assert [len(o.tokens) for o in outs] == [9] * 6
    assert all(o.finish_reason == "length" for o in outs)
    assert not any(t in stops for o in outs for t in o.tokens)


@pytest.mark.parametrize("min_new", [-1, 11])
def test_min_new_tokens_outside_zero_to_max_new_is_rejected(tiny_params, min_new):
    _, params = tiny_params
    sampler = make_sampler(params)

    with pytest.raises(ValueError, match=rf"min_new_tokens = {min_new}: must be in \[0, "
                                         r"max_new_tokens = 10\]"):
        sampler.submit(Request([3, 4], max_new_tokens=10, min_new_tokens=min_new))


@pytest.mark.parametrize("setting, message", [
    ({"min_p": -0.5}, r"min_p = -0.5: must be in \[0, 1\]"),
    ({"top_p": float("nan")}, r"top_p = nan: must be in \[0, 1\]"),
    ({"top_p": 1.5}, r"top_p = 1.5: must be in \[0, 1\]"),
    ({"temperature": -1.0}, r"temperature = -1.0: must be >= 0 and finite"),
    ({"temperature": float("inf")}, r"temperature = inf: must be >= 0 and finite"),
    ({"top_k": 2.5}, r"top_k = 2.5: must be an integer in \[0, 2\*\*31\)"),
    ({"top_k": -1}, r"top_k = -1: must be an integer in \[0, 2\*\*31\)"),
    ({"top_k": 2 ** 31}, r"top_k = 2147483648: must be an integer in \[0, 2\*\*31\)"),
    ({"max_new_tokens": 2 ** 31}, r"max_new_tokens = 2147483648: must be an integer in \[1, "),
    ({"max_new_tokens": 2.0}, r"max_new_tokens = 2.0: must be an integer"),
    ({"seed": None}, r"seed = None: must be an integer"),
    ({"seed": 1.5}, r"seed = 1.5: must be an integer"),
    # The device keys draws by 31 bits: 2**31 would draw seed 0's samples, -1 seed 2**31-1's.
    ({"seed": 2 ** 31}, r"seed = 2147483648: must be an integer in \[0, 2\*\*31\)"),
    ({"seed": -1}, r"seed = -1: must be an integer in \[0, 2\*\*31\)"),
    ({"stop_ids": (2, -22)}, r"stop_ids \[-22\]: each must be a token id in \[0, 2\*\*31\)"),
    ({"stop_ids": (2 ** 31,)}, r"stop_ids \[2147483648\]: each must be a token id"),
])
def test_a_sampling_setting_out_of_range_is_rejected_before_queueing(tiny_params, setting,
                                                                     message):
    # A negative min-p or a NaN top-p would filter all but the top token in a program that
    # sorts while counting as no filter for the sampling level: sampled greedily, silently.
    _, params = tiny_params
    sampler = make_sampler(params)

    with pytest.raises(ValueError, match=message):
        sampler.submit(Request([3, 4], **{"max_new_tokens": 4, **setting}))
    assert not sampler.has_work()


def test_generate_refuses_requests_sharing_an_id_before_queueing_any(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    twins = [Request([3, 4], max_new_tokens=2, id="group0") for _ in range(2)]

    with pytest.raises(ValueError, match="request id 'group0' is given to 2 requests"):
        sampler.generate([Request([5], max_new_tokens=2), *twins])
    assert not sampler.has_work()


@pytest.mark.slow  # scheduling detail, seconds of compiles
def test_sequence_reaching_cache_end_finishes_with_length(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, max_len=24, prompt_buckets=(8, 16))

    out = sampler.generate([Request(list(range(3, 19)), max_new_tokens=100)])[0]

    assert len(out.tokens) == 24 - 16  # prompt + completion fill max_len exactly
    assert out.finish_reason == "length"


def test_no_recompilation_after_warmup_with_mixed_prompt_lengths(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, max_len=64, slots=4)
    sampler.warmup()
    compiled = sampler.compile_count()
    prompts = _prompts(11, seed=4, lo=1, hi=16)
    requests = [Request(p, max_new_tokens=m, temperature=t, top_k=k, seed=i)
                for i, (p, m, t, k) in enumerate(zip(
                    prompts, [1, 5, 40, 9, 3, 48, 2, 7, 30, 4, 12],
                    ([0.0, 0.7, 1.0, 0.0, 1.3] * 3)[:11], ([0, 5, 0, 3, 0] * 3)[:11],
                    strict=True))]

    backend_compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            backend_compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        sampler.generate(requests)
        after_run = len(backend_compiles)
        jax.jit(lambda x: x * 3)(jnp.ones((7, 3)))  # the listener does see a fresh compile
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

    assert sampler.compile_count() == compiled
    assert after_run == 0
    assert backend_compiles  # the listener was live: it saw the probe compile


def test_sampled_generation_is_reproducible_per_seed_regardless_of_batch(tiny_params):
    _, params = tiny_params
    prompt = _prompts(1, seed=5)[0]
    a = make_sampler(params, slots=4)
    b = make_sampler(params, slots=4)
    req = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)

    alone = a.generate([Request(prompt, **req)])[0]
    crowd = b.generate([Request(q, max_new_tokens=5, temperature=1.0, seed=i)
                        for i, q in enumerate(_prompts(3, seed=6))] + [Request(prompt, **req)])

    assert crowd[-1].tokens == alone.tokens
    np.testing.assert_allclose(crowd[-1].logprobs, alone.logprobs, rtol=1e-4, atol=1e-5)
    # Under the truncated distribution a sampled token is at least as likely as under the raw.
    assert np.all(np.asarray(alone.logprobs) >= np.asarray(alone.raw_logprobs) - 1e-5)


@pytest.mark.slow  # scheduling detail, seconds of compiles
def test_decode_window_covers_chunk_and_compiled_input_is_window_shape(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, max_len=192, decode_chunk=8, prompt_buckets=(64,))

    assert sampler.window_buckets == (32, 48, 64, 96, 128, 192)
    assert sampler.window_for(10) == 32  # positions up to 10 + 8 fit in 32
    assert sampler.window_for(60) == 96  # 60 + 8 > 64
    assert sampler.window_for(190) == 192  # capped at max_len
    sampler.generate([Request(list(range(3, 50)), max_new_tokens=30)])

    traced_T = sorted({shape[-1] for shape in sampler.window_trace_shapes})  # keys: B K H T
    assert traced_T == [64, 96]
    assert all(shape[-1] != 192 for shape in sampler.window_trace_shapes)


def test_invalid_prompt_length_is_rejected(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)
    with pytest.raises(ValueError, match="prompt length 17"):
        sampler.submit(Request(list(range(17))))


def test_request_ended_by_its_first_token_finishes_beside_decoding_slots(tiny_params):
    # Admission and the chunk share one readback: a request whose first token ends it must
    # finish with exactly that token while the requests admitted with it keep decoding.
    graphdef, params = tiny_params
    prompts = _prompts(3, seed=5)
    refs = [reference_greedy(graphdef, params, p, 6)[0] for p in prompts]
    sampler = make_sampler(params)

    outs = sampler.generate([Request(prompts[0], max_new_tokens=1),
                             Request(prompts[1], max_new_tokens=6),
                             Request(prompts[2], max_new_tokens=20, stop_ids=(refs[2][0],))])

    assert [o.tokens for o in outs] == [refs[0][:1], refs[1], refs[2][:1]]
    assert [o.finish_reason for o in outs] == ["length", "length", "stop"]
    assert all(c is None for c in sampler.slots.out)


def _record_rounds(sampler) -> list[str]:
    events = []
    dispatch, read = sampler._dispatch_chunk, sampler._read
    sampler._dispatch_chunk = lambda rnd, live: events.append("dispatch") or dispatch(rnd, live)
    sampler._read = lambda rnd: (rnd is not None and events.append("read")) or read(rnd)
    return events


@pytest.mark.parametrize("readback, want", [
    # Overlap: the device gets round k + 1 before the host reads round k, and a request
    # certain to end by length inside the chunk in flight is not decoded again.
    ("lagged", ["dispatch", "dispatch", "read", "dispatch", "read", "read"]),
    ("immediate", ["dispatch", "read"] * 3)])
def test_each_readback_dispatches_and_reads_rounds_in_its_own_order(
        tiny_params, readback, want):
    graphdef, params = tiny_params
    prompt = _prompts(1, seed=7)[0]
    ref, _ = reference_greedy(graphdef, params, prompt, 13)
    sampler = make_sampler(params, readback=readback)  # chunk 4: first token + 3 chunks
    events = _record_rounds(sampler)

    out = sampler.generate([Request(prompt, max_new_tokens=13)])[0]

    assert out.tokens == ref and out.finish_reason == "length"
    assert events == want
    assert not sampler.has_work()


@pytest.mark.slow  # scheduling detail, seconds of compiles
def test_slot_ending_by_length_in_flight_is_refilled_without_an_idle_round(tiny_params):
    # One slot, two requests of 1 + 4 tokens (one chunk): B is admitted while A's last chunk is
    # still in flight, because A certainly ends there; B's prefill runs after that chunk.
    graphdef, params = tiny_params
    prompts = _prompts(2, seed=9)
    refs = [reference_greedy(graphdef, params, p, 5)[0] for p in prompts]
    sampler = make_sampler(params, slots=1, readback="lagged")
    events = _record_rounds(sampler)

    outs = sampler.generate([Request(p, max_new_tokens=5) for p in prompts])

    assert [o.tokens for o in outs] == refs
    assert events == ["dispatch", "dispatch", "read", "read"]


def _count_rounds(sampler) -> list[int]:
    rounds, step = [0], sampler.step
    sampler.step = lambda: rounds.append(rounds.pop() + 1) or step()
    return rounds


@pytest.mark.slow  # scheduling detail, seconds of compiles
def test_generate_admits_longest_budget_first_and_returns_results_in_request_order(tiny_params):
    # Two slots, four short requests and a long one last: first come, first served leaves the
    # long one decoding alone after the rest; longest first runs the short ones beside it.
    _, params = tiny_params
    budgets = [5, 5, 5, 5, 17]
    requests = [Request(p, max_new_tokens=b)
                for p, b in zip(_prompts(5, seed=11), budgets, strict=True)]
    fifo, sampler = make_sampler(params, slots=2), make_sampler(params, slots=2)
    fifo_rounds, rounds = _count_rounds(fifo), _count_rounds(sampler)
    admitted, prefill = [], sampler._run_prefill
    sampler._run_prefill = lambda seqs, slots, reqs, *a: admitted.extend(
        r.max_new_tokens for r in reqs) or prefill(seqs, slots, reqs, *a)
    in_arrival_order = fifo.generate(requests, longest_first=False)

    outs = sampler.generate(requests)

    assert admitted == [17, 5, 5, 5, 5]
    assert [len(o.tokens) for o in outs] == budgets
    assert [o.tokens for o in outs] == [o.tokens for o in in_arrival_order]
    assert rounds[0] < fifo_rounds[0], (rounds, fifo_rounds)


def test_generate_rejects_an_invalid_request_before_queueing_any(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params)

    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        sampler.generate([Request([5, 6], max_new_tokens=3), Request([5], max_new_tokens=0)])

    assert not sampler.has_work()
