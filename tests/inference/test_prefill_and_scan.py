"""Prefill scores only each prompt's last position; a scan_layers sampler (layer-stacked KV
cache) generates what the unrolled one does."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference import programs
from meshrl.inference.requests import slot_settings
from meshrl.inference.sampler import Request, Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY
from meshrl.tests.models.layer_stacking import unrolled_and_scanned
from meshrl.tests.trees import assert_trees_close, assert_trees_equal

WIDE = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256)
N, P = 4, 64  # prefill rows, prompt bucket


def _sampler(cfg: ModelConfig, params, **kw) -> Sampler:
    sampler_cfg = SamplerConfig(**{**dict(max_len=96, slots=4, max_new_tokens=8,
                                          temperature=0.0, decode_chunk=4,
                                          prompt_buckets=(16, P)), **kw})
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    return Sampler(cfg, sampler_cfg, mesh, params)


def _prefill_args(sampler: Sampler, bucket: int) -> tuple:
    tokens_NxP = np.ones((N, bucket), np.int32)
    lens_N = np.array([bucket, 3, 1, bucket // 2], np.int32)
    return (sampler.params, sampler.cache, sampler.state, tokens_NxP, lens_N,
            np.arange(N, dtype=np.int32), slot_settings([], N, sampler.cfg))


def _shapes(jaxpr: Jaxpr) -> set[tuple[int, ...]]:
    """Every intermediate's shape, nested jaxprs (scan, cond, pjit) included."""
    out = set()
    for eqn in jaxpr.eqns:
        out |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, ClosedJaxpr):
                    out |= _shapes(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    out |= _shapes(sub)
    return out


def test_prefill_computes_logits_at_the_last_prompt_position_only():
    _, params = split_model(create_model(WIDE, seed=0))
    sampler = _sampler(WIDE, params)
    prefill = programs.make_prefill(sampler.graphdef, sampler.model_cfg, sampler.cfg.max_len)
    V = WIDE.vocab_size

    jaxpr = jax.make_jaxpr(prefill, static_argnums=(7,))(*_prefill_args(sampler, P), True)
    shapes = _shapes(jaxpr.jaxpr)
    temp_B = {bucket: sampler._prefill.lower(*_prefill_args(sampler, bucket), resample=True)
              .compile().memory_analysis().temp_size_in_bytes for bucket in (16, P)}

    assert (N, V) in shapes
    assert not any(len(s) >= 2 and s[-1] == V and P in s for s in shapes), sorted(shapes)
    # [N, P, V] float32 logits would be 4 MiB at P = 64; the P = 16 -> 64 growth is the
    # prompt's activations and keys/values, not P x V.
    assert temp_B[P] < N * P * V * 4 // 4, temp_B
    assert temp_B[P] - temp_B[16] < N * (P - 16) * V * 4 // 8, temp_B


def _run_prefills(seed: int, variants: dict) -> dict:
    """{name: (cache, state, outputs)} of one sampling prefill of N random prompts of P tokens,
    per ``make_prefill`` keyword set in ``variants``."""
    _, params = split_model(create_model(WIDE, seed=0))
    sampler = _sampler(WIDE, params, temperature=1.0)
    args = _prefill_args(sampler, P)
    args = (*args[:3], np.random.default_rng(seed).integers(3, 4096, (N, P), dtype=np.int32),
            *args[4:])
    return {name: jax.jit(programs.make_prefill(sampler.graphdef, sampler.model_cfg,
                                                sampler.cfg.max_len, **kw),
                          static_argnums=(7,))(*args, True) for name, kw in variants.items()}


def test_last_position_prefill_samples_what_the_all_positions_reference_samples():
    outs = _run_prefills(0, {"last": {}, "all": {"all_positions": True}})

    (cache, st, (tok, lp, raw, *_)), (ref_cache, ref_st, (ref_tok, ref_lp, ref_raw, *_)) = (
        outs["last"], outs["all"])
    np.testing.assert_array_equal(tok, ref_tok)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(raw, ref_raw, rtol=1e-5, atol=1e-6)
    assert_trees_equal((cache, st), (ref_cache, ref_st))


@pytest.mark.parametrize("n, length, max_tokens, rows", [
    (256, 256, 8192, 32), (96, 256, 8192, 32), (256, 16, 8192, 256), (7, 256, 512, 1),
    (12, 64, 512, 6), (4, 64, 0, 4)])
def test_prefill_pass_rows_are_the_largest_divisor_that_fits(n, length, max_tokens, rows):
    assert programs.pass_rows(n, length, max_tokens) == rows


def test_prefill_in_passes_fills_the_cache_and_samples_as_one_pass():
    run = _run_prefills(1, {"one": {"max_tokens": 0}, "two": {"max_tokens": 2 * P}})

    (cache, st, out), (ref_cache, ref_st, ref_out) = run["two"], run["one"]
    np.testing.assert_array_equal(out[0], ref_out[0])
    assert_trees_close((cache, st, out), (ref_cache, ref_st, ref_out), rtol=1e-5, atol=1e-6)


def test_prefill_with_a_row_count_runs_only_the_passes_holding_those_rows():
    _, params = split_model(create_model(WIDE, seed=0))
    sampler = _sampler(WIDE, params, temperature=1.0)
    args = _prefill_args(sampler, P)
    args = (*args[:3], np.random.default_rng(2).integers(3, 4096, (N, P), dtype=np.int32),
            *args[4:])
    prefill = jax.jit(programs.make_prefill(sampler.graphdef, sampler.model_cfg,
                                            sampler.cfg.max_len, max_tokens=P),
                      static_argnums=(7,))

    cache, st, out = prefill(*args, True, np.int32(N))
    ref_cache, ref_st, ref_out = prefill(*args, True, None)  # every pass, as a scan
    part_cache, part_st, part_out = prefill(*args, True, np.int32(2))

    assert_trees_close((cache, st, out), (ref_cache, ref_st, ref_out), rtol=1e-5, atol=1e-6)
    # Rows 0 and 1 ran as in the full call; rows 2 and 3 (slots 2 and 3) were never run.
    np.testing.assert_array_equal(np.asarray(part_out[0])[:2], np.asarray(out[0])[:2])
    assert not np.asarray(part_out[0])[2:].any()
    assert list(np.asarray(part_st.active_B)) == [True, True, False, False]
    for layer in range(WIDE.num_layers):
        k = np.asarray(part_cache.k[layer])
        np.testing.assert_allclose(k[:2], np.asarray(cache.k[layer])[:2], rtol=1e-5, atol=1e-6)
        assert not k[2:].any()


def test_one_prefill_program_admits_any_number_of_prompts():
    _, params = split_model(create_model(TINY, seed=0))
    sampler = _sampler(TINY, params, slots=8, max_len=48, prompt_buckets=(16,))
    solo = _sampler(TINY, params, slots=8, max_len=48, prompt_buckets=(16,))
    prompts = _prompts(8, seed=3)

    outs = [sampler.generate([Request(p, max_new_tokens=4) for p in prompts[:n]])
            for n in (1, 3, 8)]

    assert sampler._prefill._cache_size() == 1
    for n, got in zip((1, 3, 8), outs, strict=True):
        for p, out in zip(prompts[:n], got, strict=True):
            assert out.tokens == solo.generate([Request(p, max_new_tokens=4)])[0].tokens


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=int(rng.integers(3, 17))).tolist() for _ in range(n)]


@pytest.mark.slow  # ~20 s; tests/models/test_kv_cache_stacked.py checks scanned prefill/decode in the default run
def test_scan_layers_sampler_generates_the_unrolled_samplers_tokens():
    (_, params), (_, s_params) = unrolled_and_scanned(TINY, seed=1)
    # More requests than slots and row packing: prefill, windowed decode, band write-back
    # and slot swaps all run on the stacked cache (one window and one prompt bucket: few
    # compiles).
    kw = dict(max_len=32, slots=8, decode_row_buckets=(2,), decode_split_windows=False,
              prompt_buckets=(16,))
    unrolled, scanned = _sampler(TINY, params, **kw), _sampler(
        dataclasses.replace(TINY, scan_layers=True), s_params, **kw)
    budgets = [2, 14, 3, 12, 4, 5, 6, 9, 11]
    requests = [Request(p, max_new_tokens=b)
                for p, b in zip(_prompts(9, seed=4), budgets, strict=True)]

    want, got = unrolled.generate(requests), scanned.generate(requests)

    assert scanned.cache.is_stacked and not unrolled.cache.is_stacked
    for w, g, b in zip(want, got, budgets, strict=True):
        assert g.tokens == w.tokens and len(g.tokens) == b
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=1e-4, atol=1e-5)
