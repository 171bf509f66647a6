"""One GRPO step at the speed of its parts: the RL job's per-phase times beside each phase's floor.

Shape: a Llama-shaped model (4 layers, hidden 256, SwiGLU MLP 688, 4 heads, 2 KV heads, vocab
1,024, untied embeddings, float32), 8 prompts x 4 samples per step, every completion exactly 64
tokens (``Request.min_new_tokens``), one optimizer update per batch, random init (no warm start,
no eval), colocated on one CPU device. The real job runs (``RLTrainer``: runner, sampler, reward
pool, train step, handoff), synchronous (``max_staleness = 0``) and with ``max_staleness = 1``.

Per synchronous step after ``--warmup`` steps (medians): ``generate`` (first request submitted
to last completion), ``reward`` (last completion to last reward), ``batch_build``, ``train``
(dispatch to params ready), ``handoff`` (the sampler's copy) and ``other`` (the rest: queueing,
metrics, the event loop). Floors, measured in the same run after the RL runs: the sampler alone
generating the last step's 32 requests (``Sampler.generate``), a minimal jitted train step (plain
JAX and optax, the same model math and loss on the last step's batch, params donated) and a raw
device copy of the params. ``floor_s`` is their sum.

  python benchmarks/rl_step.py            # ~3 minutes on 2 CPU cores
  python benchmarks/rl_step.py --steps 12 --warmup 4

Last line: {"benchmark": "rl_step", "sync_step_s", "async_step_s", "floor_s", "overhead_ratio"
(sync_step_s / floor_s), "train_s", "train_floor_s", "train_ratio", "generate_s",
"generate_floor_s", "handoff_s", "handoff_floor_s", ...}. Targets: overhead_ratio <= 1.25,
train_ratio <= 1.15 (issue 22).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

NEW_TOKENS, PROMPT_BUCKET = 64, 16
SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
             num_heads=4, num_kv_heads=2, tie_embeddings=False)
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def make_config(max_staleness: int, steps: int) -> Any:
    from meshrl.benchmarks.rl_async import without_side_outputs
    from meshrl.configs.loader import base_config, from_config_dict

    cfg = base_config("rl")
    cfg.mesh.data = 1
    cfg.model.update(**SHAPE)
    cfg.data.source = "arithmetic"
    cfg.data.max_prompt_len = PROMPT_BUCKET
    cfg.data.eval_examples = 0
    cfg.reward.names = ("math",)
    cfg.trainer.steps = steps
    cfg.trainer.seq_len = PROMPT_BUCKET + NEW_TOKENS
    cfg.trainer.learning_rate = 1e-5
    cfg.trainer.log_every = 1000
    cfg.sampler.max_len = PROMPT_BUCKET + NEW_TOKENS
    cfg.sampler.max_new_tokens = NEW_TOKENS
    cfg.sampler.prompt_buckets = (PROMPT_BUCKET,)
    cfg.sampler.slots = 64  # two batches in flight with max_staleness 1
    cfg.rollout.group_size = 4
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.max_staleness = max_staleness
    cfg.rollout.filter_equal_groups = False  # a random model earns equal (zero) rewards
    cfg.rl.warm_start_steps = 0
    return from_config_dict(without_side_outputs(cfg))


class ExactLengthEngine:
    """Wraps the engine: every request generates exactly ``NEW_TOKENS`` tokens; records each
    request's (sampler version at submission, start, end) and the request itself."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[int, float, float, Any]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def agenerate(self, request: Any) -> Any:
        request = dataclasses.replace(request, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS)
        v, t0 = self.engine.version, time.perf_counter()
        out = await self.engine.agenerate(request)
        self.calls.append((v, t0, time.perf_counter(), request))
        return out


class TimedRewards:
    """Wraps the reward pool: records when each scoring call returns."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.ends = pool, []

    async def ascore(self, *args: Any, **kwargs: Any) -> list[float]:
        out = await self.pool.ascore(*args, **kwargs)
        self.ends.append(time.perf_counter())
        return out

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()

    def close(self) -> None:
        self.pool.close()


def run_mode(max_staleness: int, steps: int, warmup: int,
             floors: Callable[[Any, Any, ExactLengthEngine], dict[str, float]] | None = None
             ) -> dict[str, float]:
    """One RL run: the median step time over the steps after ``warmup``; synchronous runs add
    the median phases, and ``floors(trainer, last_batch, engine)`` runs before the trainer
    closes."""
    from meshrl.jobs import rl as rl_loop

    config = make_config(max_staleness, steps)
    holder: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        trainer = rl_loop.RLTrainer(config, workdir)
        try:
            trainer.reward_pool = rewards = TimedRewards(trainer.reward_pool)
            build = trainer.train_batch

            def keep_last(rb: Any, version: int) -> Any:
                holder["rollout"] = rb
                return build(rb, version)
            trainer.train_batch = keep_last
            trainer.precompile()

            def wrap(engine: Any) -> ExactLengthEngine:
                holder["engine"] = ExactLengthEngine(engine)
                return holder["engine"]
            asyncio.run(trainer.arun(rollout_engine=wrap))
            out = {"step_s": statistics.median(
                h["perf/step_time_s"] for h in trainer.history[warmup:])}
            if max_staleness == 0:
                out.update(phases(trainer.history, holder["engine"].calls, rewards.ends,
                                  warmup))
            if floors is not None:
                out.update(floors(trainer, holder["rollout"], holder["engine"]))
        finally:
            trainer.close()
    return out


def phases(history: list[dict[str, float]], calls: list[tuple[int, float, float, Any]],
           reward_ends: list[float], warmup: int) -> dict[str, float]:
    """Median per-phase seconds of synchronous steps (step k generates at version k - 1)."""
    starts = {v: min(t0 for w, t0, _, _ in calls if w == v) for v, *_ in calls}
    rows: dict[str, list[float]] = {k: [] for k in ("generate", "reward", "batch_build",
                                                    "train", "handoff", "other")}
    for h in history[warmup:]:
        v = int(h["step"]) - 1
        gen = [(t0, t1) for w, t0, t1, _ in calls if w == v]
        gen_end = max(t1 for _, t1 in gen)
        window_end = starts.get(v + 1, float("inf"))
        reward_end = max([t for t in reward_ends if gen_end <= t < window_end],
                         default=gen_end)
        got = {"generate": gen_end - min(t0 for t0, _ in gen), "reward": reward_end - gen_end,
               "batch_build": h["perf/batch_build_s"], "train": h["perf/train_step_s"],
               "handoff": h["perf/handoff_s"]}
        got["other"] = h["perf/step_time_s"] - sum(got.values())
        for k, x in got.items():
            rows[k].append(x)
    return {f"{k}_s": statistics.median(x) for k, x in rows.items()}


# ---- floors ----------------------------------------------------------------------------------


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def generate_floor(trainer: Any, engine: ExactLengthEngine, repeats: int) -> float:
    """The sampler alone (a fresh one, same settings and weights) on the last step's requests."""
    from meshrl.inference.engine import Sampler
    from meshrl.mesh import rules_for

    last = max(v for v, *_ in engine.calls)
    requests = [r for v, _, _, r in engine.calls if v == last]
    sampler = Sampler(trainer.model_cfg, trainer.config.sampler, trainer.sampler_mesh,
                      trainer.state.params, version=0, rules=rules_for("sample"))
    return _median_time(lambda: sampler.generate(requests), repeats)


def handoff_floor(params: Any, repeats: int) -> float:
    """A raw device copy of every param leaf (one jitted call)."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(params)
    copy = jax.jit(lambda xs: [jnp.array(x, copy=True) for x in xs])
    return _median_time(lambda: jax.block_until_ready(copy(leaves)), repeats)


def train_floor(trainer: Any, rollout: Any, repeats: int) -> float:
    """A minimal jitted GRPO step (plain JAX + optax) on the last step's batch, packed as the
    job packed it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshrl.benchmarks import minimal_rl

    config = trainer.config
    host = rollout.to_train_batch(trainer.step.buckets if config.rl.pack_sequences else None)
    batch = {k: jnp.asarray(np.asarray(getattr(host, k))) for k in minimal_rl.BATCH_FIELDS}
    step, params, opt = minimal_rl.build(config, jax.random.key(0))
    holder = {"p": params, "o": opt}

    def one() -> None:
        holder["p"], holder["o"], loss = step(holder["p"], holder["o"], batch)
        loss.block_until_ready()
    return _median_time(one, repeats)


def all_floors(repeats: int) -> Callable[[Any, Any, ExactLengthEngine], dict[str, float]]:
    def floors(trainer: Any, rollout: Any, engine: ExactLengthEngine) -> dict[str, float]:
        return {"train_floor_s": train_floor(trainer, rollout, repeats),
                "handoff_floor_s": handoff_floor(trainer.state.params, repeats),
                "generate_floor_s": generate_floor(trainer, engine, repeats)}
    return floors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--floor_repeats", type=int, default=7)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: must be in [0, --steps = {args.steps})")
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags:
        parser.error(f"XLA_FLAGS sets {HOST_DEVICES_FLAG}: unset it (one device, colocated)")
    from meshrl.utils import log

    log.setup("WARNING")
    sync = run_mode(0, args.steps, args.warmup, all_floors(args.floor_repeats))
    print("sync: " + ", ".join(f"{k} {v:.3f}" for k, v in sync.items()), flush=True)
    asyn = run_mode(1, args.steps, args.warmup)
    print(f"async (max_staleness 1): step {asyn['step_s']:.3f} s", flush=True)
    floor = sync["generate_floor_s"] + sync["train_floor_s"] + sync["handoff_floor_s"]
    r = functools.partial(round, ndigits=4)
    print(json.dumps({
        "benchmark": "rl_step", "sync_step_s": r(sync["step_s"]),
        "async_step_s": r(asyn["step_s"]), "floor_s": r(floor),
        "overhead_ratio": r(sync["step_s"] / floor), "train_s": r(sync["train_s"]),
        "train_floor_s": r(sync["train_floor_s"]),
        "train_ratio": r(sync["train_s"] / sync["train_floor_s"]),
        "generate_s": r(sync["generate_s"]), "generate_floor_s": r(sync["generate_floor_s"]),
        "handoff_s": r(sync["handoff_s"]), "handoff_floor_s": r(sync["handoff_floor_s"]),
        "reward_s": r(sync["reward_s"]), "batch_build_s": r(sync["batch_build_s"]),
        "other_s": r(sync["other_s"]), "steps": args.steps, "warmup_steps": args.warmup}))


if __name__ == "__main__":
    main()
