"""Shared fixtures of the trainer tests: a tiny config, a deterministic checkpointable data
iterator and a real (tiny) meshrl decoder placed on a given mesh."""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np

from meshrl.configs.loader import base_config, from_config_dict
from meshrl.configs.schema import Config
from meshrl.mesh import create_mesh, rules_for
from meshrl.trainer.engine import Trainee

VOCAB = 64


def tiny_config(**overrides: Any) -> Config:
    """vocab 64, hidden 32, 2 layers; overrides as ``{"trainer.steps": 6}``-style keys."""
    cfg = base_config("sft")
    cfg.mesh.data = 1  # one device unless a test asks for more: fastest compile
    cfg.model.vocab_size = VOCAB
    cfg.model.hidden_size = 32
    cfg.model.intermediate_size = 64
    cfg.model.num_layers = 2
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 4
    cfg.trainer.batch_size = 8
    cfg.trainer.seq_len = 16
    cfg.trainer.steps = 6
    cfg.trainer.learning_rate = 1e-2
    cfg.trainer.log_every = 1
    cfg.trainer.peak_flops = 1e11  # fixed: tests must not time a matmul
    cfg.optimizer.warmup_steps = 2
    cfg.optimizer.weight_decay = 0.1
    cfg.checkpoint.every_steps = 3
    cfg.checkpoint.async_save = True
    cfg.logging.progress_bar = False
    return _with_overrides(cfg, overrides)


def tiny_rl_config(**overrides: Any) -> Config:
    """A tiny RL job: 2 steps, 3 groups of 2 samples, 4 new tokens, no warm start."""
    cfg = base_config("rl")
    cfg.model.vocab_size = 256  # the char tokenizer's byte vocabulary
    cfg.model.hidden_size = 32
    cfg.model.intermediate_size = 64
    cfg.model.num_layers = 1
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 2
    cfg.data.max_prompt_len = 16
    cfg.data.num_examples = 50
    cfg.data.eval_examples = 2
    cfg.trainer.steps = 2
    cfg.trainer.seq_len = 32
    cfg.trainer.learning_rate = 1e-3
    cfg.trainer.log_every = 1
    cfg.trainer.peak_flops = 1e11
    cfg.sampler.max_len = 32
    cfg.sampler.max_new_tokens = 4
    cfg.sampler.prompt_buckets = (16,)
    cfg.sampler.slots = 8
    cfg.sampler.decode_chunk = 4
    cfg.rollout.group_size = 2
    cfg.rollout.prompts_per_step = 3
    cfg.rollout.max_staleness = 1
    cfg.rollout.filter_equal_groups = False  # an untrained policy: keep every group
    cfg.reward.num_workers = 1
    cfg.rl.warm_start_steps = 0
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.async_save = False
    cfg.logging.tensorboard = False
    cfg.logging.progress_bar = False
    return _with_overrides(cfg, overrides)


def _with_overrides(cfg: Any, overrides: dict[str, Any]) -> Config:
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return from_config_dict(cfg)


class RandomIterator:
    """Packed random-token batches, a pure function of (seed, index): checkpointable exactly.

    Each row holds two segments; the loss mask covers the second half of each segment (a
    "response"). ``nan_at`` puts a NaN into the loss mask of that batch index (0-based).
    """

    def __init__(self, batch_size: int, seq_len: int, seed: int = 0, nan_at: int = -1) -> None:
        self.batch_size, self.seq_len, self.seed, self.nan_at = batch_size, seq_len, seed, nan_at
        self.index = 0

    def batch(self, index: int) -> dict[str, np.ndarray]:
        B, L = self.batch_size, self.seq_len
        rng = np.random.default_rng([self.seed, index])
        ids_BxL = rng.integers(3, VOCAB, (B, L + 1), dtype=np.int32)
        half = L // 2
        seg_BxL = np.where(np.arange(L) < half, 1, 2).astype(np.int32) * np.ones((B, 1), np.int32)
        pos_BxL = (np.arange(L) % half).astype(np.int32) * np.ones((B, 1), np.int32)
        mask_BxL = (pos_BxL >= half // 2).astype(np.float32)
        if index == self.nan_at:
            mask_BxL[0, -1] = np.nan
        return {"input_ids": ids_BxL[:, :-1], "targets": ids_BxL[:, 1:], "loss_mask": mask_BxL,
                "positions": pos_BxL, "segment_ids": seg_BxL}

    def __iter__(self) -> RandomIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.index)
        self.index += 1
        return out

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index, "seed": self.seed}

    def set_state(self, state: dict[str, Any]) -> None:
        assert state["seed"] == self.seed, state
        self.index = int(state["index"])


def make_trainee(config: Config, mesh: jax.sharding.Mesh) -> Trainee:
    """The jobs' trainee: the decoder's hidden states + head (chunked float32 logits)."""
    from meshrl.models import create_model, flops_per_token, param_shardings, split_model
    from meshrl.trainer.step import decoder_forward

    rules = rules_for("train", config.mesh.fsdp)
    model = create_model(config.model, mesh=mesh, rules=rules, seed=config.trainer.seed)
    graphdef, params = split_model(model)
    return Trainee(forward=decoder_forward(graphdef, config.trainer.logits_chunk), params=params,
                   params_shardings=param_shardings(params, mesh, rules),
                   flops_per_token=flops_per_token(config.model, config.trainer.seq_len))


def mesh_for(config: Config, devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The config's mesh over its first ``prod(axis sizes)`` devices (all of them with a -1)."""
    if devices is None:
        sizes = config.mesh.ici_shape + config.mesh.dcn_shape
        n = -1 if -1 in sizes else int(np.prod(sizes))
        devices = jax.devices() if n == -1 else jax.devices()[:n]
    return create_mesh(config.mesh, devices)


def make_loop(config: Config, workdir: Any, data: Any = None) -> Any:
    """A started SFT ``TrainEngine`` on all devices of ``config.mesh`` with the tiny model and
    random data: ``run_sft(make_loop(...))`` trains (resuming from ``workdir``)."""
    from meshrl.trainer.engine import TrainEngine
    from meshrl.trainer.spec import sft_spec

    mesh = mesh_for(config)
    data = data if data is not None else RandomIterator(config.trainer.batch_size,
                                                        config.trainer.seq_len)
    engine = TrainEngine(config, workdir, mesh, make_trainee(config, mesh), sft_spec(config, mesh))
    try:
        engine.start(data=data)
    except BaseException:
        engine.close()
        raise
    return engine


def run_rl(config: Config, workdir: Any, timeout_s: float = 300.0) -> tuple[Any, dict]:
    """Build the RL job in this process, run it to the end and close it: (the loop, with its
    ``history``; the summary ``arun`` returned)."""
    from meshrl.jobs import rl as rl_job

    trainer = rl_job.build(config, workdir)
    try:
        summary = asyncio.run(asyncio.wait_for(trainer.arun(), timeout=timeout_s))
    finally:
        trainer.close()
    return trainer, summary
