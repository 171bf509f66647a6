"""The SFT job: ``python main.py --config configs/sft_synthetic.py --workdir W``.

Wires the tokenizer, data iterator, mesh and model into the SFT loop (``trainer.sft_loop``,
resuming from the newest good checkpoint), evaluates teacher-forced held-out token accuracy and
exact match, and writes ``<workdir>/summary.json``.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples, make_sft_iterator
from meshrl.mesh import create_mesh
from meshrl.models import load, param_count
from meshrl.models.load import with_weights
from meshrl.trainer.engine import Trainee, TrainEngine
from meshrl.trainer.report import sft_summary_table
from meshrl.trainer.sft_eval import eval_batches, make_evaluator
from meshrl.trainer.sft_loop import train_and_evaluate
from meshrl.trainer.spec import sft_spec
from meshrl.trainer.summary import write_summary
from meshrl.utils import log

_log = log.get_logger("trainer.sft")


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Train, evaluate, write ``summary.json``; returns the summary. Distributed start-up is
    ``jobs.dispatch``'s."""
    mesh = create_mesh(config.mesh)
    tcfg = config.trainer
    # The tokenizer and the data first: a bad one fails before any weights are read.
    skeleton = load(config, mesh, "train", abstract=True)
    tokenizer = skeleton.tokenizer
    data = make_sft_iterator(config.data, tokenizer, batch_size=tcfg.batch_size,
                             seq_len=tcfg.seq_len, seed=tcfg.seed,
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), pack=config.data.pack)
    trainee = Trainee.of(with_weights(skeleton, tcfg.seed), config)
    n_params = param_count(skeleton.arch)
    _log.info("SFT: %.2fM params, mesh %s, %d steps of %d x %d tokens", n_params / 1e6,
              dict(mesh.shape), tcfg.steps, tcfg.batch_size, tcfg.seq_len)
    held_out = eval_batches(eval_examples(config.data, tokenizer, teacher_forced=True),
                            tcfg.seq_len, tcfg.batch_size, tokenizer.pad_id)
    evaluate = make_evaluator(trainee.forward, held_out, mesh, config.mesh.fsdp)
    engine = TrainEngine(config, workdir, mesh, trainee, sft_spec(config, mesh))
    t0 = time.perf_counter()
    try:
        engine.start(data=data)
        summary, _, _ = train_and_evaluate(engine, evaluate, n_params, t0)
    finally:
        engine.close()
    write_summary(summary, workdir, sft_summary_table(summary, workdir))
    return summary
