"""Asynchronous vs synchronous RL throughput: trained tokens/s of the RL job with
``rollout.max_staleness = 2`` vs the same job synchronous (``0``) on the same budget (steps,
batch, model, data, placement, reward).

Baseline: synchronous RL, the competent default of an RL job (no staleness, nothing dropped),
running the same code, warm-up (every sampler variant and train step compiled first, the first
``--warmup`` steps dropped) and measured steps as the asynchronous run.

The workload is built to show what asynchrony buys: completion lengths are long-tailed (a
Pareto draw per request; the random tiny model never stops early because stop ids are removed)
and the reward has a fixed latency per call (a sleep in the reward worker). Synchronous RL waits
for the longest completion and the slowest reward of every batch before the trainer starts;
asynchronous RL keeps generating and scoring the next batches meanwhile. Both runs use the real
job (``jobs.rl.build``: sampler, runner, reward pool, train step, weight handoff), with no SFT warm
start and no evaluation. Steady-state throughput skips the first ``--warmup`` steps and is
measured over the rest (wall time from the end of step ``--warmup`` to the end of the last
step): 90 steps by default, since a sync step lasts as long as its batch's longest completion and
a few dozen steps sample the Pareto tail too thinly to compare.

Figures, per mode (``sync_*``, ``async_*``): ``trained_tokens_s``, the completion tokens that
carry loss in the batches the trainer trained on (the loss mask), per second;
``generated_tokens_s``, every completion token the sampler finished in the measured window,
groups later dropped as stale included; ``trained_share`` = trained / generated tokens (what
dropping stale groups costs); ``samples_s``, trained sequences per second (secondary). The two
modes run ``--repeats`` times, interleaved round by round with the order rotating
(``benchmarks/figures.py``), so a noisy stretch of the machine hits both. The headline ``ratio``
is async / sync trained tokens/s, paired within each round, median with ``ratio_spread``
(target: ``ratio >= 1.4``); ``samples_ratio`` is the same on samples/s. Earlier versions
headlined the samples/s ratio. It favoured async: a long completion finishes late, so the groups
async drops as stale are mostly long ones, and the batches it trains on are biased towards short
completions, which count as many samples but fewer tokens than sync's.

``--reward-latency-ms`` and ``--reward-workers`` set the reward's latency (default 2 ms, a
cheap local verifier) and the reward pool's size. The sampler (96 slots, decode chunks of 4)
packs live sequences into 12, 24, 48 or 96 rows (``sampler.decode_row_buckets``).

Placement (``--placement``): ``split`` (default) gives the sampler one device and the trainer
the rest (``rl.placement = "split"``), the disaggregated set-up asynchronous RL is built for
(AReaL's): sync leaves each side idle while the other works, async keeps both busy. On a CPU
host the script asks XLA for 2 host devices, so the two sides run as two concurrent programs.
``colocated`` runs both on the same devices: the train step and the decode calls share one
device, and async gains mostly the time sync leaves it idle (reward latency, host work). Both
modes of one run always share the placement.

  python benchmarks/rl_async.py                          # 3 rounds of 100 steps per mode
  python benchmarks/rl_async.py --placement colocated
  python benchmarks/rl_async.py --quick                  # smoke check: one round, 30 steps

Last line: {"benchmark": "rl_async", "ratio", "ratio_spread", "async_trained_tokens_s",
"sync_trained_tokens_s", "async_generated_tokens_s", "sync_generated_tokens_s",
"async_trained_share", "sync_trained_share", "samples_ratio", "async_samples_s",
"sync_samples_s", ..., "sync_cpu_cores", "async_cpu_cores", "ratio_cpu_bound", "target",
"target_met" (null for fewer than 3 rounds, as ``--quick``), "quick", "estimates"
(``["ratio_cpu_bound"]``), "valid"} (per-mode figures are medians over the rounds, each with its
``_spread``). ``*_cpu_cores`` is the job's process CPU time over its step time in the measured
steps (reward worker processes not included); ``ratio_cpu_bound = cores / sync_cpu_cores`` is
the ratio an async run would reach doing sync's work with every core busy. On a small CPU host
it estimates the ceiling; it is not a hard one (a run slowed by the host without using more
CPU, or an async run doing less work than sync, can pass it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np

from meshrl.benchmarks import figures

# Read in the reward workers: main() sets it before the pool's processes start.
LATENCY_ENV = "MESHRL_BENCH_REWARD_LATENCY_S"
LENGTH_CAP = 48
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
TARGET = 1.4  # median async / sync trained tokens/s


def latency_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A reward with a fixed latency per call (a remote verifier, a sandbox start-up)."""
    time.sleep(float(os.environ.get(LATENCY_ENV, "0.002")))
    return [float(len(c) % 2) for c in completions]


class LongTailEngine:
    """Wraps the engine: each request's length is a Pareto draw (seeded by the request); appends
    (end time, completion tokens) of every finished request to ``finished``."""

    def __init__(self, engine: Any, finished: list[tuple[float, int]], seed: int = 0) -> None:
        self.engine, self.finished, self.seed = engine, finished, seed

    @property
    def version(self) -> int:
        return self.engine.version

    async def agenerate(self, request: Any) -> Any:
        rng = np.random.default_rng([self.seed, request.seed])
        n = int(min(LENGTH_CAP, 2 + 2 * rng.pareto(1.0)))
        if request.max_new_tokens is not None:
            n = min(n, request.max_new_tokens)
        out = await self.engine.agenerate(
            dataclasses.replace(request, max_new_tokens=max(n, 1), stop_ids=()))
        self.finished.append((time.perf_counter(), len(out.tokens)))
        return out


def make_config(max_staleness: int, steps: int, reward_workers: int = 2,
                placement: str = "colocated") -> Any:
    from meshrl.configs.loader import base_config, from_config_dict

    cfg = base_config("rl")
    cfg.mesh.data = 1
    cfg.rl.placement = placement
    cfg.rl.sampler_devices = 1 if placement == "split" else 0
    cfg.model.vocab_size = 256
    cfg.model.hidden_size = 64
    cfg.model.intermediate_size = 172
    cfg.model.num_layers = 2
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 2
    cfg.data.source = "arithmetic"
    cfg.data.max_prompt_len = 16
    cfg.data.eval_examples = 0
    cfg.trainer.steps = steps
    cfg.trainer.seq_len = 64
    cfg.trainer.learning_rate = 1e-4
    cfg.trainer.log_every = 1000
    cfg.sampler.max_len = 64
    cfg.sampler.max_new_tokens = LENGTH_CAP
    cfg.sampler.prompt_buckets = (16,)
    cfg.sampler.slots = 96
    cfg.sampler.decode_chunk = 4
    # Most of a group's samples end early and a few run long, so the live rows swing between a
    # handful and a few dozen: doubling row buckets keep a chunk on at most ~2x its live rows
    # (the automatic (12, 96) ran any chunk with 13+ live rows on all 96).
    cfg.sampler.decode_row_buckets = (12, 24, 48)
    cfg.rollout.group_size = 4
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.max_staleness = max_staleness
    cfg.rollout.filter_equal_groups = False
    cfg.reward.names = ("meshrl.benchmarks.rl_async:latency_reward",)
    cfg.reward.num_workers = reward_workers
    cfg.rl.warm_start_steps = 0  # random init: throughput does not need skill
    return from_config_dict(without_side_outputs(cfg))


def without_side_outputs(cfg: Any) -> Any:
    """``cfg`` with no checkpoints, published versions, progress bar, tensorboard or INFO logs:
    a benchmark's steps time the RL loop, not its artifacts."""
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.publish_every = 10_000
    cfg.checkpoint.async_save = False
    cfg.logging.progress_bar = False
    cfg.logging.tensorboard = False
    cfg.logging.level = "WARNING"
    return cfg


def on_each_step(trainer: Any, fn: Callable[[dict[str, float]], None]) -> None:
    """Calls ``fn(record)`` each time ``trainer``'s train engine records a step's metrics row.

    The RL loop records a step after the step's timed window closes (``perf/step_time_s`` ends
    at the weight handoff; what follows until the next step is not step time) and before it asks
    the runner for the next batch, so ``fn``'s own time is no step's time."""
    engine = trainer.engine
    log = engine.log

    def log_then_call(result: Any, rate: float) -> None:
        log(result, rate)
        fn(engine.history[-1])
    engine.log = log_then_call


def run_mode(max_staleness: int, steps: int, warmup: int, reward_workers: int,
             placement: str = "colocated") -> dict[str, float]:
    """One RL run; steady-state figures over the steps after ``warmup``: trained and generated
    tokens/s, samples/s, the measured wall time, the max staleness seen, mean ms per step
    waiting for the batch and on the trainer's path (batch build, train step, weight handoff),
    and the CPU cores the process kept busy."""
    from meshrl.jobs import rl as rl_job
    from meshrl.trainer.spec import rl_batch_size

    config = make_config(max_staleness, steps, reward_workers, placement)
    finished: list[tuple[float, int]] = []  # (end time, tokens) of every completion
    trained: dict[int, int] = {}  # step -> loss tokens of its batch
    step_ends: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as workdir:
        trainer = rl_job.build(config, workdir)
        try:
            build = trainer.train_batch

            def count(rb: Any, version: int) -> Any:
                trained[version + 1] = int(rb.loss_mask.sum())
                return build(rb, version)
            trainer.train_batch = count
            on_each_step(trainer, lambda record: step_ends.__setitem__(
                int(record["step"]), time.perf_counter()))
            # Compile every sampler variant first (re-prefill after a mid-generation weight
            # update included) and the train step of every row count, so neither mode pays
            # compiles inside the measured steps.
            trainer.sampler.warmup(recompute=True)
            trainer.precompile()  # the train step of every packed row count
            summary = asyncio.run(trainer.arun(
                rollout_sampler=lambda engine: LongTailEngine(engine, finished)))
        finally:
            trainer.close()
    hist = trainer.history[warmup:]
    total = {k: sum(h[f"perf/{k}"] for h in hist)
             for k in ("step_time_s", "rollout_wait_s", "process_cpu_s")}
    n = len(hist)
    t0, t1 = step_ends[warmup], step_ends[steps]
    wall = t1 - t0
    trained_tokens = sum(trained[s] for s in range(warmup + 1, steps + 1))
    generated = sum(k for t, k in finished if t0 < t <= t1)
    return {"trained_tokens_s": trained_tokens / wall, "generated_tokens_s": generated / wall,
            "trained_share": trained_tokens / max(generated, 1),
            "samples_s": rl_batch_size(config) * n / wall, "wall_s": wall,
            "staleness_seen": int(summary["max_staleness_seen"]),
            "wait_ms": 1e3 * total["rollout_wait_s"] / n,
            "train_ms": 1e3 * (total["step_time_s"] - total["rollout_wait_s"]) / n,
            "cpu_cores": total["process_cpu_s"] / total["step_time_s"]}


def summarize(runs: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    """Per-mode medians with spreads over the rounds, and the ratios paired round by round."""
    out: dict[str, Any] = {
        **figures.spread("ratio", figures.paired_ratios(
            [a["trained_tokens_s"] for a in runs[2]], [s["trained_tokens_s"] for s in runs[0]]),
            3),
        **figures.spread("samples_ratio", figures.paired_ratios(
            [a["samples_s"] for a in runs[2]], [s["samples_s"] for s in runs[0]]), 3)}
    for mode, ms in (("async", 2), ("sync", 0)):
        for key, digits in (("trained_tokens_s", 1), ("generated_tokens_s", 1),
                            ("trained_share", 3), ("samples_s", 2), ("wait_ms", 1),
                            ("train_ms", 1), ("cpu_cores", 2)):
            out.update(figures.spread(f"{mode}_{key}", [r[key] for r in runs[ms]], digits))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=figures.MIN_ROUNDS)
    parser.add_argument("--reward-latency-ms", type=float, default=2.0)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--placement", choices=("split", "colocated"), default="split")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: one round of 30 steps (not a headline figure)")
    args = parser.parse_args()
    steps, repeats = (30, 1) if args.quick else (args.steps, args.repeats)
    if not 1 <= args.warmup < steps:
        parser.error(f"--warmup {args.warmup}: must be in [1, steps) with {steps} steps")
    if not args.quick and repeats < figures.MIN_ROUNDS:
        parser.error(f"--repeats {repeats}: a headline needs >= {figures.MIN_ROUNDS} rounds")
    os.environ[LATENCY_ENV] = str(args.reward_latency_ms / 1000.0)
    # Before JAX starts: on a CPU host, one device each for the sampler and the trainer (the
    # model's mesh is one device; colocated, it must be the only one).
    n_host = 2 if args.placement == "split" else 1
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags:
        parser.error(f"XLA_FLAGS sets {HOST_DEVICES_FLAG}: unset it, the script asks for "
                     f"{n_host} host device(s) itself")
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={n_host}"
    import jax

    if len(jax.devices()) != n_host:
        parser.error(f"--placement {args.placement} needs {n_host} device(s) (one for the "
                     f"model's mesh{', one for the sampler' if n_host == 2 else ''}), found "
                     f"{len(jax.devices())} {jax.devices()[0].platform} devices")
    from meshrl.utils import log

    log.setup("WARNING")
    runs: dict[int, list[dict[str, float]]] = {0: [], 2: []}

    def side(ms: int) -> Callable[[], float]:
        def one() -> float:
            out = run_mode(ms, steps, args.warmup, args.reward_workers, args.placement)
            runs[ms].append(out)
            print(f"round {len(runs[ms]) - 1}: max_staleness={ms}: "
                  f"{out['trained_tokens_s']:.0f} trained / {out['generated_tokens_s']:.0f} "
                  f"generated tokens/s, {out['samples_s']:.1f} samples/s, max staleness seen "
                  f"{out['staleness_seen']}; per step {out['wait_ms']:.1f} ms waiting for the "
                  f"batch, {out['train_ms']:.1f} ms on the trainer's path; "
                  f"{out['cpu_cores']:.2f} CPU cores busy", flush=True)
            return out["wall_s"]
        return one
    # Each run drops its own warm-up steps, so no untimed round is needed.
    figures.interleave({"sync": side(0), "async": side(2)}, repeats, warmup=0, verbose=False)
    result = summarize(runs)
    cores = figures.cpu_threads()
    sync_cores = median(r["cpu_cores"] for r in runs[0])
    figures.emit({"benchmark": "rl_async", **result, "target": TARGET,
                  # one round (--quick) is a smoke check, not a headline
                  "target_met": (result["ratio"] >= TARGET if repeats >= figures.MIN_ROUNDS
                                 else None), "quick": args.quick, "cores": cores,
                  # Async overlaps the work sync does one phase at a time; on a CPU host,
                  # doing the same work, it gains about the cores sync leaves idle.
                  "ratio_cpu_bound": round(cores / sync_cores, 3),
                  "max_staleness_seen": max(r["staleness_seen"] for r in runs[2]),
                  "placement": args.placement, "repeats": repeats, "steps": steps,
                  "warmup_steps": args.warmup, "reward_latency_ms": args.reward_latency_ms,
                  "reward_workers": args.reward_workers,
                  **figures.estimates("ratio_cpu_bound")})


if __name__ == "__main__":
    main()
