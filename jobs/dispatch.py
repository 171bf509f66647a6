"""Job dispatch for ``main.py``: the job registry, the dry run and the run.

Contract: ``register(job, "module:function")`` maps a ``Job`` to ``function(config, workdir)``;
the module is imported only when that job runs. ``dry_run(config)`` runs every check a run makes
before it compiles or writes anything (the config is already valid: ``Config`` runs the
cross-section rules; here: ``preflight`` -- input paths, the effective model and tokenizer, chat
data without a chat model -- then distributed start-up, the meshes with their device count, the
split placement included, and the paged sampler's page pool over its mesh) and returns the text
a user checks, the model section as the run will build it. ``run`` makes the same checks
(``preflight``), then checks the workdir and takes its lock (``utils/workdir.py``; one run per
workdir and writing job: SFT and RL share a lock, generate and evaluate have their own, export
takes none), then calls the job. Design: docs/architecture.md, "Device placement and dispatch".
"""

from __future__ import annotations

import importlib
import logging
import os

import jax
from jax.sharding import Mesh

from meshrl.configs.loader import render
from meshrl.configs.paths import check_chat_model, check_input_paths, input_paths
from meshrl.configs.schema import Config, Job
from meshrl.datasets import sources
from meshrl.mesh import (
    create_mesh,
    describe_mesh,
    describe_rules,
    initialize_distributed,
    rules_for,
)
from meshrl.models.build import EffectiveModel, effective_model
from meshrl.trainer.wandb_sink import check_wandb
from meshrl.utils import compile_cache, log, multihost, paths
from meshrl.utils.tpu_env import tpu_chips_attached
from meshrl.utils.workdir import WorkdirError, WorkdirLock, prepare

# Job -> "module:function"; each function takes (config, workdir).
_JOBS: dict[Job, str] = {}


def register(job: Job, target: str) -> None:
    _JOBS[job] = target


register(Job.SFT, "meshrl.jobs.sft:run")
register(Job.GENERATE, "meshrl.jobs.generate:run")
register(Job.RL, "meshrl.jobs.rl:run")
register(Job.EXPORT, "meshrl.jobs.export:run")
register(Job.EVALUATE, "meshrl.jobs.evaluate:run")
register(Job.COMPILE, "meshrl.jobs.compile:run")
register(Job.DPO, "meshrl.jobs.dpo:run")


class _KnownNoise(logging.Filter):
    """Drops two log records that tell a user nothing they can act on: JAX probing for a TPU
    on a host without TPU chips (with or without the TPU compiler installed; on a TPU host a
    failed start still shows), and Orbax noting that the checkpoint reader opened its
    directory read-only, as the reader always does."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.name == "jax._src.xla_bridge":
            return not (msg.startswith("Unable to initialize backend 'tpu'")
                        and not tpu_chips_attached())
        return not msg.startswith("Given directory is read only")


_NOISE = _KnownNoise()
_NOISY_LOGGERS = ("jax._src.xla_bridge", "absl")  # absl: Orbax logs through absl.logging


def quiet_known_noise() -> None:
    """Install the ``_KnownNoise`` filter on the loggers that emit those records (idempotent);
    called before the first device query of a run or dry run."""
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _NOISE not in logger.filters:
            logger.addFilter(_NOISE)


def check_data_rows(config: Config) -> None:
    """The first row of each data file the job reads, read as its pipeline reads it: fields
    that do not fit ``data.*`` fail the dry run, not the run's first batch."""
    data = config.data
    if data.source not in ("jsonl", "parquet"):
        return
    files = {Job.SFT: [(data.path, True), (data.eval_path, True)],
             Job.RL: [(data.path, True), (data.eval_path, True)],
             Job.GENERATE: [(data.path, False)],
             Job.EVALUATE: [(data.eval_path, True)]}.get(config.job, [])
    for path, require_answer in files:
        if path and os.path.isfile(path):
            sources.check_first_row(path, data, require_answer)


def preflight(config: Config) -> EffectiveModel:
    """The checks a run and its dry run share, before any device, compile or write: the input
    paths, the effective model and tokenizer (``models.build.effective_model``, the functions
    every job builds with), chat data without a chat model (``configs.paths.check_chat_model``).
    Returns the effective model the dry run prints."""
    quiet_known_noise()
    check_input_paths(config)
    check_data_rows(config)
    check_wandb(config)
    effective = effective_model(config.model)
    warning = check_chat_model(config)
    if warning:
        log.get_logger("main").warning("%s", warning)
    return effective


def dry_run(config: Config) -> str:
    """Check what a run checks before its first compile (``preflight``, distributed start-up, the
    trainer and sampler meshes on the devices, the page pool over the sampler's); return the
    config with the effective model, the inputs read, the meshes and rules. Raises the run's ``UserError`` (``ConfigError``,
    ``MeshShapeError``) on the first problem."""
    effective = preflight(config)
    initialize_distributed(config.distributed)
    if config.job == Job.RL and (config.rl.placement == "split" or config.rl.sampler_expert):
        # mesh.* covers only the trainer's share of the devices in split mode; the sampler's
        # mesh is its own with rl.sampler_expert.
        from meshrl.mesh.placement import create_meshes

        mesh, sampler_mesh = create_meshes(config)
    elif config.job == Job.COMPILE:  # the mesh over the devices it compiles for
        from meshrl.jobs.compile import target

        mesh, sampler_mesh = create_mesh(config.mesh, target(config.compile)[0]), None
    else:
        mesh, sampler_mesh = create_mesh(config.mesh), None
    log.set_process_index(jax.process_index())
    check_page_pool(config, mesh, sampler_mesh)
    lines = [
        "# resolved config (model.*: the effective model the run builds)",
        render(config, replace={"model": effective.config}, notes=model_notes(effective)),
        "# inputs (checked)",
        *(f"  {name}: {path}" for name, path in _inputs(config, effective)),
        f"# mesh ({len(mesh.devices.flat)} devices, {mesh.devices.flat[0].platform})",
        "  " + describe_mesh(mesh),
    ]
    if sampler_mesh is not None:
        lines += [f"# sampler mesh (rl.placement = {config.rl.placement}, "
                  f"{len(sampler_mesh.devices.flat)} devices)", "  " + describe_mesh(sampler_mesh)]
    lines += [
        "# logical -> physical rules: train"
        + (" (fsdp)" if config.mesh.fsdp else ""),
        describe_rules(rules_for("train", config.mesh.fsdp)),
        "# logical -> physical rules: sample",
        describe_rules(rules_for("sample")),
    ]
    return "\n".join(lines)


# The jobs that build a ``Sampler``, on the mesh each builds it on.
_SAMPLING_JOBS = (Job.GENERATE, Job.RL, Job.EVALUATE)


def check_page_pool(config: Config, mesh: Mesh, sampler_mesh: Mesh | None) -> None:
    """``sampler.num_pages`` split over the sampler mesh's slot shards as the sampler splits it
    (``page_table.pool_shards``), so a count it refuses fails the dry run, not the run after
    its weights load. The sampler's mesh: ``sampler_mesh`` (the RL job's own), else ``mesh``,
    or with several processes this process's devices (``process_sampler_mesh``, as the
    generate and RL jobs build it; the evaluate job samples on ``mesh``)."""
    s = config.sampler
    if config.job not in _SAMPLING_JOBS or s.kv_cache != "paged" or not s.num_pages:
        return  # the default pool holds every slot's max_len: it splits as the slots do
    from meshrl.inference.page_table import pool_shards
    from meshrl.mesh.placement import process_sampler_mesh

    if sampler_mesh is None:
        several = jax.process_count() > 1 and config.job != Job.EVALUATE
        sampler_mesh = process_sampler_mesh(mesh) if several else mesh
    pool_shards(s, s.num_pages, sampler_mesh, rules_for("sample"))


def model_notes(effective: EffectiveModel) -> dict[str, str]:
    """``model.<field>`` -> where its effective value comes from, for the dry run's listing."""
    cfg, tok = effective.config, effective.tokenizer
    source = f"from {cfg.hf_path}/config.json" if cfg.hf_path else ""
    notes = dict.fromkeys((f"model.{n}" for n in effective.from_checkpoint), source)
    what = ("built-in byte tokenizer" if effective.tokenizer_spec == "char"
            else f"{effective.tokenizer_spec}/tokenizer.json")
    stops = "" if len(tok.stop_ids) < 2 else f" (generation stops at {list(tok.stop_ids)})"
    notes["model.tokenizer"] = (f"{what}: {tok.vocab_size} ids, eos {tok.eos_id}{stops}, bos "
                                f"{tok.bos_id}, pad {tok.pad_id}, chat template "
                                f"{'yes' if tok.has_chat_template else 'no (built-in format)'}")
    if not cfg.hf_path:
        notes["model.hf_path"] = "empty: a random init of model.*"
    else:
        stored = effective.checkpoint_dtype or "unknown"
        for name in ("param_dtype", "compute_dtype"):
            notes[f"model.{name}"] = f"from model.* (the checkpoint stores {stored})"
    return notes


def _inputs(config: Config, effective: EffectiveModel) -> list[tuple[str, str]]:
    found = input_paths(config)
    if effective.tokenizer_spec not in ("char", config.model.tokenizer):
        found.insert(1, ("tokenizer (model.tokenizer = 'auto')",
                         f"{effective.tokenizer_spec}/tokenizer.json"))
    return found or [("none", "model.* random init, synthetic data")]


def run(config: Config, workdir: str) -> None:
    log.setup(config.logging.level)
    # The compile job builds programs for devices that may not be here; a cached TPU executable
    # cannot even be read back without a TPU client.
    if config.job == Job.COMPILE:
        cache = None
        compile_cache.disable()  # JAX's default (on with $JAX_COMPILATION_CACHE_DIR) too
    else:
        cache = compile_cache.enable(config.runtime)
    preflight(config)  # the same checks as dry_run, before anything is written
    if config.job not in _JOBS:
        known = sorted(j.value for j in _JOBS)
        raise NotImplementedError(f"job = {config.job.value!r} has no runner in this build; "
                                  f"available: {known}")
    module, fn = _JOBS[config.job].split(":")
    # Every job, generate and export included, joins the multi-controller runtime the same way.
    initialize_distributed(config.distributed)
    log.set_process_index(jax.process_index())
    if cache is not None:  # logged once the record can carry this process's index
        log.get_logger("main").info("JAX compilation cache: %s", cache)
    lock = _claim_workdir(config, workdir)
    log.get_logger("main").info("workdir %s", workdir)
    try:
        getattr(importlib.import_module(module), fn)(config, workdir)
    finally:
        if lock is not None:
            lock.release()


# The lock file of each job that writes into the workdir. SFT and RL write the same checkpoints
# (RL's warm start included), so they share one; the evaluator, the sampler and the compile job
# write files of their own and may run beside training. Export only reads the workdir.
_LOCKS: dict[Job, str] = {Job.SFT: ".meshrl.lock", Job.RL: ".meshrl.lock", Job.DPO: ".meshrl.lock",
                          Job.GENERATE: ".meshrl.generate.lock",
                          Job.EVALUATE: ".meshrl.evaluate.lock",
                          Job.COMPILE: ".meshrl.compile.lock"}
# The jobs whose loops stop at a step boundary on a first Ctrl-C (``utils.interrupt``); the
# others stop at once.
STEP_JOBS = frozenset({Job.SFT, Job.RL, Job.DPO})


def _claim_workdir(config: Config, workdir: str) -> WorkdirLock | None:
    """Check the workdir on every process and lock it on process 0 (the processes of one run
    share the workdir, and a second run has a process 0 too); every process raises the first
    process's problem, so that none of them goes on alone into a collective."""
    name = _LOCKS.get(config.job)
    if name is None:
        if config.job != Job.EXPORT:  # export only reads it: a mistyped path stays absent
            paths.as_path(workdir).mkdir(parents=True, exist_ok=True)
        return None
    problem, lock = None, None
    try:
        prepare(workdir)
        if jax.process_index() == 0:
            lock = WorkdirLock(workdir, name, config.job.value)
            lock.acquire()
    except WorkdirError as e:
        problem = str(e)
    problems = [p for p in multihost.allgather_json(problem) if p]
    if problems:
        if lock is not None:
            lock.release()
        raise WorkdirError(problems[0])
    return lock
