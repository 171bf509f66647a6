"""The RL job: asynchronous GRPO/PPO-family training with an in-process sampler.

  python main.py --config configs/default.py --workdir /tmp/meshrl

Wires the meshes, model, prompts, warm start, KL reference, sampler and reward pool into the
RL loop (``trainer.rl_loop``) and writes ``<workdir>/summary.json``. A rerun resumes from the
newest checkpoint. The design (packing, temperature, placement, warm start, KL reference,
recovery) is in ``docs/rl.md``.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from meshrl.configs.cross_section import check_routing_replay, check_sampler_expert
from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples, make_prompt_iterator
from meshrl.inference.sampler import Sampler
from meshrl.jobs import rl_agent
from meshrl.jobs.distill import distill_report
from meshrl.jobs.rl_setup import load_trainee, reference_and_params, sample_rows
from meshrl.mesh import rules_for
from meshrl.mesh.placement import create_meshes
from meshrl.rewards import RewardPool
from meshrl.trainer.engine import TrainEngine
from meshrl.trainer.report import rl_summary_table
from meshrl.trainer.rl_loop import RLLoop, RLParts
from meshrl.trainer.spec import rl_spec
from meshrl.trainer.summary import write_summary
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.aio import run_sync
from meshrl.utils.params import process_local_copy
from meshrl.workflows.setup import prompt_room, routing_shape

log = log_lib.get_logger("rl")


def check_process_split(config: Config, n: int) -> None:
    """What ``n`` processes, each building its own share of the step's batch, cannot run."""
    if config.rollout.prompts_per_step % n:
        raise ConfigError(f"rollout.prompts_per_step = {config.rollout.prompts_per_step}: "
                          f"must be divisible by the {n} processes (each process samples "
                          f"prompts_per_step / {n} groups per step)")
    rl = config.rl
    if n > 1 and rl.advantage == "reinforce_pp" and not (rl.kl_coef > 0
                                                         and rl.kl_where == "reward"):
        # The host computes advantages from this process's groups only; with the KL in the
        # reward they are recomputed on the device over the whole batch.
        raise ConfigError(f"rl.advantage = 'reinforce_pp' with {n} processes: its whole-batch "
                          f"normalisation would run over each process's share of the batch; "
                          f"use one process, a per-group estimator (grpo, drgrpo, rloo), or "
                          f"rl.kl_where = 'reward' with rl.kl_coef > 0 (advantages computed on "
                          f"the device over the whole batch)")


def build(config: Config, workdir: paths.PathLike) -> RLLoop:
    """The RL loop of ``config``, its engine restored or started (after the warm start)."""
    n = jax.process_count()
    check_process_split(config, n)
    workdir, t = paths.as_path(workdir), config.trainer
    mesh, sampler_mesh = create_meshes(config)
    trainee, model_cfg, tokenizer = load_trainee(config, mesh)
    check_routing_replay(config.rl.routing_replay, model_cfg.num_experts)  # hf_path's model
    if config.rl.sampler_expert:
        check_sampler_expert(config.rl.sampler_expert, model_cfg.num_experts)
    # One prompt per ``next``: the runner then never buffers a prompt the iterator has
    # passed, so the iterator state saved at a checkpoint is exactly what was consumed.
    room = prompt_room(config)
    prompts = make_prompt_iterator(config.data, tokenizer, batch_size=n, seed=t.seed,
                                   process_index=jax.process_index(), process_count=n,
                                   prompt_room=room)
    # Read the held-out set now: a bad file fails before the warm start trains anything.
    examples = eval_examples(config.data, tokenizer, prompt_room=room)
    engine = TrainEngine(config, workdir, mesh, trainee,
                         rl_spec(config, mesh, routing_shape(config, model_cfg)))
    try:  # no orphaned Orbax threads or open metric files when anything below fails
        reference, params, warm = reference_and_params(config, workdir, engine, tokenizer,
                                                       model_cfg.vocab_size)
        engine.start(params)
        del params
        start = engine.start_step
        # The step's logprob_mismatch takes state.step as the version of the params it
        # starts from: it must be the version the sampler labels their tokens with.
        if (step0 := int(jax.device_get(engine.state.step))) != start:
            raise ValueError(f"train state at step {step0}, RL counters at step {start}: the "
                             f"checkpoint is inconsistent")
        counters: dict[str, Any] = {}
        if engine.restored is not None:
            prompts.set_state(engine.restored.data["prompts"])
            counters = dict(engine.restored.counters)
            log.info("resuming RL at step %d (weight version %d)", start, start)
        # The sampler applies its own rules on its mesh (the trainer's devices, or its own).
        sampler = Sampler(model_cfg, config.sampler, sampler_mesh,
                          process_local_copy(engine.params), version=start,
                          workdir=str(workdir), rules=rules_for("sample"),
                          record_routing=config.rl.routing_replay == "rollout")
        reward_pool = RewardPool.from_config(config.reward)
    except BaseException:
        engine.close()
        raise
    return RLLoop(config, workdir, RLParts(
        engine=engine, model_cfg=model_cfg, sampler=sampler, sampler_mesh=sampler_mesh, reward_pool=reward_pool,
        prompts=prompts, tokenizer=tokenizer, reference=reference, examples=examples,
        counters=counters, warm_start_steps=warm, sample_rows=sample_rows(config, mesh)))


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Warm start (if needed), asynchronous RL, eval before/after, ``summary.json`` + plot.
    Distributed start-up is ``jobs.dispatch``'s."""
    t0 = time.perf_counter()
    # agent.compare_without_tools: the same job without tools first, for the summary.
    baseline = (rl_agent.run_baseline(config, workdir, run)
                if config.agent.compare_without_tools else None)
    config = rl_agent.with_traces(config, workdir)
    loop = build(config, workdir)
    try:
        summary = run_sync(loop.arun())  # asyncio.run, in a notebook cell too
        if config.distill.enabled:  # the teacher's held-out accuracy beside the student's
            summary["distill"] = distill_report(config, loop, summary)
    finally:
        loop.close()
    summary["wall_s"] = time.perf_counter() - t0
    if baseline is not None:
        summary.update(rl_agent.baseline_fields(baseline))
        log.info("accuracy with tools %s (before RL %s), without tools %s",
                 summary["accuracy_after"], summary["accuracy_before"],
                 summary["accuracy_without_tools"])
    write_summary(summary, workdir, rl_summary_table(summary, workdir))
    return summary
