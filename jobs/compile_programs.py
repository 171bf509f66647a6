"""The run's device programs, lowered with abstract inputs (nothing allocated) for a mesh.

Each builder jits its program exactly as the run does (the same step constructors, shardings and
donation) and lowers it on ``ShapeDtypeStruct``s: the SFT or RL train step at the full batch,
the KL reference's step (``ReferencePolicy``'s own apply), the sampler's prefill of a full
admission of the largest prompt bucket, one decode chunk over every slot and the whole cache, and
the re-prefills after a mid-generation weight update (on request). ``program_meshes`` builds
their meshes as the run does, with its batch-row check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms.batch import RLTrainBatch, abstract_batch
from meshrl.algorithms.losses import get_loss
from meshrl.algorithms.policy_loss import make_rl_loss_fn
from meshrl.algorithms.truncation import batch_fields
from meshrl.configs.schema import Config, ModelConfig
from meshrl.inference import paged_programs
from meshrl.inference import programs as sampler_programs
from meshrl.inference.page_table import SlotPages
from meshrl.inference.programs import SlotState
from meshrl.inference.requests import slot_settings
from meshrl.inference.shapes import prefill_pass_tokens, prompt_buckets
from meshrl.jobs.rl_setup import forward_microbatches
from meshrl.mesh import check_process_rows, create_mesh, rules_for
from meshrl.mesh.placement import create_meshes
from meshrl.models import (
    KVCache,
    abstract_model,
    flops_per_token,
    paged_kernel,
    param_shardings,
    split_model,
)
from meshrl.models.lora import LoraSetup
from meshrl.trainer import (
    abstract_state,
    batch_shardings,
    decoder_forward,
    expand_prefix,
    jit_leaf_step,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from meshrl.trainer.reference import ReferencePolicy, ref_fields
from meshrl.trainer.rl_step import make_rl_train_step, updates_per_step
from meshrl.trainer.spec import rl_batch_size, rl_spec, sft_spec
from meshrl.utils.errors import UserError
from meshrl.workflows.setup import routing_shape


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    lowered: Any  # jax.stages.Lowered
    steps: int  # model steps one call runs (a decode chunk's steps; else 1)
    model_flops: float  # per call, all chips: 6N (training) or 2N (forward) per token + attention
    executed_flops: float  # per call, all chips: model FLOPs + the remat recompute
    weights_bytes: float  # per chip: the params the program reads
    state_bytes: float = 0.0  # per chip: optimizer state (train) or KV cache (sampler)
    warnings: tuple[str, ...] = ()


def per_chip_bytes(tree: Any) -> float:
    """Bytes of one device's shard of every ``ShapeDtypeStruct`` leaf of ``tree``."""
    return float(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x in jax.tree.leaves(tree)))


def abstract_tree(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s of ``tree``'s leaves, with one sharding for all or a tree of them."""
    if isinstance(shardings, NamedSharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        tree, shardings)


def train_rows(config: Config) -> int:
    """Sequences in one train step: the RL batch, or trainer.batch_size for SFT."""
    if config.compile.job == "rl":
        return config.rollout.prompts_per_step * config.rollout.group_size
    return config.trainer.batch_size


def _train_params(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> tuple[Any, Any, Any]:
    rules = rules_for("train", config.mesh.fsdp)
    graphdef, params = split_model(abstract_model(model_cfg, mesh=mesh, rules=rules))
    return graphdef, params, expand_prefix(param_shardings(params, mesh, rules), params)


def train_program(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """The SFT or RL step (``compile.job``) as ``TrainEngine`` jits it, at the full batch; with
    ``lora.rank > 0`` the LoRA step: the adapters and their optimizer state are the trained
    state, the frozen base (stored as ``lora.base_dtype`` says) a second, donated argument."""
    t, rl, rl_job = config.trainer, config.rl, config.compile.job == "rl"
    graphdef, params, params_sh = _train_params(config, model_cfg, mesh)
    tx, schedule = make_optimizer(config.optimizer, t.learning_rate, t.steps,
                                  updates_per_step(rl) if rl_job else 1)
    rows, rules = train_rows(config), rules_for("train", config.mesh.fsdp)
    forward = decoder_forward(graphdef, t.logits_chunk)
    routing = routing_shape(config, model_cfg) if rl_job else None  # MoE routing replay
    if rl_job:
        T = config.sampler.temperature
        batch_sh = batch_shardings(mesh, rules, rows, t.seq_len, RLTrainBatch, *ref_fields(rl),
                                   *batch_fields(config.sampler), *(("routing",) if routing else ()))
        cap = config.sampler.top_k
        make = functools.partial(make_rl_train_step,
                                 loss_fn=make_rl_loss_fn(rl, temperature=T, kept_cap=cap), tx=tx,
                                 schedule=schedule, rl=rl, temperature=T,
                                 microbatches=t.microbatches, kept_cap=cap)
    else:
        batch_sh = batch_shardings(mesh, rules, rows, t.seq_len)
        make = functools.partial(make_train_step, loss_fn=get_loss("sft"), tx=tx,
                                 schedule=schedule, microbatches=t.microbatches)
    if config.lora.rank > 0:
        step, state_sh, leaves, weights = _lora_parts(config, graphdef, params, params_sh, tx,
                                                      mesh, forward, make)
    else:
        state_sh = state_shardings(params_sh, tx, mesh, params)
        step, leaves = make(forward), jax.tree.leaves(abstract_state(state_sh, params, tx))
        weights = per_chip_bytes(abstract_tree(params, params_sh))
    jitted = jit_leaf_step(step, state_sh, batch_sh, mesh)
    lowered = jitted.lower(leaves, abstract_batch(batch_sh, rows, t.seq_len,
                                                  {"routing": routing} if routing else None))
    warnings = split_warning(rows, t.microbatches, batch_sh.input_ids, t.seq_len)
    # Each epoch trains on every row once (its K minibatches split the rows); with K x E > 1
    # the step first scores the batch in a forward pass of its own (a third of a train pass).
    batch_flops = flops_per_token(model_cfg, t.seq_len) * rows * t.seq_len
    flops = batch_flops * (rl.ppo_epochs if rl_job else 1)
    remat = 8 / 6 if model_cfg.remat == "full" else 1.0  # the forward pass runs again
    proximal = batch_flops / 3 if rl_job and updates_per_step(rl) > 1 else 0.0
    return Program("train", lowered, 1, flops, flops * remat + proximal, weights,
                   per_chip_bytes(leaves) - weights, warnings)


def _lora_parts(config: Config, graphdef: Any, params: Any, params_sh: Any, tx: Any,
                mesh: Mesh, forward: Any, make: Callable[[Any], Any]
                ) -> tuple[Any, Any, list[Any], float]:
    """(step, state shardings, abstract input leaves, weight bytes per chip) of the LoRA step,
    as ``TrainEngine`` builds it: the state is the adapters' (sharded like their kernels), the
    frozen base follows it; the weights the step reads are the frozen base and the adapters."""
    setup = LoraSetup(config.lora, graphdef, params, params_sh)
    adapters = setup.abstract_adapters()
    state_sh = state_shardings(setup.adapter_sh, tx, mesh, adapters)
    frozen = setup.abstract_frozen(params)
    leaves = jax.tree.leaves(abstract_state(state_sh, adapters, tx)) + jax.tree.leaves(frozen)
    weights = per_chip_bytes(frozen) + per_chip_bytes(abstract_tree(adapters, setup.adapter_sh))
    return setup.step(forward, make), (state_sh, setup.frozen_sh), leaves, weights


def split_warning(rows: int, microbatches: int, sharding: Any, seq_len: int) -> tuple[str, ...]:
    """A line when a microbatch's rows do not split evenly over the batch shards: XLA then
    replicates activations and all-reduces them, silently (a real run is as slow)."""
    shards = rows // sharding.shard_shape((rows, seq_len))[0]
    per = rows // microbatches
    if per % shards == 0:
        return ()
    return (f"{per} rows per microbatch (batch {rows} / {microbatches} microbatches) do not "
            f"split over the {shards} batch shards: activations replicate; make "
            f"trainer.batch_size / trainer.microbatches a multiple of {shards}",)


def reference_program(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """The KL reference's step as the RL job jits it: ``ReferencePolicy``'s own apply (the
    frozen params' log-probabilities of the RL batch, split into ``forward_microbatches``, and
    the KL they feed), at the full batch; with ``lora.rank > 0`` over the LoRA step's frozen base
    (the weights it reads are the ones the train step holds, not a second copy)."""
    t = config.trainer
    graphdef, params, params_sh = _train_params(config, model_cfg, mesh)
    rows = rl_batch_size(config)
    routing = routing_shape(config, model_cfg)
    batch_sh = rl_spec(config, mesh, routing).batch_sh  # the engine's batch layout
    forward = decoder_forward(graphdef, t.logits_chunk)
    if config.lora.rank > 0:  # the adapter-disabled forward over the step's frozen base
        setup = LoraSetup(config.lora, graphdef, params, params_sh)
        forward, params_sh = setup.reference_forward(forward), setup.frozen_sh
        params = setup.abstract_frozen(params)
    else:
        params = abstract_tree(params, params_sh)
    # ``base`` (how a LoRA run hands over the params at each apply) keeps ReferencePolicy from
    # copying concrete params, which these abstract ones are not; the apply it jits is the one
    # a full run's frozen copy goes through, with the same shardings.
    ref = ReferencePolicy(config.rl, forward, None, params_sh, mesh, batch_sh, samples=rows,
                          temperature=config.sampler.temperature,
                          group_size=config.rollout.group_size,
                          microbatches=forward_microbatches(config), base=lambda: None)
    batch = abstract_batch(batch_sh.replace(ref_logprobs=None), rows, t.seq_len,
                           {"routing": routing} if routing else None)
    lowered = ref._apply.lower(params, batch)  # the jitted apply ReferencePolicy.apply calls
    flops = flops_per_token(model_cfg, t.seq_len) / 3 * rows * t.seq_len
    return Program("reference", lowered, 1, flops, flops, per_chip_bytes(params))


def sampler_parts(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> tuple:
    s, rules = config.sampler, rules_for("sample")
    cfg = sampler_programs.sampler_model_config(model_cfg, s)
    graphdef, params = split_model(abstract_model(cfg, mesh=mesh, rules=rules))
    params = abstract_tree(params, expand_prefix(param_shardings(params, mesh, rules), params))
    if s.kv_cache == "paged":  # the sampler's own page pool and table, as it builds them
        pages = SlotPages(cfg, s, mesh, rules)
        cache_sh, cache = pages.sharding, pages.abstract_cache()
    else:
        cache_sh = KVCache.shardings(cfg, s.slots, s.max_len, mesh, rules)  # mesh's layout
        cache = jax.eval_shape(lambda: KVCache.init(cfg, s.slots, s.max_len, s.dtype,
                                                    cache_sh.key_layout))
    cache = abstract_tree(cache, cache_sh)
    repl = NamedSharding(mesh, PartitionSpec())
    # The highest sampling level (the vocabulary sort's temporaries included): a run reaches it
    # on any request with top-k/top-p/min-p, so its memory bounds every level's.
    state = abstract_tree(jax.eval_shape(lambda: SlotState.init(s.slots)), repl)
    return cfg, graphdef, params, cache, cache_sh, state, repl


def prefill_program(config: Config, model_cfg: ModelConfig, mesh: Mesh, *,
                    all_positions: bool = False, max_tokens: int | None = None,
                    bucket: int | None = None, name: str = "prefill") -> Program:
    """One prefill of every slot with prompts of the largest bucket (or ``bucket``), as
    ``Sampler`` jits it (passes of ``shapes.prefill_pass_tokens`` tokens), every pass run: the
    sampler's pass count is a traced value, fixed here so the cost analysis knows the loop's
    trip count (``max_tokens``: the pass size, default ``sampler.prefill_tokens``;
    ``all_positions``: the head on every prompt position, a baseline of benchmarks/memory.py)."""
    s = config.sampler
    cfg, graphdef, params, cache, cache_sh, state, repl = sampler_parts(config, model_cfg, mesh)
    S, P = s.slots, bucket or prompt_buckets(s)[-1]
    host = (np.zeros((S, P), np.int32), np.full((S,), P, np.int32), np.arange(S, dtype=np.int32),
            slot_settings([], S, s))
    tokens, lens, slots, settings = (abstract_tree(x, repl) for x in host)
    prefill = sampler_programs.make_prefill(
        graphdef, cfg, s.max_len, all_positions=all_positions,
        max_tokens=prefill_pass_tokens(s, prompt_buckets(s)) if max_tokens is None else max_tokens)
    jitted = jax.jit(prefill, static_argnames=("resample",), donate_argnums=(1, 2),
                     out_shardings=(cache_sh, repl, repl))
    lowered = jitted.lower(params, cache, state, tokens, lens, slots, settings, resample=True)
    flops = flops_per_token(cfg, P) / 3 * S * P
    return Program(name, lowered, 1, flops, flops, per_chip_bytes(params), per_chip_bytes(cache))


def reprefill_program(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """The re-prefill after a weight update mid-generation: the prefill program over the
    longest re-prefill bucket (``max_len``: a sequence's prompt and tokens so far) in every
    slot, passes as the prompt's."""
    return prefill_program(config, model_cfg, mesh, bucket=config.sampler.max_len,
                           name="reprefill")


def reprefill_tail_program(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """The paged cache's re-prefill of group members after their shared prompt pages: every
    slot's tail of ``max_len`` positions written into its pages while attending over them
    (several queries a row: the portable page gather, also on a TPU), as ``SlotPages`` jits
    it."""
    s = config.sampler
    if s.kv_cache != "paged":
        raise UserError(f"compile.programs includes 'reprefill_tail': only the paged cache "
                        f"re-prefills tails over shared pages; sampler.kv_cache = "
                        f"{s.kv_cache!r}")
    cfg, graphdef, params, cache, cache_sh, _, repl = sampler_parts(config, model_cfg, mesh)
    S, L = s.slots, s.max_len
    tail = paged_programs.make_tail(graphdef, prefill_pass_tokens(s, prompt_buckets(s)))
    jitted = jax.jit(tail, donate_argnums=(1,), out_shardings=cache_sh)
    host = (np.zeros((S, L), np.int32), np.zeros((S, L), np.int32),
            np.arange(S, dtype=np.int32), np.int32(S))
    lowered = jitted.lower(params, cache, *(abstract_tree(x, repl) for x in host))
    flops = flops_per_token(cfg, L) / 3 * S * L
    return Program("reprefill_tail", lowered, 1, flops, flops, per_chip_bytes(params),
                   per_chip_bytes(cache))


def decode_program(config: Config, model_cfg: ModelConfig, mesh: Mesh) -> Program:
    """One decode chunk (``sampler.decode_chunk`` steps) of every slot over the whole cache."""
    s = config.sampler
    cfg, graphdef, params, cache, cache_sh, state, repl = sampler_parts(config, model_cfg, mesh)
    # The paged cache decodes over a window gathered from its pages or over the pages in place
    # (``sampler.paged_decode``), as Sampler builds it.
    make = paged_programs.make_decode if s.kv_cache == "paged" else sampler_programs.make_decode
    decode = make(graphdef, s.max_len, s.decode_chunk, lambda _: None)
    jitted = jax.jit(decode, static_argnames=("window",), donate_argnums=(1, 2),
                     out_shardings=(cache_sh, repl, repl))
    every_slot = np.arange(s.slots, dtype=np.int32)
    # A decode in place calls the TPU kernel, whose Mosaic lowering targets the mesh's chip.
    scope = paged_kernel.lowering_for(mesh) if s.kv_cache == "paged" else contextlib.nullcontext()
    with scope:
        lowered = jitted.lower(params, cache, state, every_slot, window=s.max_len)
    flops = flops_per_token(cfg, s.max_len) / 3 * s.slots * s.decode_chunk
    return Program("decode", lowered, s.decode_chunk, flops, flops, per_chip_bytes(params),
                   per_chip_bytes(cache))


TRAIN_PHASE = ("train", "reference")
SAMPLING_PHASE = ("prefill", "decode", "reprefill", "reprefill_tail")


def program_meshes(config: Config, devices: list[Any]) -> dict[str, Mesh]:
    """Each program's mesh over ``devices``, as the run builds it, after the run's own check
    that the train batch's rows split over the devices' processes (``check_process_rows``,
    which ``TrainEngine`` runs: a mesh it refuses is no run to report). RL places the trainer
    and sampler as the RL job does: colocated, both on every device (the sampler's own mesh with
    rl.sampler_expert); split, each on its share. Raises ``MeshShapeError`` or ``ConfigError``."""
    if config.compile.job == "rl":
        mesh, sampler_mesh = create_meshes(config, devices)
        batch_sh = rl_spec(config, mesh).batch_sh
    else:
        mesh = sampler_mesh = create_mesh(config.mesh, devices)
        batch_sh = sft_spec(config, mesh).batch_sh
    check_process_rows(batch_sh.input_ids, config.mesh)
    return {**dict.fromkeys(TRAIN_PHASE, mesh), **dict.fromkeys(SAMPLING_PHASE, sampler_mesh)}


BUILDERS: dict[str, Callable[[Config, ModelConfig, Mesh], Program]] = {
    "train": train_program, "reference": reference_program, "prefill": prefill_program,
    "decode": decode_program, "reprefill": reprefill_program,
    "reprefill_tail": reprefill_tail_program}


def default_programs(config: Config) -> tuple[str, ...]:
    """What ``compile.job`` runs: SFT the train step; RL the sampler's programs too, and the
    reference forward when the KL is on."""
    if config.compile.job == "sft":
        return ("train",)
    return ("train", "prefill", "decode") + (("reference",) if config.rl.kl_coef > 0 else ())
