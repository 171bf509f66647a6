"""A finished RL run's published weight versions side by side: greedy completions of a few
held-out prompts per version, with rewards (``sample_versions``). The evaluation during the
run is ``workflows.evaluate``; the curves are ``trainer.curves``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples
from meshrl.inference.published import published_versions, weights_dir
from meshrl.inference.sampler import Request
from meshrl.jobs import weights_source
from meshrl.jobs.generate import make_sampler, resolve_source
from meshrl.mesh import create_mesh
from meshrl.rewards import RewardPool
from meshrl.utils import paths
from meshrl.utils.log import get_logger
from meshrl.workflows.episode import reward_fields
from meshrl.workflows.evaluate import check_versions
from meshrl.workflows.setup import prompt_room

log = get_logger("rl")


def sample_versions(config: Config, workdir: paths.PathLike,
                    versions: Sequence[int] | None = None, num_prompts: int = 4) -> list[dict]:
    """Greedy completions of the first ``num_prompts`` held-out prompts (``data.eval_*``, as the
    RL job's evaluation reads them) under each published weight version of the run in
    ``workdir`` (``versions``; None: all of them), scored by ``reward.*``: one record per version
    and prompt, versions ascending, with ``version``, ``prompt``, ``completion``, ``tokens``,
    ``reward`` and ``finish_reason``. Weights, model and tokenizer are loaded as the generate job
    loads ``generate.source = 'version'``; no held-out prompts gives no records. A version not
    published is a ``ConfigError`` listing the published ones."""
    published = published_versions(workdir)
    wanted = published if versions is None else sorted(set(versions))
    unknown = sorted(set(wanted) - set(published))
    if unknown:
        raise ConfigError(f"versions = {unknown}: not published under "
                          f"{weights_dir(workdir, 0).parent} (published: {published}): pick "
                          f"some of them, or None for all")
    # generate.version = -1 when nothing is published: resolve_source then names the problem.
    cfg = dataclasses.replace(config, generate=dataclasses.replace(
        config.generate, source="version", version=wanted[0] if wanted else -1))
    src = resolve_source(cfg, workdir)
    target = weights_source.skeleton(cfg, src, create_mesh(config.mesh), "sample")
    tokenizer = target.tokenizer
    examples = eval_examples(config.data, tokenizer,
                             prompt_room=prompt_room(config))[:num_prompts]
    if not examples:
        return []
    sampler = make_sampler(cfg, *weights_source.fill(cfg, workdir, src, target), workdir=workdir)
    requests = [Request(list(ex["prompt_ids"]), temperature=0.0, stop_ids=tokenizer.stop_ids,
                        seed=(config.trainer.seed * 1_000_003 + i) & 0x7FFFFFFF,
                        id=("versions", i))
                for i, ex in enumerate(examples)]
    fields: dict[str, list[Any]] = {}
    for ex in examples:
        for k, v in reward_fields(ex).items():
            fields.setdefault(k, []).extend(v)
    records = []
    with RewardPool.from_config(config.reward) as pool:
        for version in wanted:
            if version != sampler.version:
                sampler.load_weights(version)
            outs = sampler.generate(requests)
            check_versions(outs, version)
            completions = [tokenizer.decode(o.tokens) for o in outs]
            rewards = pool.score([ex["prompt"] for ex in examples], completions, **fields)
            records += [{"version": version, "prompt": ex["prompt"], "completion": text,
                         "tokens": list(o.tokens), "reward": float(r),
                         "finish_reason": o.finish_reason}
                        for ex, o, text, r in zip(examples, outs, completions, rewards)]
    return records


