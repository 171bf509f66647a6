"""The RL job: asynchronous GRPO/PPO-family training with an in-process sampler.

  python main.py --config configs/default.py --workdir /tmp/meshrl

Contract: per train step ``v -> v + 1`` the trainer takes one batch of groups from the rollout
runner, every loss token at most ``rollout.max_staleness`` versions old (checked again here),
runs one step of the ``TrainEngine`` (``rl.ppo_minibatches x rl.ppo_epochs`` optimizer updates,
``trainer/rl_step.py``), hands version ``v + 1`` to the sampler in process and
publishes it under ``<workdir>/weights`` at checkpoints. A rerun resumes from the newest
checkpoint. The design (packing, temperature, placement, warm start, KL reference, recovery)
is in ``docs/rl.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples, make_prompt_iterator
from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Sampler
from meshrl.inference.weights import process_local_copy
from meshrl.jobs.report import rl_step_line, rl_summary_table
from meshrl.jobs.rl_console import await_batch, filtered_note, stop_at
from meshrl.jobs.rl_eval import aevaluate, plot_curves, read_metrics
from meshrl.jobs.rl_setup import (
    rl_batch_size,
    rl_engine,
    run_warm_start,
    warm_start_config,
    warm_start_steps,
)
from meshrl.mesh import initialize_distributed, logical_to_sharding, rules_for
from meshrl.mesh.placement import create_meshes
from meshrl.models import (
    build_model,
    flops_per_token,
    param_shardings,
    resolve_model_config,
    split_model,
)
from meshrl.models.tokenizer import tokenizer_for
from meshrl.rewards import RewardPool
from meshrl.trainer.engine import Trainee, check_versions, put_batch
from meshrl.trainer.reference import ReferencePolicy
from meshrl.trainer.state import params_checksum
from meshrl.trainer.step import decoder_forward
from meshrl.utils import interrupt, multihost, paths
from meshrl.utils import log as log_lib
from meshrl.utils.aio import run_sync
from meshrl.workflows import RolloutBatch, make_rollout_batch, make_runner
from meshrl.workflows.watch import window_metrics

__all__ = ["RLTrainer", "host_stats", "rl_batch_size", "run", "warm_start_config",
           "warm_start_steps"]

log = log_lib.get_logger("rl")


def _load_model(config: Config, mesh: Any) -> tuple[Any, Any, Any, Any]:
    """(graphdef, params, model config, tokenizer) on the trainer mesh."""
    rules = rules_for("train", config.mesh.fsdp)
    # The tokenizer first: a missing one fails before any weights are read.
    tokenizer = tokenizer_for(config.model, resolve_model_config(config.model).vocab_size)
    model = build_model(config.model, mesh=mesh, rules=rules, seed=config.trainer.seed)
    graphdef, params = split_model(model)
    return graphdef, params, model.cfg, tokenizer


def host_stats(groups: list[list[Any]], batch: RolloutBatch, version: int, t_wait: float,
               t_step: float, cpu_step: float) -> dict[str, float]:
    """The step's rollout and throughput metrics, from host data only."""
    generated = float(batch.loss_mask_BxL.sum())
    lags = [version - t.oldest_version for g in groups for t in g]
    return {"rollout/reward_mean": float(batch.rewards_B.mean()),
            "rollout/reward_std": float(batch.rewards_B.std()),
            "rollout/completion_len": generated / batch.shape[0],
            "rollout/batch_staleness_mean": float(np.mean(lags)),
            "rollout/batch_staleness_max": float(np.max(lags)),
            "perf/rollout_wait_s": t_wait, "perf/step_time_s": t_step,
            # CPU seconds of this process (all threads, XLA's included) over the step: on a
            # CPU host, cpu / step time is how many cores the job kept busy.
            "perf/process_cpu_s": cpu_step,
            "perf/samples_per_s": batch.shape[0] / max(t_step, 1e-9),
            "perf/tokens_per_s": generated / max(t_step, 1e-9)}


class RLTrainer:
    """The trainer's side of the RL job: a ``TrainEngine`` (state, packed step, checkpoints,
    metrics), the KL reference, the sampler and the reward pool."""

    def __init__(self, config: Config, workdir: paths.PathLike) -> None:
        n = jax.process_count()
        if config.rollout.prompts_per_step % n:
            raise ConfigError(f"rollout.prompts_per_step = {config.rollout.prompts_per_step}: "
                              f"must be divisible by the {n} processes (each process samples "
                              f"prompts_per_step / {n} groups per step)")
        self.config, self.workdir = config, paths.as_path(workdir)
        t = config.trainer
        self.mesh, self.sampler_mesh = create_meshes(config)
        rules = rules_for("train", config.mesh.fsdp)
        graphdef, params, self.model_cfg, self.tokenizer = _load_model(config, self.mesh)
        self.forward = decoder_forward(graphdef, t.logits_chunk)
        shardings = param_shardings(params, self.mesh, rules)
        self.B, self.L = rl_batch_size(config), t.seq_len

        def trainee(p: Any) -> Trainee:
            return Trainee(forward=self.forward, params=p, params_shardings=shardings,
                           flops_per_token=flops_per_token(self.model_cfg, t.seq_len))

        # One prompt per ``next``: the runner then never buffers a prompt the iterator has
        # passed, so the iterator state saved at a checkpoint is exactly what was consumed.
        self.prompts = make_prompt_iterator(config.data, self.tokenizer,
                                            batch_size=jax.process_count(), seed=t.seed,
                                            process_index=jax.process_index(),
                                            process_count=jax.process_count())
        # Read the held-out set now: a bad file fails before the warm start trains anything.
        self.examples = eval_examples(config.data, self.tokenizer)
        self.engine = rl_engine(config, self.workdir, self.mesh, trainee(params))
        # The host batch: the rollout's fields (the reference adds ``ref_logprobs`` on device).
        self.host_batch_sh = self.engine.batch_sh.replace(ref_logprobs=None)
        rewards_sh = logical_to_sharding(("batch",), self.mesh, rules, (self.B,))
        # This process's first sample in the global batch (its rows are one contiguous block).
        self._sample_offset = min(idx[0].start or 0 for idx in
                                  rewards_sh.addressable_devices_indices_map((self.B,)).values())
        self.counters: dict[str, Any] = {}
        self.warm_start_steps = 0
        kl = config.rl.kl_coef > 0.0
        restored = self.engine.restored
        try:  # no orphaned Orbax threads or open metric files when anything below fails
            if restored is None:
                self.warm_start_steps = warm_start_steps(config)
            # A resumed run with a KL needs the step-0 policy again: rerunning the finished warm
            # start restores its last checkpoint and trains nothing.
            sft_steps = warm_start_steps(config) if restored is None or kl else 0
            if sft_steps:
                sft_dir = self.workdir / "sft" / "checkpoints"
                if restored is not None and not any(p.name.isdigit() for p in sft_dir.glob("*")):
                    log.warning("no SFT checkpoint under %s: retraining the warm start to "
                                "rebuild the KL reference policy", sft_dir)
                params = run_warm_start(config, self.workdir, self.mesh, trainee(params),
                                        self.tokenizer, sft_steps)
            self.reference = None if not kl else ReferencePolicy(
                config.rl, self.forward, params, self.engine.state_sh.params, self.mesh,
                self.engine.batch_sh, rewards_sh,
                temperature=config.sampler.temperature, group_size=config.rollout.group_size,
                microbatches=t.microbatches)
            self.engine.start(params)
            del params
            # The step's logprob_mismatch takes state.step as the version of the params it
            # starts from: it must be the version the sampler labels their tokens with.
            if (step0 := int(jax.device_get(self.state.step))) != self.start_step:
                raise ValueError(f"train state at step {step0}, RL counters at step "
                                 f"{self.start_step}: the checkpoint is inconsistent")
            if restored is not None:
                self.prompts.set_state(restored.data["prompts"])
                self.counters = dict(restored.counters)
                log.info("resuming RL at step %d (weight version %d)", self.start_step,
                         self.start_step)
            # The sampler applies its own rules on its mesh (the trainer's devices, or its own).
            self.sampler = Sampler(self.model_cfg, config.sampler, self.sampler_mesh,
                                   process_local_copy(self.engine.params),
                                   version=self.start_step,
                                   workdir=str(self.workdir), rules=rules_for("sample"))
            self.reward_pool = RewardPool.from_config(config.reward)
        except BaseException:
            self.engine.close()
            raise

    # The engine's state, as the tests and benchmarks read it off the trainer.
    state = property(lambda self: self.engine.state)
    step = property(lambda self: self.engine.step_fn)
    history = property(lambda self: self.engine.history)
    start_step = property(lambda self: self.engine.start_step)

    def train_batch(self, rb: RolloutBatch, version: int) -> tuple[RLTrainBatch, int]:
        """(the step's device batch, packed into the smallest row bucket that holds it, and its
        version lag); a token staler than ``rollout.max_staleness`` allows raises
        ``StaleBatchError`` before anything reaches the device."""
        host = rb.to_train_batch(self._rows(rb) if self.config.rl.pack_sequences else None)
        if jax.process_count() > 1:
            # Sample ids index the global rewards; this process's samples sit at its offset.
            ids = host.sample_ids
            host = host.replace(sample_ids=np.where(ids >= 0, ids + self._sample_offset, ids))
        lag = check_versions(host, version, self.config.rollout.max_staleness)
        return put_batch(host, self.host_batch_sh), lag

    def _rows(self, rb: RolloutBatch) -> Any:
        """The row buckets to pack into; with several processes, the one bucket (this
        process's share of it) that holds every process's rows, agreed by all of them, so all
        run the same compiled step."""
        if jax.process_count() == 1:
            return self.step.buckets
        n = jax.process_count()
        need = max(multihost.allgather_json(rb.packed_rows()))
        fits = [b for b in self.step.buckets if b % n == 0 and b // n >= need]
        if not fits:
            raise ValueError(f"packed rows: a process needs {need} rows, and no row bucket of "
                             f"{self.step.buckets} gives each of the {n} processes that many")
        return min(fits) // n

    def _handoff(self, engine: AsyncSampler, version: int) -> float:
        """Wait for the dispatched step's params, hand them to the sampler as ``version``;
        returns when the params were ready (``perf_counter``)."""
        params = self.engine.params
        jax.block_until_ready(params)
        t_trained = time.perf_counter()
        engine.update_weights(process_local_copy(params), version)
        return t_trained

    def precompile(self) -> None:
        """Compile the step for every row bucket now, not in the step that first needs it."""
        self.engine.precompile()

    async def aeval(self, engine: AsyncSampler, version: int) -> dict[str, float]:
        c = self.config
        ev = await aevaluate(engine, self.reward_pool, self.examples, version=version,
                             decode=self.tokenizer.decode, eos_id=self.tokenizer.eos_id,
                             max_new_tokens=c.sampler.max_new_tokens, n=c.rollout.group_size,
                             temperature=c.sampler.temperature, seed=c.trainer.seed)
        if ev:
            log.info("eval at version %d: %s", version,
                     ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))
            self.engine.metrics.write(version, ev)
        return ev

    def save(self, step: int, runner: Any) -> None:
        """Checkpoint: train state, prompt iterator, runner counters (version, staleness)."""
        self.engine.save(step, {"prompts": self.prompts.get_state()},
                         {**self.counters, "runner": runner.state_dict()})

    async def arun(self, rollout_engine: Callable[[AsyncSampler], Any] | None = None
                   ) -> dict[str, Any]:
        """The RL loop; ``rollout_engine`` may wrap the engine the rollouts (not the
        evaluations) use, e.g. to shape completion lengths in a benchmark."""
        c, t, train = self.config, self.config.trainer, self.engine
        engine = AsyncSampler(self.sampler)
        # Each process samples its share of the step's groups on its own devices.
        local = dataclasses.replace(c, rollout=dataclasses.replace(
            c.rollout, prompts_per_step=c.rollout.prompts_per_step // jax.process_count()))
        runner = make_runner(local, rollout_engine(engine) if rollout_engine else engine,
                             self.reward_pool, self.prompts, self.tokenizer,
                             version=self.start_step)
        if "runner" in self.counters:
            runner.load_state_dict(self.counters["runner"])
        train.open_progress(on_log=lambda step, record: log.info(
            rl_step_line(step, t.steps, record, train.progress.eta(step))))
        every, publish_every = c.checkpoint.every_steps, c.checkpoint.publish_every
        generated = samples = 0.0
        t_rl = None
        try:
            if "eval_before" not in self.counters:
                self.counters["eval_before"] = await self.aeval(engine, self.start_step)
            runner.start()
            t_rl = time.perf_counter()
            last, cpu_last = t_rl, time.process_time()
            for step in range(self.start_step + 1, t.steps + 1):
                version = step - 1
                groups = await await_batch(runner, version)
                if groups is None:  # Ctrl-C while waiting: the state is version's
                    stop_at(self, version, runner)
                t_got = time.perf_counter()
                groups.sort(key=lambda g: g[0].group_id)  # completion order must not matter
                rb = make_rollout_batch(c, groups, self.tokenizer.pad_id)
                batch, lag = self.train_batch(rb, version)
                prepare = None
                if self.reference is not None:
                    prepare = functools.partial(self.reference.apply,
                                                rewards_B=self.reference.put_rewards(rb.rewards_B))
                t_built = time.perf_counter()
                train.dispatch(step, batch, prepare)  # and reads the previous step's metrics
                # The handoff waits for this step (the sampler needs its result); off the loop.
                t_trained = await asyncio.to_thread(self._handoff, engine, step)
                now, cpu_now = time.perf_counter(), time.process_time()
                host = host_stats(groups, rb, version, t_got - last, now - last,
                                  cpu_now - cpu_last)
                # Where the trainer's side of the step went (host clocks; no extra sync: the
                # handoff waited for the step's params anyway).
                host.update({"perf/batch_build_s": t_built - t_got,
                             "perf/train_step_s": t_trained - t_built,
                             "perf/handoff_s": now - t_trained})
                host["train/version_lag_max"] = float(lag)
                host.update(runner.metrics())
                host.update(self.reward_pool.metrics())
                # A step line's all-groups figures cover every group scored since the last one.
                if step == self.start_step + 1 or step % t.log_every == 0 or step == t.steps:
                    window = runner.watch.take_window()
                    host.update(window_metrics(window))
                    if note := filtered_note(step, window):
                        log.info(note)
                train.annotate(host)
                # The handoff waited for this step, so reading its metrics now stalls nothing,
                # and its line and metric row come before the next batch is gathered.
                train.flush()
                last, cpu_last = now, cpu_now
                generated += float(rb.loss_mask_BxL.sum())
                samples += rb.shape[0]
                is_ckpt = (every and step % every == 0) or step == t.steps
                if step % publish_every == 0 or is_ckpt:
                    await asyncio.to_thread(train.publish, step)
                if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    await self.aeval(engine, step)
                if is_ckpt:
                    self.save(step, runner)
                if interrupt.requested() and step != t.steps:
                    stop_at(self, step, runner)
                # Host work between steps (publish, eval, checkpoint) is not step time.
                last += time.perf_counter() - now
                cpu_last += time.process_time() - cpu_now
            train.flush()
            if t.steps == self.start_step and not train.checkpointer.all_steps():
                self.save(t.steps, runner)
            wall = time.perf_counter() - t_rl
            ev_after = await self.aeval(engine, t.steps)
        finally:
            await runner.stop()
            engine.shutdown()
        train.finish()
        return self._summary(runner, ev_after, generated, samples, wall)

    def _summary(self, runner: Any, ev_after: dict[str, float], generated: float,
                 samples: float, wall: float) -> dict[str, Any]:
        c = self.config
        ev_before = self.counters.get("eval_before", {})
        hist = runner.controller.staleness_hist
        summary = {
            "job": c.job.value, "steps": c.trainer.steps, "start_step": self.start_step,
            "warm_start_steps": self.warm_start_steps,
            "accuracy_before": ev_before.get("eval/greedy_accuracy"),
            "accuracy_after": ev_after.get("eval/greedy_accuracy"),
            "eval_before": ev_before, "eval_after": ev_after,
            "tokens_per_s": generated / max(wall, 1e-9),
            "samples_per_s": samples / max(wall, 1e-9), "rl_wall_s": wall,
            "max_staleness": c.rollout.max_staleness,
            "max_staleness_seen": max(hist) if hist else 0,
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "dropped_stale_groups": runner.controller.dropped_stale,
            "rollout_counters": dict(runner.counters), **self.reward_pool.metrics(),
            "reward_first": self.history[0]["rollout/reward_mean"] if self.history else None,
            "reward_last": self.history[-1]["rollout/reward_mean"] if self.history else None,
            "devices": int(self.mesh.devices.size), "placement": c.rl.placement,
            "sampler_devices": int(self.sampler_mesh.devices.size),
            "processes": jax.process_count(),
            "params_checksum": params_checksum(self.engine.params),
        }
        if jax.process_index() == 0:
            metrics = read_metrics(self.workdir / "metrics.jsonl")
            plot_curves(metrics, self.workdir / "rl_curves.png")
            paths.write_text_atomic(self.workdir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        self.reward_pool.close()
        self.engine.close()


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Warm start (if needed), asynchronous RL, eval before/after, ``summary.json`` + plot."""
    initialize_distributed(config.distributed)
    log_lib.set_process_index(jax.process_index())
    t0 = time.perf_counter()
    trainer = RLTrainer(config, workdir)
    try:
        summary = run_sync(trainer.arun())  # asyncio.run, in a notebook cell too
    finally:
        trainer.close()
    summary["wall_s"] = time.perf_counter() - t0
    # Every process logs it: equal values show the processes ended with the same params.
    log.info("params_checksum %.17g", summary["params_checksum"])
    if jax.process_index() == 0:
        paths.write_text_atomic(paths.as_path(workdir) / "summary.json",
                                json.dumps(summary, indent=2))
        log.info("%s", rl_summary_table(summary, workdir))
    return summary
