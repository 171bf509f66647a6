"""The ``generate`` job: completions for prompts, with the weights, tokenizer and prompt rendering
of training.

  python main.py --config configs/generate.py --workdir /tmp/meshrl_sample
  python main.py --config configs/generate.py --workdir /tmp/s --config.generate.source=hf_path \\
      --config.model.hf_path=/path/to/hf_model --config.data.source=jsonl \\
      --config.data.path=prompts.jsonl --config.data.prompt_field=prompt
  python main.py --config configs/default.py --workdir RUN --config.job=generate \\
      --config.generate.source=checkpoint    # or =version (--config.generate.version=V, -1 newest)

Contract:
* Weights (``generate.source``): ``model.hf_path``; a random init of ``model.*``; the params of the
  newest verified checkpoint of the run in ``--workdir`` (model and tokenizer from the config
  saved with it); or its published version ``<workdir>/weights/<V>``, resolved and loaded by
  ``jobs.weights_source`` as the export job's. A missing source is a ``ConfigError`` naming it.
  Tokens carry the weight version (checkpoint: the state's).
* Tokenizer: the model's (``models.load``, as in the RL job), read before any weights; a missing
  tokenizer is an error, never a fallback.
* Prompts: ``data.*`` rows (JSONL/Parquet, the answer field optional; or the synthetic task),
  rendered by the pipeline's ``prompt_text`` + ``encode_prompt`` (chat template when the
  tokenizer has one, BOS): the ids of the RL prompt iterator for the same row. Prompts over
  min(data.max_prompt_len, the largest prompt bucket; with ``agent.env`` the episode's room for
  a completion too) follow ``data.on_overlong``; none left is a ``DatasetError``.
* Output: ``<workdir>/samples.jsonl``; when one exists it is kept and the samples go to the first
  free ``samples-<n>.jsonl``, unless ``generate.overwrite``. One record per prompt: its row's
  fields (one named like a key below as ``row.<name>``; dates as ISO text, bytes as UTF-8,
  other values JSON lacks as text), ``prompt_text``, ``prompt_ids``, ``completion``,
  ``tokens``, ``logprobs``, ``raw_logprobs``, ``versions``, ``finish_reason``.
* Several processes: each loads the weights onto a sampler mesh over its own devices
  (``mesh.tensor``/``expert``/``expert_tensor`` kept, ``data`` filling them), samples a
  contiguous block of the prompts with the seeds one process would use, and process 0 writes
  every record, in prompt order, after gathering them.

This is ARCHITECTURE.md's ``jobs/sample``, named ``generate`` so that the job and the
``sampler.*`` settings cannot be confused. Like ``jobs/sft.py`` and ``jobs/rl.py`` it
composes datasets, checkpoints and the sampler; nothing in ``inference/`` imports it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
from jax.sharding import Mesh

from meshrl.configs.schema import Config
from meshrl.datasets.prompts import encode_prompts, read_prompts
from meshrl.inference.sampler import Request, Sampler
from meshrl.inference.shapes import prompt_buckets
from meshrl.jobs import rl_agent, weights_source
from meshrl.mesh import create_mesh
from meshrl.mesh.placement import process_sampler_mesh
from meshrl.models.load import LoadedModel
from meshrl.models.tokenizer import Tokenizer
from meshrl.utils import multihost, paths
from meshrl.utils.log import get_logger
from meshrl.workflows.agent_setup import EPISODES_FILE
from meshrl.workflows.setup import prompt_room

log = get_logger("inference")


def prompt_limit(config: Config) -> int:
    """The longest prompt the job samples for: data.max_prompt_len, capped by the sampler's
    largest prompt bucket (as ``Sampler`` resolves an empty ``sampler.prompt_buckets``) and,
    for agent episodes, by their room for a completion (``workflows.setup.prompt_room``)."""
    limit = min(config.data.max_prompt_len, prompt_buckets(config.sampler)[-1])
    return min(limit, prompt_room(config)) if config.agent.env else limit


def resolve_source(config: Config, workdir: paths.PathLike) -> weights_source.WeightSource:
    """``generate.source`` (and ``generate.version``) checked to exist; loads no weights."""
    kind = config.generate.source
    words = weights_source.Wording(source=f"generate.source = {kind!r}", step="",
                                   version="generate.version",
                                   instead="pick another generate.source")
    return weights_source.resolve(config, workdir, kind, words, version=config.generate.version)


def make_sampler(config: Config, loaded: LoadedModel, version: int,
                 workdir: paths.PathLike | None = None) -> Sampler:
    """The sampler holding ``loaded``'s weights (sample role) at weight ``version``; with
    ``workdir`` it can also ``load_weights`` the run's other published versions."""
    return Sampler(loaded.arch, config.sampler, loaded.mesh, loaded.params, version=version,
                   rules=loaded.rules, workdir=None if workdir is None else str(workdir))


def _sampling_mesh(config: Config) -> Mesh:
    """``mesh.*`` over every device on one process; with several, this process's devices alone
    (each samples its share of the prompts without collectives, as in the RL job)."""
    mesh = create_mesh(config.mesh)
    return mesh if jax.process_count() == 1 else process_sampler_mesh(mesh)


def _record(ex: dict[str, Any], text: str, ids: list[int], out: Any, tokenizer: Tokenizer
            ) -> dict[str, Any]:
    made = dict(prompt_text=text, prompt_ids=ids, completion=tokenizer.decode(out.tokens),
                tokens=out.tokens, logprobs=out.logprobs, raw_logprobs=out.raw_logprobs,
                versions=out.versions, finish_reason=out.finish_reason)
    # The row's fields stay, a name the job writes too as ``row.<name>`` (a reference
    # completion, or an earlier samples.jsonl read back as prompts).
    record = {(f"row.{k}" if k in made else k): _jsonable(v) for k, v in ex.items()
              if not k.startswith("_")}  # the pipeline's own keys (``_answer_message``)
    record.update(made)
    return record


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: dates as ISO text, bytes as UTF-8 text, the rest that
    JSON cannot encode as ``str`` (Parquet's decimals)."""
    if paths.is_jsonable(value):
        return value
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def run(config: Config, workdir: str) -> None:
    # Every check that needs no weights first: a bad source, tokenizer or prompt file fails fast.
    src = resolve_source(config, workdir)
    target = weights_source.skeleton(config, src, _sampling_mesh(config), "sample")
    tokenizer = target.tokenizer
    limit = prompt_limit(config)
    rows, dropped = encode_prompts(read_prompts(config.data), tokenizer, config.data, limit)
    if dropped:
        log.warning("dropped %d prompts longer than %d tokens (data.on_overlong = drop)",
                    dropped, limit)
    loaded, version = weights_source.fill(config, workdir, src, target)
    log.info("sampling from %s", src.describe(workdir, version))
    sampler = make_sampler(config, loaded, version)
    share = multihost.process_block(len(rows))
    # Chosen before the gather, so every process names the file process 0 writes after it.
    name = EPISODES_FILE if config.agent.env else "samples.jsonl"
    path = paths.first_free(paths.as_path(workdir) / name, config.generate.overwrite)

    if config.agent.env:  # agent episodes instead of single completions
        mine = rl_agent.generate_episodes(config, sampler, [rows[i] for i in share],
                                          share.start, tokenizer, workdir)
        episodes = [r for part in multihost.allgather_json(mine) for r in part]
        if jax.process_index() == 0:
            paths.write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in episodes))
        log.info("wrote %d agent episodes (%d tool calls) to %s", len(episodes),
                 sum(len(r["tool_calls"]) for r in episodes), path)
        return
    t0 = time.perf_counter()
    # Seeds follow the prompt's index in the whole file: any process count draws the same.
    outs = sampler.generate([Request(rows[i][2], seed=(config.trainer.seed + i) & 0x7FFFFFFF,
                                     stop_ids=tokenizer.stop_ids) for i in share])
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


__all__ = ["encode_prompts", "make_sampler", "prompt_limit", "read_prompts",
           "resolve_source", "run"]
