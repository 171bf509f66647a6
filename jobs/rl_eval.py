"""Held-out evaluation of an RL run with the sampler, and the run's curves.

``aevaluate`` generates on held-out prompts through the same async engine the rollouts use:
greedy accuracy (temperature 0, one completion per prompt) and, when ``n > 1``, pass@1 and
pass@k from ``n`` sampled completions per prompt (the unbiased estimator of Chen et al. 2021).
A completion is correct when the verifier, the first reward of ``reward.names``, scores it
> 0.5. Every generated token must come from the version being evaluated: a mismatch is an error,
never a silently mixed number. ``sample_versions`` shows a finished run's published weight
versions side by side: greedy completions of a few held-out prompts per version, with rewards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples
from meshrl.inference.sampler import Completion, Request
from meshrl.inference.weights import published_versions, weights_dir
from meshrl.jobs.sample import build_sampler, resolve_source
from meshrl.mesh import create_mesh
from meshrl.models.tokenizer import tokenizer_for
from meshrl.rewards import RewardPool
from meshrl.utils import paths
from meshrl.utils.log import get_logger
from meshrl.workflows.episode import reward_fields

log = get_logger("rl")


class EvalVersionError(RuntimeError):
    """An evaluation completion carries tokens of a weight version other than the one evaluated."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _check_versions(outs: Sequence[Completion], version: int) -> None:
    bad = sorted({v for o in outs for v in o.versions if v != version})
    if bad:
        raise EvalVersionError(f"evaluation of version {version} got tokens of versions {bad}; "
                               f"weights changed during evaluation")


async def _correct(reward_pool: Any, examples: Sequence[dict], outs: Sequence[Completion],
                   decode: Any, per_example: int) -> np.ndarray:
    """Boolean ``[len(examples), per_example]``: verifier score > 0.5."""
    items = [ex for ex in examples for _ in range(per_example)]
    fields: dict[str, list[Any]] = {}
    for ex in items:
        for k, v in reward_fields(ex).items():
            fields.setdefault(k, []).extend(v)
    completions = [decode(o.tokens) for o in outs]
    prompts = [ex["prompt"] for ex in items]
    comps = await asyncio.to_thread(reward_pool.score_components, prompts, completions, **fields)
    verifier = comps[reward_pool.names[0]]
    return (np.asarray(verifier, np.float64) > 0.5).reshape(len(examples), per_example)


async def aevaluate(engine: Any, reward_pool: Any, examples: Sequence[dict], *, version: int,
                    decode: Any, eos_id: int, max_new_tokens: int, n: int = 1,
                    temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Greedy accuracy (and pass@1 / pass@n from ``n`` samples when ``n > 1``) on ``examples``
    at the engine's current weights, which must be ``version`` throughout."""
    if not examples:
        return {}
    if engine.version != version:
        raise EvalVersionError(f"engine holds version {engine.version}, evaluating {version}")

    def request(ex: dict, i: int, temp: float) -> Request:
        return Request(list(ex["prompt_ids"]), max_new_tokens=max_new_tokens, temperature=temp,
                       stop_ids=(eos_id,), seed=seed * 1_000_003 + i, id=("eval", i))

    greedy = await asyncio.gather(*(engine.agenerate(request(ex, i, 0.0))
                                    for i, ex in enumerate(examples)))
    _check_versions(greedy, version)
    right = await _correct(reward_pool, examples, greedy, decode, 1)
    out = {"eval/greedy_accuracy": float(right.mean()), "eval/examples": float(len(examples)),
           "eval/completion_len": float(np.mean([len(o.tokens) for o in greedy]))}
    if n > 1:
        sampled = await asyncio.gather(*(
            engine.agenerate(request(ex, i * n + j, temperature))
            for i, ex in enumerate(examples) for j in range(n)))
        _check_versions(sampled, version)
        c = await _correct(reward_pool, examples, sampled, decode, n)
        counts = c.sum(-1)
        out["eval/pass_at_1"] = float(np.mean([pass_at_k(n, int(x), 1) for x in counts]))
        out[f"eval/pass_at_{n}"] = float(np.mean([pass_at_k(n, int(x), n) for x in counts]))
    return out


def sample_versions(config: Config, workdir: paths.PathLike,
                    versions: Sequence[int] | None = None, num_prompts: int = 4) -> list[dict]:
    """Greedy completions of the first ``num_prompts`` held-out prompts (``data.eval_*``, as the
    RL job's evaluation reads them) under each published weight version of the run in
    ``workdir`` (``versions``; None: all of them), scored by ``reward.*``: one record per version
    and prompt, versions ascending, with ``version``, ``prompt``, ``completion``, ``tokens``,
    ``reward`` and ``finish_reason``. Weights, model and tokenizer are loaded as the sample job
    loads ``sample.source = 'version'``; no held-out prompts gives no records. A version not
    published is a ``ConfigError`` listing the published ones."""
    published = published_versions(workdir)
    wanted = published if versions is None else sorted(set(versions))
    unknown = sorted(set(wanted) - set(published))
    if unknown:
        raise ConfigError(f"versions = {unknown}: not published under "
                          f"{weights_dir(workdir, 0).parent} (published: {published}): pick "
                          f"some of them, or None for all")
    # sample.version = -1 when nothing is published: resolve_source then names the problem.
    cfg = dataclasses.replace(config, sample=dataclasses.replace(
        config.sample, source="version", version=wanted[0] if wanted else -1))
    src = resolve_source(cfg, workdir)
    tokenizer = tokenizer_for(src.model, src.arch.vocab_size)
    examples = eval_examples(config.data, tokenizer)[:num_prompts]
    if not examples:
        return []
    sampler = build_sampler(cfg, workdir, src, create_mesh(config.mesh))
    requests = [Request(list(ex["prompt_ids"]), temperature=0.0, stop_ids=(tokenizer.eos_id,),
                        seed=config.trainer.seed * 1_000_003 + i, id=("versions", i))
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
            _check_versions(outs, version)
            completions = [tokenizer.decode(o.tokens) for o in outs]
            rewards = pool.score([ex["prompt"] for ex in examples], completions, **fields)
            records += [{"version": version, "prompt": ex["prompt"], "completion": text,
                         "tokens": list(o.tokens), "reward": float(r),
                         "finish_reason": o.finish_reason}
                        for ex, o, text, r in zip(examples, outs, completions, rewards)]
    return records


def read_metrics(path: epath.Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` merged per step; a step re-run after a resume keeps its newest values."""
    by_step: dict[int, dict[str, float]] = {}
    if not path.exists():
        return by_step
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        by_step.setdefault(int(rec.pop("step")), {}).update(rec)
    return by_step


def plot_curves(metrics: dict[int, dict[str, float]], path: epath.Path) -> None:
    """PNG of the batch reward and the held-out greedy accuracy over RL steps."""
    from matplotlib.figure import Figure

    # A bare Figure, not pyplot: no backend switch or figure registry in the calling process
    # (a notebook that runs the job keeps its inline plots).
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for key, label, style in (("rollout/reward_mean", "batch reward (mean)", "-"),
                              ("eval/greedy_accuracy", "held-out greedy accuracy", "o-"),
                              ("eval/pass_at_1", "held-out pass@1", "s--")):
        pts = sorted((s, m[key]) for s, m in metrics.items() if key in m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xlabel("RL step (weight version)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title("meshrl: asynchronous GRPO")
    fig.tight_layout()
    buf = io.BytesIO()  # savefig writes local files only; the workdir may be gs://
    fig.savefig(buf, format="png", dpi=100)
    path.write_bytes(buf.getvalue())
