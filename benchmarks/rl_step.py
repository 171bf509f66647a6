"""One GRPO step at the speed of its parts: the RL job's per-phase times beside each phase's floor,
measured step by step in the same run.

Shape: a Llama-shaped model (4 layers, hidden 256, SwiGLU MLP 688, 4 heads, 2 KV heads, vocab
1,024, untied embeddings, float32), 8 prompts x 4 samples per step, every completion exactly 64
tokens (``Request.min_new_tokens``), one optimizer update per batch, random init (no warm start,
no eval), colocated on one device. The real job runs (``jobs.rl.build``: runner, sampler, reward
pool, train step, handoff), synchronous (``max_staleness = 0``) and with ``max_staleness = 1``.

Baseline: what the step would cost done by hand, per phase, on the step's own work:
``generate_floor`` is a second ``Sampler`` (same settings and model) alone running the step's 32
requests (``Sampler.generate``), ``train_floor`` a minimal jitted GRPO step in plain JAX and optax
(``benchmarks/minimal_rl.py``: the same model math and loss, on the step's batch packed as the job
packed it, params donated) and ``handoff_floor`` one jitted raw device copy of every param leaf.
``floor`` is their sum.

Interleaving: after every synchronous step, between steps (outside the step's timed window, the
sampler idle: with ``max_staleness = 0`` the runner admits the next batch only when the loop asks
for it), each floor runs once on that step's work. Both sides compile first (the job's train step
for every row bucket and its sampler's variants; the floor sampler's variants; the floor train
step and copy on an untimed first call), and the first ``--warmup`` steps are dropped from both.

Figures (medians over the measured steps, each with ``<name>_spread: [min, max]``):
``sync_step_s`` (a synchronous step) with its phases ``generate_s`` (first request submitted to
last completion), ``reward_s`` (last completion to last reward), ``batch_build_s``, ``train_s``
(dispatch to params ready), ``handoff_s`` (the sampler's copy) and ``other_s`` (the rest:
queueing, metrics, the event loop); the floors ``generate_floor_s``, ``train_floor_s``,
``handoff_floor_s``, ``floor_s``; ``overhead_ratio`` (per step ``sync_step_s / floor_s``, then
the median) and ``train_ratio`` (per step ``train_s / train_floor_s``). ``async_step_s``, the
step of a second run with ``max_staleness = 1`` (generation overlaps the trainer's path), is
secondary: a separate run, not interleaved with the synchronous one.

Targets: ``overhead_ratio <= 1.25`` and ``train_ratio <= 1.15``; ``targets_met`` is true only
when both hold and the run is valid. A real phase (or step) faster than its floor by more than
5% is a broken measurement: ``"valid": false`` and exit status 1, checked on the medians of each
phase and on the two headline ratios (below 0.95); single steps below their floor by more than
5% show in the spreads (a step's floor runs after it, so one step's noise can cross it). Earlier versions measured each
floor once after the RL runs, not interleaved with the steps, and counted a real step faster than
its floor (ratios below 1) as meeting the targets.

  python benchmarks/rl_step.py
  python benchmarks/rl_step.py --steps 6 --warmup 2      # smoke check

Last line: {"benchmark": "rl_step", "sync_step_s", "sync_step_s_spread", "floor_s",
"overhead_ratio", "overhead_ratio_spread", "train_s", "train_floor_s", "train_ratio",
"train_ratio_spread", "generate_s", "generate_floor_s", "handoff_s", "handoff_floor_s", ...,
"async_step_s", "targets_met", "valid"}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from typing import Any

from meshrl.benchmarks import figures

NEW_TOKENS, PROMPT_BUCKET = 64, 16
SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
             num_heads=4, num_kv_heads=2, tie_embeddings=False)
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
TARGETS = {"overhead_ratio": 1.25, "train_ratio": 1.15}
PHASES = ("generate", "reward", "batch_build", "train", "handoff", "other")
FLOORS = ("generate_floor", "train_floor", "handoff_floor")
# (sampler version at submission, start, end, request) of every request the job generated.
Call = tuple[int, float, float, Any]


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
    """Wraps the engine: every request generates exactly ``NEW_TOKENS`` tokens; appends each
    request's ``Call`` to ``calls``."""

    def __init__(self, engine: Any, calls: list[Call]) -> None:
        self.engine, self.calls = engine, calls

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


class StepFloors:
    """The floors, one repetition each on a step's own work, run after the step is recorded."""

    def __init__(self, trainer: Any, calls: list[Call], rollouts: dict[int, Any]) -> None:
        import jax
        import jax.numpy as jnp

        from meshrl.benchmarks import minimal_rl
        from meshrl.inference.sampler import Sampler
        from meshrl.mesh import rules_for

        self.trainer, self.calls, self.rollouts = trainer, calls, rollouts
        # Same settings and weights as the job's sampler, compiled up front as that one is.
        self.sampler = Sampler(trainer.model_cfg, trainer.config.sampler, trainer.sampler_mesh,
                               trainer.state.params, version=0, rules=rules_for("sample"))
        self.sampler.warmup()
        self.train_step, self.params, self.opt = minimal_rl.build(trainer.config,
                                                                  jax.random.key(0))
        self.copy = jax.jit(lambda xs: [jnp.array(x, copy=True) for x in xs])
        self.compiled: set[Any] = set()
        self.rows: dict[int, dict[str, float]] = {}
        self.spans: list[tuple[float, float]] = []

    def __call__(self, record: dict[str, float]) -> None:
        step = int(record["step"])
        version = step - 1
        if max(self.rollouts) != version:  # the job already built a later step's batch
            raise RuntimeError(f"floors of step {step} would run inside a later step")
        t0 = time.perf_counter()
        self.rows[step] = {"generate_floor": self._generate(version),
                           "train_floor": self._train(self.rollouts.pop(version)),
                           "handoff_floor": self._handoff()}
        self.spans.append((t0, time.perf_counter()))

    def _generate(self, version: int) -> float:
        requests = [r for v, _, _, r in self.calls if v == version]
        t = time.perf_counter()
        self.sampler.generate(requests)
        return time.perf_counter() - t

    def _train(self, rollout: Any) -> float:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from meshrl.benchmarks.minimal_rl import BATCH_FIELDS

        host = rollout  # the job's own host batch, packed as the job packed it
        batch = jax.block_until_ready(
            {k: jnp.asarray(np.asarray(getattr(host, k))) for k in BATCH_FIELDS})
        shape = batch["input_ids"].shape
        if shape not in self.compiled:  # the job's step is compiled for every bucket up front
            self._train_once(batch)
            self.compiled.add(shape)
        t = time.perf_counter()
        self._train_once(batch)
        return time.perf_counter() - t

    def _train_once(self, batch: dict[str, Any]) -> None:
        self.params, self.opt, loss = self.train_step(self.params, self.opt, batch)
        loss.block_until_ready()

    def _handoff(self) -> float:
        import jax

        leaves = jax.tree.leaves(self.trainer.state.params)
        if "copy" not in self.compiled:
            jax.block_until_ready(self.copy(leaves))
            self.compiled.add("copy")
        t = time.perf_counter()
        jax.block_until_ready(self.copy(leaves))
        return time.perf_counter() - t

    def check_no_overlap(self) -> None:
        """Raises if any floor ran while the job was generating (they would slow each other)."""
        for t0, t1 in self.spans:
            if any(c0 < t1 and t0 < c1 for _, c0, c1, _ in self.calls):
                raise RuntimeError("a floor overlapped the job's generation: the sampler was "
                                   "not idle between steps")


def run_mode(max_staleness: int, steps: int, with_floors: bool
             ) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """One RL run: per step, the step time (and for a synchronous run its phases), and the
    floors of each step when ``with_floors``."""
    from meshrl.benchmarks.rl_async import on_each_step
    from meshrl.jobs import rl as rl_job

    config = make_config(max_staleness, steps)
    calls: list[Call] = []
    rollouts: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        trainer = rl_job.build(config, workdir)
        try:
            trainer.reward_pool = rewards = TimedRewards(trainer.reward_pool)
            build = trainer.train_batch

            def keep(rb: Any, version: int) -> Any:
                rollouts[version] = rb
                return build(rb, version)
            trainer.train_batch = keep
            trainer.precompile()
            # Weight updates land mid-generation only when batches overlap.
            trainer.sampler.warmup(recompute=max_staleness > 0)
            floors = StepFloors(trainer, calls, rollouts) if with_floors else None
            if floors is not None:
                on_each_step(trainer, floors)
            asyncio.run(trainer.arun(
                rollout_sampler=lambda engine: ExactLengthEngine(engine, calls)))
            if floors is not None:
                floors.check_no_overlap()
            rows = {int(h["step"]): {"step": h["perf/step_time_s"]} for h in trainer.history}
            if max_staleness == 0:
                for step, got in phases(trainer.history, calls, rewards.ends).items():
                    rows[step].update(got)
        finally:
            trainer.close()
    return rows, floors.rows if floors is not None else {}


def phases(history: list[dict[str, float]], calls: list[Call], reward_ends: list[float]
           ) -> dict[int, dict[str, float]]:
    """Per-phase seconds of each synchronous step (step k generates at version k - 1)."""
    starts = {v: min(t0 for w, t0, _, _ in calls if w == v) for v, *_ in calls}
    out: dict[int, dict[str, float]] = {}
    for h in history:
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
        out[v + 1] = got
    return out


def summarize(rows: dict[int, dict[str, float]], floor_rows: dict[int, dict[str, float]],
              measured: list[int]) -> tuple[dict[str, Any], figures.Floors]:
    """Medians and spreads over the ``measured`` steps, ratios paired step by step, and the
    real-vs-floor checks."""
    def col(src: dict[int, dict[str, float]], key: str) -> list[float]:
        return [src[s][key] for s in measured]

    step_s = col(rows, "step")
    floor_s = [sum(floor_rows[s][k] for k in FLOORS) for s in measured]
    out: dict[str, Any] = {**figures.spread("sync_step_s", step_s),
                           **figures.spread("floor_s", floor_s),
                           **figures.spread("overhead_ratio",
                                            figures.paired_ratios(step_s, floor_s)),
                           **figures.spread("train_ratio", figures.paired_ratios(
                               col(rows, "train"), col(floor_rows, "train_floor")))}
    for k in PHASES:
        out.update(figures.spread(f"{k}_s", col(rows, k)))
    for k in FLOORS:
        out.update(figures.spread(f"{k}_s", col(floor_rows, k)))
    floors = figures.Floors()
    for real, floor in (("sync_step_s", "floor_s"), ("generate_s", "generate_floor_s"),
                        ("train_s", "train_floor_s"), ("handoff_s", "handoff_floor_s")):
        floors.check(real, out[real], out[floor])
    for ratio in ("overhead_ratio", "train_ratio"):  # the headlines themselves
        floors.check_ratio(ratio, out[ratio])
    return out, floors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not 0 <= args.warmup <= args.steps - figures.MIN_ROUNDS:
        parser.error(f"--warmup {args.warmup}: must be in [0, --steps - {figures.MIN_ROUNDS}]"
                     f" (at least {figures.MIN_ROUNDS} measured steps)")
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags:
        parser.error(f"XLA_FLAGS sets {HOST_DEVICES_FLAG}: unset it (one device, colocated)")
    from meshrl.utils import log

    log.setup("WARNING")
    measured = list(range(args.warmup + 1, args.steps + 1))
    rows, floor_rows = run_mode(0, args.steps, with_floors=True)
    result, floors = summarize(rows, floor_rows, measured)
    print("sync: " + ", ".join(f"{k} {v}" for k, v in result.items()
                               if not k.endswith("_spread")), flush=True)
    async_rows, _ = run_mode(1, args.steps, with_floors=False)
    async_step = figures.spread("async_step_s", [async_rows[s]["step"] for s in measured])
    print(f"async (max_staleness 1): step {async_step['async_step_s']} s", flush=True)
    met = all(result[k] <= v for k, v in TARGETS.items()) and not floors.problems
    figures.emit({"benchmark": "rl_step", **result, **async_step, "targets": TARGETS,
                  "targets_met": met, "steps": args.steps, "warmup_steps": args.warmup,
                  "measured_steps": len(measured)}, floors)


if __name__ == "__main__":
    main()
