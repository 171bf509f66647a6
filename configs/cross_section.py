"""Rules that span config sections; ``Config.__post_init__`` runs them.

Contract: a ``Config`` that exists passes every rule here, so ``from_config_dict`` (and with it
``main.py --dry_run``) rejects exactly the configs a run rejects. Each error is a ``ConfigError``
naming the field, its value and the rule. Rules that need devices or files stay at run time and
are repeated by ``jobs.dispatch.dry_run``: the device count (``mesh.*``, ``rl.sampler_devices``)
and the input paths (``configs/paths.py``). See docs/architecture.md, "Config validation".
"""

from __future__ import annotations

from typing import Any, Protocol

from meshrl.configs.fields import ConfigError


class ConfigSections(Protocol):
    """The sections of ``configs.schema.Config`` these rules read. The rules run inside
    ``Config.__post_init__``, so schema.py imports this module; naming its types here instead
    would close an import cycle."""

    job: Any  # a Job, or its string before coercion
    mesh: Any
    model: Any
    trainer: Any
    sampler: Any
    rollout: Any
    rl: Any
    data: Any
    generate: Any
    agent: Any
    compile: Any


def _unused_mesh_axes(config: ConfigSections) -> None:
    # Only MoE expert FFNs (``mlp_moe``) map to expert_tensor: on a dense decoder, devices on it
    # would hold replicas that compute the same thing. ``expert`` is fine: dense layers use it
    # as extra batch (mesh/rules.py). With model.hf_path the checkpoint decides (at build time).
    mesh, model = config.mesh, config.model
    if model.hf_path:
        return
    if model.num_experts == 0:
        for name in ("expert_tensor", "dcn_expert_tensor"):
            if getattr(mesh, name) != 1:
                raise ConfigError(f"mesh.{name} = {getattr(mesh, name)}: must be 1: it shards "
                                  f"only MoE expert FFNs and model.* is a dense decoder (put the "
                                  f"devices on mesh.data or mesh.expert instead)")
        return
    check_moe_mesh(model.num_experts, model.resolved_moe_intermediate_size,
                   expert=mesh.expert * mesh.dcn_expert if -1 not in (mesh.expert,
                                                                       mesh.dcn_expert) else 1,
                   expert_tensor=mesh.expert_tensor * mesh.dcn_expert_tensor if -1 not in (
                       mesh.expert_tensor, mesh.dcn_expert_tensor) else 1)


def check_moe_mesh(num_experts: int, moe_width: int, *, expert: int, expert_tensor: int) -> None:
    """The expert axis must divide the experts and expert_tensor each expert's FFN width: a
    silent replication would hide a misconfigured mesh."""
    if num_experts % expert:
        raise ConfigError(f"mesh.expert = {expert}: must divide model.num_experts = "
                          f"{num_experts}")
    if moe_width % expert_tensor:
        raise ConfigError(f"mesh.expert_tensor = {expert_tensor}: must divide the expert FFN "
                          f"width model.moe_intermediate_size = {moe_width}")


def _microbatches(config: ConfigSections, job: str) -> None:
    """trainer.microbatches must divide the SFT-shaped batch the job trains on: RL's warm start
    when it has one (RL's own batch is checked in ``_rl``)."""
    if job == "rl" and (config.model.hf_path or config.rl.warm_start_steps == 0):
        return
    name, value = (("rl.warm_start_batch_size", config.rl.warm_start_batch_size) if job == "rl"
                   else ("trainer.batch_size", config.trainer.batch_size))
    if value % config.trainer.microbatches:
        raise ConfigError(f"trainer.microbatches = {config.trainer.microbatches}: must divide "
                          f"{name} = {value}")


# Advantages that compare a prompt's samples with each other: 0 for a group of one.
GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo")


def _rl(config: ConfigSections) -> None:
    B = config.rollout.prompts_per_step * config.rollout.group_size  # sequences per step
    if B % config.trainer.microbatches:
        raise ConfigError(f"trainer.microbatches = {config.trainer.microbatches}: must divide "
                          f"rollout.prompts_per_step * rollout.group_size = {B}")
    K, M = config.rl.ppo_minibatches, config.trainer.microbatches
    if B % (K * M):
        # Packed row buckets are multiples of K * M (jobs/rl_setup.py), so B is the one to check.
        raise ConfigError(f"rl.ppo_minibatches = {K}: rl.ppo_minibatches * trainer.microbatches "
                          f"= {K * M} must divide rollout.prompts_per_step * "
                          f"rollout.group_size = {B} (each minibatch is split into "
                          f"trainer.microbatches)")
    adv, n = config.rl.advantage, config.rollout.group_size
    if n == 1 and adv in GROUP_ADVANTAGES and not config.distill.enabled:
        raise ConfigError(f"rollout.group_size = 1: every advantage is 0 under rl.advantage = "
                          f"{adv!r} (it compares the samples of a prompt's group): use "
                          f"rollout.group_size >= 2, or rl.advantage = 'reinforce_pp'")
    s = config.sampler
    # The behaviour policy is softmax(logits / T), truncated by top-k/top-p/min-p to the kept
    # counts the sampler records; the trainer rescores with logits / T truncated to as many
    # (algorithms/truncation.py). Greedy decoding has no distribution to rebuild.
    if s.temperature <= 0.0:
        raise ConfigError(f"sampler.temperature = {s.temperature}: the RL job needs a "
                          f"temperature > 0 (greedy decoding has no behaviour distribution)")
    truncated = [f"sampler.{k} = {v}" for k, v, off in (
        ("top_k", s.top_k, 0), ("top_p", s.top_p, 1.0), ("min_p", s.min_p, 0.0)) if v != off]
    if truncated and config.agent.env:
        raise ConfigError(f"{', '.join(truncated)}: agent episodes (agent.env = "
                          f"{config.agent.env!r}) do not record the sampler's kept token "
                          f"counts: use top_k = 0, top_p = 1 and min_p = 0 with agent.env")
    if config.rl.routing_replay != "off":
        _routing_replay(config)
    if config.rl.sampler_expert and not config.model.hf_path:
        check_sampler_expert(config.rl.sampler_expert, config.model.num_experts)
    if config.model.hf_path and config.rl.warm_start_steps > 0:
        raise ConfigError(f"rl.warm_start_steps = {config.rl.warm_start_steps}: must be -1 or 0 "
                          f"with model.hf_path = {config.model.hf_path!r} (a pretrained policy "
                          f"gets no SFT warm start)")
    if s.prompt_buckets and s.prompt_buckets[-1] < config.data.max_prompt_len:
        raise ConfigError(f"sampler.prompt_buckets = {s.prompt_buckets}: the largest must be "
                          f">= data.max_prompt_len = {config.data.max_prompt_len}")


def _routing_replay(config: ConfigSections) -> None:
    # Only the sampler's own episodes record routing; with model.hf_path the checkpoint says
    # whether the model has experts (checked when the RL job loads it: check_routing_replay).
    if config.agent.env:
        raise ConfigError(f"rl.routing_replay = {config.rl.routing_replay!r}: agent episodes "
                          f"(agent.env = {config.agent.env!r}) do not record the routing: use "
                          f"rl.routing_replay = 'off' with agent.env")
    if config.sampler.kv_cache != "dense":
        raise ConfigError(f"rl.routing_replay = {config.rl.routing_replay!r}: the paged KV "
                          f"cache's prefix programs do not record the routing: use "
                          f"sampler.kv_cache = 'dense'")
    if not config.model.hf_path:
        check_routing_replay(config.rl.routing_replay, config.model.num_experts)


def check_sampler_expert(n: int, num_experts: int) -> None:
    """The sampler's expert axis shards expert weights: a dense model has none, and the axis
    must divide the experts (with ``model.hf_path`` checked when the RL job loads it)."""
    if num_experts == 0:
        raise ConfigError(f"rl.sampler_expert = {n}: the model is dense (model.num_experts = "
                          f"0), so there are no expert weights to shard: set 0")
    if num_experts % n:
        raise ConfigError(f"rl.sampler_expert = {n}: must divide model.num_experts = "
                          f"{num_experts}")


def check_routing_replay(mode: str, num_experts: int) -> None:
    """Routing replay needs experts to route to."""
    if mode != "off" and num_experts == 0:
        raise ConfigError(f"rl.routing_replay = {mode!r}: the model is dense "
                          f"(model.num_experts = 0): set rl.routing_replay = 'off'")


def _generate(config: ConfigSections) -> None:
    source, hf_path = config.generate.source, config.model.hf_path
    if source == "hf_path" and not hf_path:
        raise ConfigError("generate.source = 'hf_path': model.hf_path is empty: set it to a local "
                          "Hugging Face checkpoint directory, or pick another generate.source "
                          "(random, checkpoint, version)")
    if source == "random" and hf_path:
        raise ConfigError(f"generate.source = 'random': model.hf_path = {hf_path!r} would be "
                          f"ignored: set generate.source = 'hf_path' to sample from it, or clear "
                          f"model.hf_path")


def _context(config: ConfigSections) -> None:
    mesh = config.mesh
    if -1 in (mesh.context, mesh.dcn_context):
        return
    C = mesh.context * mesh.dcn_context
    need = 2 * C if config.model.context_balance else C
    if C > 1 and config.trainer.seq_len % need:
        raise ConfigError(f"trainer.seq_len = {config.trainer.seq_len}: must be divisible by "
                          f"{'2 x ' if config.model.context_balance else ''}mesh.context = "
                          f"{need} (model.context_balance = {config.model.context_balance})")


def check_pair_rows(trainer: Any) -> None:
    """Preference training keeps each (chosen, rejected) pair in two adjacent rows of one
    step's batch."""
    if trainer.batch_size % 2:
        raise ConfigError(f"trainer.batch_size = {trainer.batch_size}: job = 'dpo' needs an "
                          f"even batch size (each pair is two rows)")
    if trainer.microbatches != 1:
        raise ConfigError(f"trainer.microbatches = {trainer.microbatches}: job = 'dpo' needs 1 "
                          f"(strided microbatches would split the (chosen, rejected) row pairs)")


def check_preference_source(dpo_path: str, data_source: str) -> None:
    """Without a preference file (``dpo.path``) the DPO job trains on the synthetic preference
    task, which only the arithmetic task has (``datasets/preference.py``)."""
    if not dpo_path and data_source != "arithmetic":
        raise ConfigError(f"data.source = {data_source!r}: the synthetic preference task needs "
                          f"'arithmetic' (dpo.path is empty): set data.source = 'arithmetic', "
                          f"or dpo.path to a preference JSONL file")


def validate_config(config: ConfigSections) -> None:
    """Raise ``ConfigError`` on the first cross-section rule ``config`` breaks."""
    _unused_mesh_axes(config)
    _context(config)
    job = getattr(config.job, "value", config.job)  # a Job, or its string before coercion
    if job == "compile":
        # The compile job lowers compile.job's programs: a config that job refuses would crash
        # in tracing (or report a run that cannot start), and one it accepts must compile.
        job = config.compile.job
    if job == "dpo":
        check_pair_rows(config.trainer)
        check_preference_source(config.dpo.path, config.data.source)
    _microbatches(config, job)
    if job == "rl":
        _rl(config)
    elif job == "generate":
        _generate(config)
