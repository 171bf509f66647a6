"""The ``sample`` job: completions for prompts, with the weights, tokenizer and prompt rendering
of training.

  python main.py --config configs/sample.py --workdir /tmp/meshrl_sample
  python main.py --config configs/sample.py --workdir /tmp/s --config.sample.source=hf_path \\
      --config.model.hf_path=/path/to/hf_model --config.data.source=jsonl \\
      --config.data.path=prompts.jsonl --config.data.prompt_field=prompt
  python main.py --config configs/default.py --workdir RUN --config.job=sample \\
      --config.sample.source=checkpoint    # or =version (--config.sample.version=V, -1 newest)

Contract:
* Weights (``sample.source``): ``model.hf_path``; a random init of ``model.*``; the params of the
  newest verified checkpoint of the run in ``--workdir`` (model and tokenizer from the config
  saved with it); or its published version ``<workdir>/weights/<V>``. A missing source is a
  ``ConfigError`` naming it. Tokens carry the weight version (checkpoint: the state's).
* Tokenizer: ``tokenizer_for`` as in the RL job; a missing tokenizer is an error, never a fallback.
* Prompts: ``data.*`` rows (JSONL/Parquet, the answer field optional; or the synthetic task),
  rendered by the pipeline's ``prompt_text`` + ``encode_prompt`` (chat template when the
  tokenizer has one, BOS): the ids of the RL prompt iterator for the same row. Prompts over
  min(data.max_prompt_len, the largest prompt bucket) follow ``data.on_overlong``; none left is a
  ``DatasetError``.
* Output: ``<workdir>/samples.jsonl``; when one exists it is kept and the samples go to the first
  free ``samples-<n>.jsonl``, unless ``sample.overwrite``. One record per prompt: its row's
  fields, ``prompt_text``, ``prompt_ids``, ``completion``, ``tokens``, ``logprobs``,
  ``raw_logprobs``, ``versions``, ``finish_reason``.
* Several processes: each loads the weights onto a sampler mesh over its own devices
  (``mesh.tensor``/``expert``/``expert_tensor`` kept, ``data`` filling them), samples a
  contiguous block of the prompts with the seeds one process would use, and process 0 writes
  every record, in prompt order, after gathering them.

This is ARCHITECTURE.md's ``jobs/sample``: like ``jobs/sft.py`` and ``jobs/rl.py`` it
composes datasets, checkpoints and the sampler; nothing in ``inference/`` imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config, DataConfig, ModelConfig
from meshrl.datasets import sources
from meshrl.datasets.pipeline import encode_prompt, prompt_text
from meshrl.datasets.sources import DatasetError
from meshrl.inference.requests import buckets_up_to
from meshrl.inference.sampler import Request, Sampler
from meshrl.inference.weights import WeightMismatchError, published_versions, weights_dir
from meshrl.mesh import Rules, create_mesh, rules_for
from meshrl.mesh.placement import process_sampler_mesh
from meshrl.models import (
    Decoder,
    abstract_model,
    build_model,
    param_shardings,
    resolve_model_config,
    split_model,
)
from meshrl.models.tokenizer import Tokenizer, tokenizer_for
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.utils import multihost, paths
from meshrl.utils.log import get_logger, set_process_index

log = get_logger("inference")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the weights come from: ``model`` builds the tokenizer (hf_path, tokenizer fields),
    ``arch`` is the architecture of the params, ``step`` the run's checkpoint step (or None)."""

    model: ModelConfig
    arch: ModelConfig
    step: int | None = None
    version: int = 0


def read_prompts(data: DataConfig) -> list[dict]:
    """Example dicts (``prompt``, ``origin``, optionally ``messages``, the row's other fields):
    the data.path file (answer field optional) or the synthetic task's training examples."""
    if data.source in sources.SYNTHETIC:
        return sources.load_train(data, {})
    return sources.read_file(data.path, data, {}, "data.path", require_answer=False)


def prompt_limit(config: Config) -> int:
    """The longest prompt the job samples for: data.max_prompt_len, capped by the sampler's
    largest prompt bucket (as ``Sampler`` resolves an empty ``sampler.prompt_buckets``)."""
    s = config.sampler
    buckets = tuple(s.prompt_buckets) or buckets_up_to(s.max_len - 1, 16)
    return min(config.data.max_prompt_len, buckets[-1])


def encode_prompts(examples: list[dict], tokenizer: Tokenizer, data: DataConfig, limit: int
                   ) -> tuple[list[tuple[dict, str, list[int]]], int]:
    """([(example, prompt text, prompt ids)], dropped): rendered exactly as the RL pipeline does;
    prompts over ``limit`` tokens are dropped (counted) or raise (``data.on_overlong``)."""
    kept, dropped = [], 0
    for ex in examples:
        text = prompt_text(ex, tokenizer)
        ids = encode_prompt(text, tokenizer)
        if 1 <= len(ids) <= limit:
            kept.append((ex, text, ids))
        elif data.on_overlong == "raise":
            raise DatasetError(f"{ex.get('origin', '?')}: prompt of {len(ids)} tokens > {limit}: "
                               f"shorten it, or raise data.max_prompt_len and the largest "
                               f"sampler.prompt_buckets (data.on_overlong = 'raise')")
        else:
            dropped += 1
    if not kept:
        what = (f"data.source = {data.source!r}" if data.source in sources.SYNTHETIC
                else f"data.path = {data.path!r}")
        raise DatasetError(f"{what}: none of its {len(examples)} prompts is 1..{limit} tokens "
                           f"long: raise data.max_prompt_len and the largest "
                           f"sampler.prompt_buckets, or shorten the prompts")
    return kept, dropped


def _hf_arch(model: ModelConfig) -> ModelConfig:
    """The architecture of ``model``: ``model.hf_path``'s config.json when set, else model.*."""
    if not model.hf_path:
        return model
    if not os.path.isfile(os.path.join(model.hf_path, "config.json")):
        raise ConfigError(f"model.hf_path = {model.hf_path!r}: no config.json there: point it at "
                          f"a local Hugging Face checkpoint directory")
    return resolve_model_config(model)  # as every job builds it (models/build.py)


def _run_model(reader: CheckpointReader, step: int) -> ModelConfig:
    """The model section of the config the run saved with ``step``."""
    where = f"{reader.directory / str(step)}"
    try:
        return ModelConfig.from_mapping(reader.config(step)["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise ConfigError(f"{where}: its saved config has no usable model section ({e}): was it "
                          f"written by meshrl? pass that run's workdir as --workdir") from None


def resolve_source(config: Config, workdir: paths.PathLike) -> Source:
    """Check that ``sample.source`` exists and find its model config; loads no weights."""
    source, model = config.sample.source, config.model
    # The config already holds model.hf_path set exactly for source hf_path (cross_section.py).
    if source == "hf_path":
        return Source(model, _hf_arch(model))
    if source == "random":
        return Source(model, model)
    reader = CheckpointReader(paths.as_path(workdir) / "checkpoints")
    try:
        step = reader.latest_step()
        if source == "checkpoint":
            if step is None:
                raise ConfigError(f"sample.source = 'checkpoint': no verified checkpoint under "
                                  f"{reader.directory}: pass the run's workdir as --workdir, or "
                                  f"pick another sample.source")
            run_model = _run_model(reader, step)
            return Source(run_model, _hf_arch(run_model), step=step)
        versions = published_versions(workdir)
        version = config.sample.version
        if not versions:
            raise ConfigError(f"sample.source = 'version': no published weights under "
                              f"{weights_dir(workdir, 0).parent}: pass the run's workdir as "
                              f"--workdir, or pick another sample.source")
        if version == -1:
            version = versions[-1]
        elif version not in versions:
            raise ConfigError(f"sample.version = {version}: not published under "
                              f"{weights_dir(workdir, version).parent} (published: "
                              f"{versions}): pick one of them, or -1 for the newest")
        run_model = model if step is None else _run_model(reader, step)
        return Source(run_model, _hf_arch(run_model), step=step, version=version)
    finally:
        reader.close()


def abstract_params(arch: ModelConfig, mesh: Mesh, rules: Rules) -> Any:
    """The param state of ``arch`` as ``ShapeDtypeStruct`` leaves on ``mesh`` (``rules``)."""
    abstract = split_model(abstract_model(arch, mesh=mesh, rules=rules))[1]
    # One sharding per param Variable, spread over the Variable's value.
    return jax.tree.map(lambda sh, var: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), var),
        param_shardings(abstract, mesh, rules), abstract)


def build_sampler(config: Config, workdir: paths.PathLike, src: Source, mesh: Mesh
                  ) -> Sampler:
    """The sampler holding ``src``'s weights at their weight version."""
    rules = rules_for("sample")
    s = config.sample
    if s.source == "version":
        sampler = Sampler(src.arch, config.sampler, mesh, workdir=str(workdir), rules=rules)
        try:
            sampler.load_weights(src.version)
        except WeightMismatchError as e:
            whose = "this config" if src.step is None else "the run's checkpoint config"
            raise ConfigError(f"sample.version = {src.version}: the weights at "
                              f"{weights_dir(workdir, src.version)} do not fit the model of "
                              f"{whose} ({e}): pass the config the run was trained with") from None
        log.info("sampling from weight version %d of %s", src.version, workdir)
        return sampler
    if s.source == "checkpoint":
        assert src.step is not None
        reader = CheckpointReader(paths.as_path(workdir) / "checkpoints")
        try:
            params, version = reader.params(src.step, abstract_params(src.arch, mesh, rules))
        finally:
            reader.close()
        log.info("sampling from checkpoint step %d (weight version %d) of %s", src.step,
                 version, workdir)
        return Sampler(src.arch, config.sampler, mesh, params, version=version, rules=rules)
    model = source_model(config, src, mesh, rules)
    if s.source == "hf_path":
        log.info("sampling from model.hf_path %s (weight version %d)", src.model.hf_path,
                 src.version)
    return Sampler(src.arch, config.sampler, mesh, split_model(model)[1], rules=rules)


def source_model(config: Config, src: Source, mesh: Mesh, rules: Rules) -> Decoder:
    """The model of ``sample.source`` hf_path or random, built as every job builds it."""
    if config.sample.source == "random":
        log.info("sampling from a random %d-layer model (sample.source = 'random', weight "
                 "version 0)", src.arch.num_layers)
    return build_model(src.model, mesh=mesh, rules=rules, seed=config.trainer.seed)


def _process_share(n: int) -> range:
    """This process's contiguous block of ``n`` prompts (the first ``n % count`` processes take
    one more), so the processes' records concatenate in prompt order."""
    count, index = jax.process_count(), jax.process_index()
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def _sampling_mesh(config: Config) -> Mesh:
    """``mesh.*`` over every device on one process; with several, this process's devices alone
    (each samples its share of the prompts without collectives, as in the RL job)."""
    mesh = create_mesh(config.mesh)
    return mesh if jax.process_count() == 1 else process_sampler_mesh(mesh)


def _record(ex: dict[str, Any], text: str, ids: list[int], out: Any, tokenizer: Tokenizer
            ) -> dict[str, Any]:
    record = {k: v for k, v in ex.items() if _jsonable(v)}
    record.update(prompt_text=text, prompt_ids=ids, completion=tokenizer.decode(out.tokens),
                  tokens=out.tokens, logprobs=out.logprobs, raw_logprobs=out.raw_logprobs,
                  versions=out.versions, finish_reason=out.finish_reason)
    return record


def run(config: Config, workdir: str) -> None:
    set_process_index(jax.process_index())
    # Every check that needs no weights first: a bad source, tokenizer or prompt file fails fast.
    src = resolve_source(config, workdir)
    tokenizer = tokenizer_for(src.model, src.arch.vocab_size)
    limit = prompt_limit(config)
    rows, dropped = encode_prompts(read_prompts(config.data), tokenizer, config.data, limit)
    if dropped:
        log.warning("dropped %d prompts longer than %d tokens (data.on_overlong = drop)",
                    dropped, limit)
    sampler = build_sampler(config, workdir, src, _sampling_mesh(config))
    share = _process_share(len(rows))
    # Chosen before the gather, so every process names the file process 0 writes after it.
    path = output_path(workdir, config.sample.overwrite)

    t0 = time.perf_counter()
    # Seeds follow the prompt's index in the whole file: any process count draws the same.
    outs = sampler.generate([Request(rows[i][2], seed=config.trainer.seed + i,
                                     stop_ids=(tokenizer.eos_id,)) for i in share])
    dt = time.perf_counter() - t0
    parts = multihost.allgather_json(
        {"records": [_record(*rows[i], out, tokenizer) for i, out in zip(share, outs)],
         "seconds": dt})
    records = [r for part in parts for r in part["records"]]
    dt = max(part["seconds"] for part in parts)  # the processes sample side by side
    if jax.process_index() == 0:
        paths.write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
    n_tokens = sum(len(r["tokens"]) for r in records)
    log.info("wrote %d samples (%d tokens, %.1f tok/s, %d prompts dropped) to %s", len(records),
             n_tokens, n_tokens / max(dt, 1e-9), dropped, path)


def output_path(workdir: paths.PathLike, overwrite: bool) -> Any:
    """``<workdir>/samples.jsonl``, or with ``overwrite`` False and that file present the first
    absent ``samples-<n>.jsonl``: an earlier sample is never lost to a rerun."""
    first = paths.as_path(workdir) / "samples.jsonl"
    n = 0
    path = first
    while not overwrite and path.exists():
        n += 1
        path = first.with_name(f"samples-{n}.jsonl")
    return path


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


__all__ = ["Source", "abstract_params", "build_sampler", "encode_prompts", "prompt_limit", "read_prompts",
           "resolve_source", "run", "source_model"]
