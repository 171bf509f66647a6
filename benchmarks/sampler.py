"""Sampler throughput vs transformers ``generate`` on a tiny Llama-shaped model (CPU, greedy).

  python benchmarks/sampler.py            # full (~3 minutes on 2 CPU cores)
  python benchmarks/sampler.py --quick    # smaller workloads, best-of-1

The same random weights go into meshrl (save_hf_checkpoint -> load_hf_checkpoint) and into
transformers (from_pretrained of that directory). Figures:

* ratio_fixed: tokens/s vs transformers, batch 32, prompt 64, exactly 128 new tokens.
* ratio_longtail: 256 requests, prompt 64, max_new_tokens ~ seeded lognormal clipped to
  [8, 512]; meshrl continuous batching over 32 slots vs transformers in arrival-order batches
  of 32 (each runs to its longest request); useful (requested) tokens/s.
* cb_speedup: the long-tail workload, meshrl continuous vs meshrl static batching
  (``generate`` admits the longest budgets first); cb_speedup_fifo: the same with the requests
  admitted first come, first served (``longest_first=False``, as the async engine admits).
* cache_growth: the fixed workload's time with max_len 1024 over max_len 192.
* first_call_s: seconds from building the max_len-1024 sampler to the fixed workload's
  completions (compiling on first use; no warm-up call); compiled_programs: the programs
  that sampler compiled over the whole benchmark (what the workloads needed).

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
from meshrl.inference.engine import Request, Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.models.hf import load_hf_checkpoint, save_hf_checkpoint

CFG = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=2048)
PROMPT, SLOTS = 64, 32


def _best(fn: Callable[[], float], n: int, label: str) -> float:
    times = [fn() for _ in range(n)]
    print(f"  {label}: best {min(times):.3f}s  spread {max(times) - min(times):.3f}s  "
          f"runs {[round(t, 3) for t in times]}", flush=True)
    return min(times)


def _best_interleaved(fns: dict[str, Callable[[], float]], n: int) -> list[float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            times[k].append(fn())
    for k, ts in times.items():
        print(f"  {k}: best {min(ts):.3f}s  spread {max(ts) - min(ts):.3f}s  "
              f"runs {[round(t, 3) for t in ts]}", flush=True)
    return [min(ts) for ts in times.values()]


def _sampler(params, max_len: int, chunk: int, first: list[Request]) -> tuple[Sampler, float]:
    """A fresh sampler (no ``warmup``: it compiles what a call needs when it first needs it)
    and the seconds from building it to ``first``'s completions: the start-up a user sees."""
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    cfg = SamplerConfig(max_len=max_len, slots=SLOTS, max_new_tokens=128, temperature=0.0,
                        decode_chunk=chunk, prompt_buckets=(PROMPT,))
    t = time.perf_counter()
    s = Sampler(CFG, cfg, mesh, params)
    s.generate(first)
    first_call_s = time.perf_counter() - t
    print(f"  first call max_len={max_len}: {first_call_s:.1f}s, {s.compile_count()} "
          f"programs", flush=True)
    return s, first_call_s


def _warm(sampler: Sampler, fn: Callable[[], float], label: str) -> None:
    """One untimed pass of a workload: it compiles the variants that workload needs, so the
    timed repetitions measure generation only."""
    before = sampler.compile_count()
    dt = fn()
    print(f"  warm pass {label}: {dt:.1f}s, {sampler.compile_count() - before} new programs",
          flush=True)


def _timed_generate(sampler: Sampler, requests: list[Request], longest_first: bool = True
                    ) -> Callable[[], float]:
    def run() -> float:
        t = time.perf_counter()
        outs = sampler.generate(requests, longest_first=longest_first)
        dt = time.perf_counter() - t
        assert [len(o.tokens) for o in outs] == [r.max_new_tokens for r in requests]
        return dt
    return run


def _timed_static(sampler: Sampler, requests: list[Request]) -> Callable[[], float]:
    def run() -> float:
        t = time.perf_counter()
        for lo in range(0, len(requests), SLOTS):
            sampler.generate(requests[lo:lo + SLOTS])  # no refill until the batch is done
        return time.perf_counter() - t
    return run


def _hf_generate(model, prompts: np.ndarray, new_tokens: int) -> float:
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, eos_token_id=None)
    dt = time.perf_counter() - t
    assert out.shape[1] == prompts.shape[1] + new_tokens, out.shape
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller workloads, best-of-1")
    ap.add_argument("--compile_cache", action="store_true",
                    help="keep JAX's persistent compilation cache on (as configured by "
                         "JAX_COMPILATION_CACHE_DIR): first_call_s of a warm cache")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    reps = 1 if args.quick else 3
    n_fixed_new = 32 if args.quick else 128
    n_requests = 64 if args.quick else 256
    rng = np.random.default_rng(0)

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(create_model(CFG, seed=0), tmp)
        params = split_model(load_hf_checkpoint(tmp))[1]
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    fixed_prompts = rng.integers(3, CFG.vocab_size, size=(SLOTS, PROMPT))
    fixed = [Request(p.tolist(), max_new_tokens=n_fixed_new) for p in fixed_prompts]
    budgets = np.clip(rng.lognormal(np.log(48.0), 1.0, n_requests), 8, 512).astype(int)
    tail_prompts = rng.integers(3, CFG.vocab_size, size=(n_requests, PROMPT))
    tail = [Request(p.tolist(), max_new_tokens=int(b)) for p, b in zip(tail_prompts, budgets)]
    useful = int(budgets.sum())

    print(f"fixed: batch {SLOTS}, prompt {PROMPT}, {n_fixed_new} new tokens", flush=True)
    # JAX's persistent compilation cache would turn the first call into a load: off here, so
    # first_call_s is the cold start (BUILD_NOTES.md reports the warm one separately).
    jax.config.update("jax_enable_compilation_cache", args.compile_cache)
    small, _ = _sampler(params, 192, 16, fixed)
    big, first_call_s = _sampler(params, 1024, 16, fixed)
    # Interleaved repetitions: a load spike from elsewhere hits all three alike.
    t_ours, t_big, t_hf = _best_interleaved({
        "meshrl (max_len 192)": _timed_generate(small, fixed),
        "meshrl (max_len 1024)": _timed_generate(big, fixed),
        "transformers": lambda: _hf_generate(hf, fixed_prompts, n_fixed_new)}, reps)
    fixed_tokens = SLOTS * n_fixed_new

    print(f"long tail: {n_requests} requests, {useful} useful tokens, max "
          f"{budgets.max()}", flush=True)
    _warm(big, _timed_generate(big, tail), "long tail")
    _warm(big, _timed_generate(big, tail, longest_first=False), "long tail, first come first served")
    _warm(big, _timed_static(big, tail), "static")
    # Interleaved, as the fixed workload: a slow stretch of the machine must not land on one
    # side of cb_speedup only.
    t_cb, t_fifo, t_static = _best_interleaved({
        "meshrl continuous": _timed_generate(big, tail),
        "meshrl continuous, first come first served": _timed_generate(big, tail, longest_first=False),
        "meshrl static": _timed_static(big, tail)}, reps)

    def hf_tail() -> float:
        total = 0.0
        for lo in range(0, n_requests, SLOTS):
            total += _hf_generate(hf, tail_prompts[lo:lo + SLOTS], int(budgets[lo:lo + SLOTS].max()))
        return total
    t_hf_tail = _best(hf_tail, 1, "transformers batches")

    result = {
        "benchmark": "sampler",
        "ratio_fixed": round(t_hf / t_ours, 3),
        "ratio_longtail": round(t_hf_tail / t_cb, 3),
        "cb_speedup": round(t_static / t_cb, 3),
        "cb_speedup_fifo": round(t_static / t_fifo, 3),
        "cache_growth": round(t_big / t_ours, 3),
        "meshrl_fixed_tok_s": round(fixed_tokens / t_ours, 1),
        "meshrl_fixed_1024_tok_s": round(fixed_tokens / t_big, 1),
        "hf_fixed_tok_s": round(fixed_tokens / t_hf, 1),
        "meshrl_longtail_useful_tok_s": round(useful / t_cb, 1),
        "meshrl_static_useful_tok_s": round(useful / t_static, 1),
        "hf_longtail_useful_tok_s": round(useful / t_hf_tail, 1),
        "first_call_s": round(first_call_s, 2),
        "compiled_programs": big.compile_count(),
        "quick": args.quick,
        "platform": jax.devices()[0].platform,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
