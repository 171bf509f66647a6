"""Asynchronous vs synchronous RL throughput: trained samples/s of the RL job with
``rollout.max_staleness = 2`` vs ``0`` on the same budget (steps, batch, model, data).

The workload is built to show what asynchrony buys: completion lengths are long-tailed (a
Pareto draw per request; the random tiny model never stops early because stop ids are removed)
and the reward has a fixed latency per call (a sleep in the reward worker). Synchronous RL waits
for the longest completion and the slowest reward of every batch before the trainer starts;
asynchronous RL keeps generating and scoring the next batches meanwhile. Both runs use the real
job (``RLTrainer``: sampler, runner, reward pool, train step, weight handoff), with no SFT warm
start and no evaluation. Steady-state throughput skips the first ``--warmup`` steps and is
measured over the rest: 90 steps by default, since a sync step lasts as long as its batch's
longest completion and a few dozen steps sample the Pareto tail too thinly to compare.

The two modes run ``--repeats`` times, interleaved (sync, async, sync, async, ...), so a noisy
stretch of the machine hits both; the headline ``ratio`` is the median of the paired ratios, with
the spread beside it. ``--reward-latency-ms`` and ``--reward-workers`` set the reward's latency
(default 2 ms, a cheap local verifier) and the reward pool's size. The sampler (96 slots, decode
chunks of 4) packs live sequences into 12, 24, 48 or 96 rows (``sampler.decode_row_buckets``).

Placement (``--placement``): ``split`` (default) gives the sampler one device and the trainer
the rest (``rl.placement = "split"``), the disaggregated set-up asynchronous RL is built for
(AReaL's): sync leaves each side idle while the other works, async keeps both busy. On a CPU
host the script asks XLA for 2 host devices, so the two sides run as two concurrent programs.
``colocated`` runs both on the same devices: the train step and the decode calls share one
device, and async gains mostly the time sync leaves it idle (reward latency, host work). Both
modes of one run always share the placement.

  python benchmarks/rl_async.py                          # ~14 minutes on 2 CPU cores
  python benchmarks/rl_async.py --placement colocated
  python benchmarks/rl_async.py --quick                  # one pair, 30 steps

Last line: {"benchmark": "rl_async", "async_samples_s", "sync_samples_s", "ratio", "ratio_min",
"ratio_max", ..., "sync_cpu_cores", "async_cpu_cores", "ratio_cpu_bound", ...} (medians over the
repeats). ``*_cpu_cores`` is the job's process CPU time over its wall time in the measured steps
(reward worker processes not included); ``ratio_cpu_bound = cores / sync_cpu_cores`` is the
ratio an async run would reach doing sync's work with every core busy. On a small CPU host it
estimates the ceiling; it is not a hard one (a run slowed by the host without using more CPU,
or an async run doing less work than sync, can pass it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time
from statistics import median
from typing import Any

import numpy as np

# Read in the reward workers: main() sets it before the pool's processes start.
LATENCY_ENV = "MESHRL_BENCH_REWARD_LATENCY_S"
LENGTH_CAP = 48
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def latency_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A reward with a fixed latency per call (a remote verifier, a sandbox start-up)."""
    time.sleep(float(os.environ.get(LATENCY_ENV, "0.002")))
    return [float(len(c) % 2) for c in completions]


class LongTailEngine:
    """Wraps the engine: each request's length is a Pareto draw (seeded by the request)."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        self.engine, self.seed = engine, seed

    @property
    def version(self) -> int:
        return self.engine.version

    async def agenerate(self, request: Any) -> Any:
        rng = np.random.default_rng([self.seed, request.seed])
        n = int(min(LENGTH_CAP, 2 + 2 * rng.pareto(1.0)))
        if request.max_new_tokens is not None:
            n = min(n, request.max_new_tokens)
        return await self.engine.agenerate(
            dataclasses.replace(request, max_new_tokens=max(n, 1), stop_ids=()))


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


def run_mode(max_staleness: int, steps: int, warmup: int, reward_workers: int,
             placement: str = "colocated") -> dict[str, float]:
    """One RL run; steady-state figures over the steps after ``warmup``: samples/s, the max
    staleness seen, mean ms per step waiting for the batch and on the trainer's path (batch
    build, train step, weight handoff), and the CPU cores the process kept busy."""
    from meshrl.jobs import rl as rl_loop

    config = make_config(max_staleness, steps, reward_workers, placement)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = rl_loop.RLTrainer(config, workdir)
        try:
            # Compile every sampler variant first (re-prefill after a mid-generation weight
            # update included) and the train step of every row count, so neither mode pays
            # compiles inside the measured steps.
            trainer.sampler.warmup(recompute=True)
            trainer.precompile()  # the train step of every packed row count
            summary = asyncio.run(trainer.arun(rollout_engine=LongTailEngine))
        finally:
            trainer.close()
    hist = trainer.history[warmup:]
    total = {k: sum(h[f"perf/{k}"] for h in hist)
             for k in ("step_time_s", "rollout_wait_s", "process_cpu_s")}
    n = len(hist)
    return {"samples_s": rl_loop.rl_batch_size(config) * n / total["step_time_s"],
            "staleness_seen": int(summary["max_staleness_seen"]),
            "wait_ms": 1e3 * total["rollout_wait_s"] / n,
            "train_ms": 1e3 * (total["step_time_s"] - total["rollout_wait_s"]) / n,
            "cpu_cores": total["process_cpu_s"] / total["step_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reward-latency-ms", type=float, default=2.0)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--placement", choices=("split", "colocated"), default="split")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps, repeats = (30, 1) if args.quick else (args.steps, args.repeats)
    if not 0 <= args.warmup < steps:
        parser.error(f"--warmup {args.warmup}: must be in [0, steps) with {steps} steps")
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
    for r in range(repeats):
        for ms in (0, 2):
            out = run_mode(ms, steps, args.warmup, args.reward_workers, args.placement)
            runs[ms].append(out)
            print(f"repeat {r}: max_staleness={ms}: {out['samples_s']:.1f} samples/s, max "
                  f"staleness seen {out['staleness_seen']}; per step {out['wait_ms']:.1f} ms "
                  f"waiting for the batch, {out['train_ms']:.1f} ms on the trainer's path; "
                  f"{out['cpu_cores']:.2f} CPU cores busy", flush=True)
    ratios = [a["samples_s"] / s["samples_s"] for a, s in zip(runs[2], runs[0])]
    cores = len(os.sched_getaffinity(0))

    def med(ms: int, key: str, digits: int = 1) -> float:
        return round(median(x[key] for x in runs[ms]), digits)

    print(json.dumps({"benchmark": "rl_async", "async_samples_s": med(2, "samples_s", 2),
                      "sync_samples_s": med(0, "samples_s", 2),
                      "ratio": round(median(ratios), 3), "ratio_min": round(min(ratios), 3),
                      "ratio_max": round(max(ratios), 3),
                      # Where a step's time goes (medians): async is trainer-bound when its
                      # wait is ~0, and can then gain at most what sync spends waiting.
                      "sync_wait_ms": med(0, "wait_ms"), "sync_train_ms": med(0, "train_ms"),
                      "async_wait_ms": med(2, "wait_ms"), "async_train_ms": med(2, "train_ms"),
                      # Async overlaps the work sync does one phase at a time; on a CPU host,
                      # doing the same work, it gains about the cores sync leaves idle:
                      # ratio_cpu_bound = cores / sync_cpu_cores (same work, every core busy).
                      "sync_cpu_cores": med(0, "cpu_cores", 2),
                      "async_cpu_cores": med(2, "cpu_cores", 2), "cores": cores,
                      "ratio_cpu_bound": round(cores / med(0, "cpu_cores", 3), 3),
                      "placement": args.placement, "repeats": repeats, "steps": steps,
                      "warmup_steps": args.warmup,
                      "reward_latency_ms": args.reward_latency_ms,
                      "reward_workers": args.reward_workers}))


if __name__ == "__main__":
    main()
