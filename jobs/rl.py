"""The RL job: asynchronous GRPO/PPO-family training with an in-process sampler.

  python main.py --config configs/default.py --workdir /tmp/meshrl

One process, one event loop. The rollout runner (``workflows``) keeps the sampler busy with
groups of episodes while the trainer consumes batches; the staleness controller admits new
groups only while ``(max_staleness + version + 1) * prompts_per_step - (accepted + running) > 0``
and drops (and counts) any group with a token older than ``version - max_staleness``.
``rollout.max_staleness = 0`` is synchronous RL.

Per optimizer step ``v -> v + 1``: ``await runner.get_batch(v)`` (the version goes up by exactly
one per consumed batch, whatever the trainer's non-finite skips), build the ``RolloutBatch``
(groups in group-id order, so the batch does not depend on completion order), dispatch the
jitted step, read the previous step's metrics, hand the new params to the sampler in process
(``update_weights(params, v + 1)``; that copy is the one host wait per step, and it runs off
the event loop), and every ``checkpoint.publish_every`` steps and at checkpoints publish the
Orbax weight version ``<workdir>/weights/<v + 1>``.

Packing (``rl.pack_sequences``): sequences share rows of ``trainer.seq_len``; the row count is
rounded up to a quarter of the batch, and ``BucketedStep`` compiles one step per row count.

Proximal logprobs: every rollout batch gets exactly one optimizer step, so the proximal policy
of decoupled PPO is the current (pre-update) policy, and ``make_rl_loss_fn``'s default
(stop-gradient of the logprobs being trained) is exactly it: no extra forward pass.

Sampling temperature: the behaviour policy is softmax(logits / ``sampler.temperature``) and the
loss scores the current and proximal policies with the same logits / T (AReaL, verl). Greedy
(T = 0) and top-k/top-p truncated sampling are rejected: the trainer cannot rebuild them.

Placement (``rl.placement``, see ``mesh/placement.py``): colocated, the sampler mesh is
``create_mesh(config.mesh)`` over the trainer's devices with the ``sample`` rules (params
tensor-parallel, replicated over ``data``); split, the last ``rl.sampler_devices`` devices form
the sampler mesh and the others the trainer's (``mesh.*`` must multiply to them). Publication
and staleness control are the same in both: ``update_weights`` reshards across meshes.

Warm start: with ``model.hf_path`` empty the policy starts from a short SFT phase on the same
data (``<workdir>/sft``, resumable like any SFT run) so that RL starts from a mediocre, not a
random, policy. It uses the config's model, data, optimizer and trainer sections except for
its length, ``rl.warm_start_steps`` (-1: ``trainer.steps``), its optimizer (always AdamW) and
its peak learning rate, ``rl.warm_start_lr``: RL needs a far smaller rate than SFT (with Adam
every parameter moves by about the rate per step, and a policy-gradient step of that size on a
0.1M-param model lowers the likelihood of every sampled answer, the rewarded ones included).

Reference policy (``rl.kl_coef > 0``, see ``trainer/reference.py``): the policy at RL step 0
(the ``model.hf_path`` params or the warm start's result), kept frozen in its own buffers on the
trainer's shardings. Each step scores the batch's targets under it at ``sampler.temperature``
and puts the KL in the loss (``ref_logprobs``; metric ``train/kl_ref``) or in the reward
(advantages recomputed); ``train/kl_behaviour_ref`` logs the mean KL of the rollouts to it. On
resume the reference is rebuilt the same way: the finished warm start is restored from
``<workdir>/sft`` (``Loop`` runs no step when its checkpoint is at the last step).

Recovery: checkpoints hold the train state, the prompt iterator state and the runner's
counters (``runner.state_dict()``: version, staleness counters, next group id). A rerun of the
same command resumes from the newest verified checkpoint; the SFT warm start is skipped then
(only restored, for the KL reference).
Groups in flight at a kill are lost (their prompts are not replayed), except with
``max_staleness = 0`` where nothing is in flight at a checkpoint and the resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshrl.algorithms.losses import get_loss
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.configs.schema import Config, Job
from meshrl.datasets import eval_examples, make_prompt_iterator, make_sft_iterator
from meshrl.inference.async_engine import AsyncEngine
from meshrl.inference.engine import Sampler
from meshrl.inference.weights import publish_weights, weights_dir
from meshrl.jobs.rl_eval import aevaluate, plot_curves, read_metrics
from meshrl.mesh import initialize_distributed, logical_to_sharding, rules_for
from meshrl.mesh.placement import create_meshes
from meshrl.models import (
    build_model,
    flops_per_token,
    forward,
    param_shardings,
    resolve_model_config,
    split_model,
)
from meshrl.models.tokenizer import tokenizer_for
from meshrl.rewards import RewardPool
from meshrl.trainer.checkpoint import Checkpointer
from meshrl.trainer.loop import Loop, Trainee, expand_prefix, put_batch, read_step_metrics
from meshrl.trainer.metrics import MetricsWriter
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.progress import Progress
from meshrl.trainer.reference import ReferencePolicy, ref_batch_keys
from meshrl.trainer.state import abstract_state, init_state, state_shardings
from meshrl.trainer.step import (
    BucketedStep,
    batch_shardings,
    jit_train_step,
    make_train_step,
    row_buckets,
)
from meshrl.utils import log as log_lib
from meshrl.workflows import (
    TRAIN_BATCH_DTYPES,
    TRAIN_BATCH_KEYS,
    RolloutBatch,
    make_rollout_batch,
    make_runner,
)

log = log_lib.get_logger("rl")


def warm_start_steps(config: Config) -> int:
    """SFT steps before RL: none for a pretrained model (``model.hf_path``), else
    ``rl.warm_start_steps`` with -1 meaning as many as ``trainer.steps``."""
    if config.model.hf_path:
        return 0
    n = config.rl.warm_start_steps
    return config.trainer.steps if n == -1 else n


def warm_start_config(config: Config, steps: int) -> Config:
    """The SFT config of the warm start: ``steps`` steps of AdamW at peak rate
    ``rl.warm_start_lr``, no held-out evaluation; every other field as in ``config``."""
    t = config.trainer
    return dataclasses.replace(
        config, job=Job.SFT,
        trainer=dataclasses.replace(t, steps=steps, eval_every=0,
                                    learning_rate=config.rl.warm_start_lr),
        optimizer=dataclasses.replace(config.optimizer, name="adamw"))


def rl_batch_size(config: Config) -> int:
    """Sequences per optimizer step: prompts (groups) times samples per prompt."""
    return config.rollout.prompts_per_step * config.rollout.group_size


def _load_model(config: Config, mesh: Any) -> tuple[Any, Any, Any, Any]:
    """(graphdef, params, model config, tokenizer) on the trainer mesh."""
    rules = rules_for("train", config.mesh.fsdp)
    # The tokenizer first: a missing one fails before any weights are read.
    tokenizer = tokenizer_for(config.model, resolve_model_config(config.model).vocab_size)
    model = build_model(config.model, mesh=mesh, rules=rules, seed=config.trainer.seed)
    graphdef, params = split_model(model)
    return graphdef, params, model.cfg, tokenizer


def run_warm_start(config: Config, workdir: pathlib.Path, mesh: Any, trainee: Trainee,
                   tokenizer: Any, steps: int) -> Any:
    """``steps`` of SFT under ``<workdir>/sft`` (resumable); returns the final params."""
    t = config.trainer
    sft = warm_start_config(config, steps)
    data = make_sft_iterator(config.data, tokenizer, batch_size=t.batch_size, seq_len=t.seq_len,
                             seed=t.seed, process_index=jax.process_index(),
                             process_count=jax.process_count())
    (workdir / "sft").mkdir(parents=True, exist_ok=True)
    log.info("SFT warm start: %d steps of %d x %d tokens under %s", steps, t.batch_size,
             t.seq_len, workdir / "sft")
    loop = Loop(sft, workdir / "sft", mesh, trainee, data, get_loss("sft"))
    try:
        loop.run()
        return loop.state.params
    finally:
        loop.close()


class RLTrainer:
    """Owns the compiled RL step, the state, checkpoints, metric sinks and the sampler."""

    def __init__(self, config: Config, workdir: str | pathlib.Path) -> None:
        if jax.process_count() > 1:
            # TODO(meshrl): multi-host RL (one runner per process, one global batch) is untested.
            raise NotImplementedError("the RL job runs on one process in this build")
        self.config, self.workdir = config, pathlib.Path(workdir)
        t = config.trainer
        self.mesh, self.sampler_mesh = create_meshes(config)
        rules = rules_for("train", config.mesh.fsdp)
        graphdef, params, self.model_cfg, self.tokenizer = _load_model(config, self.mesh)
        self.forward = functools.partial(forward, graphdef)
        self.tx, self.schedule = make_optimizer(config.optimizer, t.learning_rate, t.steps)
        shardings = param_shardings(params, self.mesh, rules)
        self.state_sh = state_shardings(expand_prefix(shardings, params), self.tx, self.mesh,
                                        params)
        self.B, self.L = rl_batch_size(config), t.seq_len
        # The step's batch: the rollout's keys, plus ``ref_logprobs`` with the KL in the loss.
        self.batch_sh = batch_shardings(self.mesh, rules, self.B, self.L,
                                        ref_batch_keys(config.rl, TRAIN_BATCH_KEYS))
        self.host_batch_sh = {k: self.batch_sh[k] for k in TRAIN_BATCH_KEYS}
        # One prompt per ``next``: the runner then never buffers a prompt the iterator has
        # passed, so the iterator state saved at a checkpoint is exactly what was consumed.
        self.prompts = make_prompt_iterator(config.data, self.tokenizer,
                                            batch_size=jax.process_count(), seed=t.seed,
                                            process_index=jax.process_index(),
                                            process_count=jax.process_count())
        # Read the held-out set now: a bad file fails before the warm start trains anything.
        self.examples = eval_examples(config.data, self.tokenizer)
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", config.checkpoint,
                                         process_index=jax.process_index())
        target = abstract_state(self.state_sh, params, self.tx, t.seed)
        self.counters: dict[str, Any] = {}
        self.warm_start_steps = 0
        kl = config.rl.kl_coef > 0.0
        try:  # no orphaned Orbax threads when resume or the warm start fails
            restored = self.checkpointer.restore_latest(target)
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
                trainee = Trainee(forward=self.forward, params=params, params_shardings=shardings,
                                  flops_per_token=flops_per_token(self.model_cfg, t.seq_len))
                params = run_warm_start(config, self.workdir, self.mesh, trainee,
                                        self.tokenizer, sft_steps)
        except BaseException:
            self.checkpointer.close()
            raise
        self.reference = None if not kl else ReferencePolicy(
            config.rl, self.forward, params, self.state_sh.params, self.mesh, self.batch_sh,
            logical_to_sharding(("batch",), self.mesh, rules, (self.B,)),
            temperature=config.sampler.temperature, group_size=config.rollout.group_size,
            microbatches=t.microbatches)
        if restored is None:
            self.state = jax.jit(lambda p: init_state(p, self.tx, t.seed),
                                 out_shardings=self.state_sh)(params)
            self.start_step = 0
        else:
            self.state = restored.state
            self.prompts.set_state(restored.data["prompts"])
            self.counters = dict(restored.counters)
            self.start_step = int(self.counters["step"])
            log.info("resuming RL at step %d (weight version %d)", self.start_step,
                     self.start_step)
        del params
        loss_fn = make_rl_loss_fn(config.rl, temperature=config.sampler.temperature)
        step_fn = make_train_step(self.forward, loss_fn, self.tx, self.schedule,
                                  microbatches=t.microbatches)
        rows_per_shard = self.batch_sh["input_ids"].shard_shape((self.B, self.L))[0]
        buckets = (row_buckets(self.B, self.B // rows_per_shard * t.microbatches)
                   if config.rl.pack_sequences else (self.B,))
        self.step = BucketedStep(jit_train_step(step_fn, self.state_sh, self.batch_sh, self.mesh),
                                 self.batch_sh, self.L, buckets, TRAIN_BATCH_DTYPES)
        # The sampler applies its own rules on its mesh (the trainer's devices, or its own).
        s = config.sampler
        self.sampler = Sampler(self.model_cfg, s, self.sampler_mesh, self.state.params,
                               version=self.start_step, workdir=str(self.workdir),
                               rules=rules_for("sample"))
        self.reward_pool = RewardPool.from_config(config.reward)
        self.metrics = MetricsWriter(self.workdir, tensorboard=config.logging.tensorboard,
                                     process_index=jax.process_index(),
                                     resume_step=None if restored is None else self.start_step)
        self._pending: tuple[int, dict[str, jax.Array], dict[str, float]] | None = None
        self.history: list[dict[str, float]] = []

    def train_batch(self, rb: RolloutBatch) -> dict[str, jax.Array]:
        """The step's device batch; packed into the smallest row bucket that holds it."""
        # TODO(meshrl): multi-host RL must agree on the row count (max over processes) first.
        rows = self.step.buckets if self.config.rl.pack_sequences else None
        return put_batch(rb.to_train_batch(rows), self.host_batch_sh)

    def precompile(self) -> None:
        """Compile the step for every row bucket now, not in the step that first needs it."""
        self.step.precompile(self.state)

    # -- evaluation ------------------------------------------------------------------------

    async def aeval(self, engine: AsyncEngine, version: int) -> dict[str, float]:
        c = self.config
        ev = await aevaluate(engine, self.reward_pool, self.examples, version=version,
                             decode=self.tokenizer.decode, eos_id=self.tokenizer.eos_id,
                             max_new_tokens=c.sampler.max_new_tokens, n=c.rollout.group_size,
                             temperature=c.sampler.temperature, seed=c.trainer.seed)
        if ev:
            log.info("eval at version %d: %s", version,
                     ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))
            self.metrics.write(version, ev)
        return ev

    # -- metrics, one step late ------------------------------------------------------------

    def _flush(self) -> None:
        if self._pending is None:
            return
        step, metrics, host = self._pending
        self._pending = None
        values = read_step_metrics(metrics, step, self.config.trainer.on_nonfinite, "RL loss")
        record = {**{f"train/{k}": v for k, v in values.items() if k not in ("step", "finite")},
                  **host}
        self.history.append({"step": step, **record})
        if step % self.config.trainer.log_every == 0 or step == self.config.trainer.steps:
            self.metrics.write(step, record)
        self.progress.update(step, values["loss"], host["perf/tokens_per_s"])

    # -- weights and checkpoints -----------------------------------------------------------

    def publish(self, version: int) -> None:
        """Orbax weight version ``<workdir>/weights/<version>`` (replaces a leftover of a killed
        run, which may hold different weights of the same version)."""
        path = weights_dir(self.workdir, version)
        if path.exists() and jax.process_index() == 0:
            shutil.rmtree(path)
        publish_weights(self.state.params, self.workdir, version)

    def save(self, step: int, runner: Any) -> None:
        self._flush()  # never checkpoint an update whose metrics were not checked
        counters = {**self.counters, "step": step, "runner": runner.state_dict()}
        self.checkpointer.save(step, self.state, {"prompts": self.prompts.get_state()},
                               self.config.to_dict(), counters)

    # -- the loop ----------------------------------------------------------------------------

    def _host_stats(self, groups: list[list[Any]], batch: Any, version: int, t_wait: float,
                    t_step: float, cpu_step: float) -> dict[str, float]:
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

    async def arun(self, rollout_engine: Callable[[AsyncEngine], Any] | None = None
                   ) -> dict[str, Any]:
        """The RL loop; ``rollout_engine`` may wrap the engine the rollouts (not the
        evaluations) use, e.g. to shape completion lengths in a benchmark."""
        c, t = self.config, self.config.trainer
        engine = AsyncEngine(self.sampler)
        runner = make_runner(c, rollout_engine(engine) if rollout_engine else engine,
                             self.reward_pool, self.prompts, self.tokenizer,
                             version=self.start_step)
        if "runner" in self.counters:
            runner.load_state_dict(self.counters["runner"])
        self.progress = Progress(t.steps, self.start_step, enabled=c.logging.progress_bar
                                 and jax.process_index() == 0)
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
                groups = await runner.get_batch(version)
                t_got = time.perf_counter()
                groups.sort(key=lambda g: g[0].group_id)  # completion order must not matter
                rb = make_rollout_batch(c, groups, self.tokenizer.pad_id)
                batch = self.train_batch(rb)
                kl_metrics: dict[str, jax.Array] = {}
                if self.reference is not None:
                    rewards_B = self.reference.put_rewards(rb.rewards_B)
                with jax.transfer_guard("disallow"):
                    if self.reference is not None:
                        batch, kl_metrics = self.reference.apply(batch, rewards_B)
                    self.state, metrics = self.step(self.state, batch)
                metrics = {**metrics, **kl_metrics}
                self._flush()  # the previous step's metrics
                # The handoff waits for this step (the sampler needs its result); off the loop.
                await asyncio.to_thread(engine.update_weights, self.state.params, step)
                now, cpu_now = time.perf_counter(), time.process_time()
                host = self._host_stats(groups, rb, version, t_got - last, now - last,
                                        cpu_now - cpu_last)
                host.update(runner.metrics())
                host.update(self.reward_pool.metrics())
                self._pending = (step, metrics, host)
                last, cpu_last = now, cpu_now
                generated += float(rb.loss_mask_BxL.sum())
                samples += rb.shape[0]
                is_ckpt = (every and step % every == 0) or step == t.steps
                if step % publish_every == 0 or is_ckpt:
                    await asyncio.to_thread(self.publish, step)
                if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    await self.aeval(engine, step)
                if is_ckpt:
                    self.save(step, runner)
                # Host work between steps (publish, eval, checkpoint) is not step time.
                last += time.perf_counter() - now
                cpu_last += time.process_time() - cpu_now
            self._flush()
            if t.steps == self.start_step and not self.checkpointer.all_steps():
                self.save(t.steps, runner)
            wall = time.perf_counter() - t_rl
            ev_after = await self.aeval(engine, t.steps)
        finally:
            await runner.stop()
            engine.shutdown()
        self.checkpointer.wait()
        self.progress.close()
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
        }
        if jax.process_index() == 0:
            metrics = read_metrics(self.workdir / "metrics.jsonl")
            plot_curves(metrics, self.workdir / "rl_curves.png")
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        self.reward_pool.close()
        self.checkpointer.close()
        self.metrics.close()


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Warm start (if needed), asynchronous RL, eval before/after, ``summary.json`` + plot."""
    initialize_distributed(config.distributed)
    log_lib.set_process_index(jax.process_index())
    t0 = time.perf_counter()
    trainer = RLTrainer(config, workdir)
    try:
        summary = asyncio.run(trainer.arun())
    finally:
        trainer.close()
    summary["wall_s"] = time.perf_counter() - t0
    if jax.process_index() == 0:
        (pathlib.Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("RL summary: accuracy %.3f -> %.3f in %d steps, %.0f generated tokens/s, "
             "max staleness seen %d, %.0f s", summary["accuracy_before"] or 0.0,
             summary["accuracy_after"] or 0.0, summary["steps"], summary["tokens_per_s"],
             summary["max_staleness_seen"], summary["wall_s"])
    return summary
