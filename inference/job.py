"""The ``sample`` job: generate completions for prompts from a file (or a synthetic task).

  python main.py --config configs/sample.py --workdir /tmp/meshrl_sample
  python main.py --config configs/sample.py --workdir /tmp/s \\
      --config.model.hf_path=/path/to/hf_model --config.data.source=jsonl \\
      --config.data.path=prompts.jsonl --config.data.prompt_field=prompt

With ``model.hf_path`` empty the job builds a random model of ``config.model`` and the built-in
char tokenizer, so the config runs anywhere. Writes ``<workdir>/samples.jsonl``.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.inference.engine import Request, Sampler
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import create_model, split_model
from meshrl.models.tokenizer import load_tokenizer
from meshrl.utils.log import get_logger, set_process_index

log = get_logger("inference")


def read_prompts(config: Config) -> list[dict]:
    """Rows with a ``prompt`` string: the JSONL file, or the synthetic task's examples."""
    data = config.data
    if data.source == "jsonl":
        rows = []
        with open(data.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get(data.prompt_field), str):
                    raise ConfigError(f"data.path = {data.path!r}: line {lineno} has no string "
                                      f"field data.prompt_field = {data.prompt_field!r}")
                rows.append({**row, "prompt": row[data.prompt_field]})
        return rows
    if data.source == "parquet":
        raise ConfigError("data.source = 'parquet': the sample job reads JSONL prompt files")
    from meshrl.datasets import sources

    return sources.load_train(data, {})


def run(config: Config, workdir: str) -> None:
    set_process_index(jax.process_index())
    mesh = create_mesh(config.mesh)
    rules = rules_for("sample")
    model_cfg = config.model
    if model_cfg.hf_path:
        from meshrl.models.hf import load_hf_checkpoint

        model = load_hf_checkpoint(model_cfg.hf_path, mesh=mesh, rules=rules)
        model_cfg = model.cfg
        tok_spec = model_cfg.tokenizer
        if tok_spec == "char" and os.path.isfile(os.path.join(config.model.hf_path,
                                                               "tokenizer.json")):
            tok_spec = config.model.hf_path  # the checkpoint ships its own tokenizer
    else:
        log.info("model.hf_path is empty: sampling from a random %d-layer model",
                 model_cfg.num_layers)
        model = create_model(model_cfg, mesh=mesh, rules=rules, seed=config.trainer.seed)
        tok_spec = model_cfg.tokenizer
    tokenizer = load_tokenizer(tok_spec)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"model.vocab_size = {model_cfg.vocab_size}: smaller than the "
                          f"tokenizer's {tokenizer.vocab_size} ids ({tok_spec!r})")
    sampler = Sampler(model_cfg, config.sampler, mesh, split_model(model)[1])

    rows, dropped = [], 0
    limit = sampler.prompt_buckets[-1]
    for row in read_prompts(config):
        ids = tokenizer.encode(row["prompt"])
        if 1 <= len(ids) <= min(limit, config.data.max_prompt_len):
            rows.append((row, ids))
        elif config.data.on_overlong == "raise":
            raise ConfigError(f"prompt of {len(ids)} tokens ({row.get('origin', '?')}): longer "
                              f"than min(sampler.prompt_buckets[-1], data.max_prompt_len)")
        else:
            dropped += 1
    if dropped:
        log.warning("dropped %d prompts longer than %d tokens (data.on_overlong = drop)",
                    dropped, limit)

    t0 = time.perf_counter()
    outs = sampler.generate([Request(ids, seed=config.trainer.seed + i,
                                     stop_ids=(tokenizer.eos_id,))
                             for i, (_, ids) in enumerate(rows)])
    dt = time.perf_counter() - t0
    n_tokens = sum(len(o.tokens) for o in outs)
    path = pathlib.Path(workdir) / "samples.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for (row, _), out in zip(rows, outs):
            record = {k: v for k, v in row.items() if _jsonable(v)}
            record.update(completion=tokenizer.decode(out.tokens), tokens=out.tokens,
                          logprobs=out.logprobs, raw_logprobs=out.raw_logprobs,
                          versions=out.versions, finish_reason=out.finish_reason)
            f.write(json.dumps(record) + "\n")
    log.info("wrote %d samples (%d tokens, %.1f tok/s, %d prompts dropped) to %s", len(outs),
             n_tokens, n_tokens / max(dt, 1e-9), dropped, path)


def _jsonable(v: object) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


__all__ = ["read_prompts", "run"]
