"""The loop: non-finite raise path, metric sinks, the state the engine shows, the SFT job end to
end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from meshrl.algorithms.batch import TrainBatch
from meshrl.tests.trainer.tiny import RandomIterator, make_loop, tiny_config
from meshrl.tests.trees import unchanged_leaves
from meshrl.tests.xla import cpu_env
from meshrl.trainer.engine import NonFiniteLossError, put_batch
from meshrl.trainer.sft_loop import run_sft

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_nonfinite_loss_raises_with_step_number_and_saves_nothing_after_it(tmp_path):
    config = tiny_config(**{"trainer.on_nonfinite": "raise", "checkpoint.every_steps": 1})
    loop = make_loop(config, tmp_path, RandomIterator(8, 16, nan_at=2))
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 3"):
        run_sft(loop)
    loop.close()
    # Steps 1 and 2 were checkpointed; the poisoned step 3 never was.
    assert sorted(loop.checkpointer.all_steps()) == [1, 2]


def _sft_rows(tmp_path, **overrides):
    """Run a tiny SFT loop saving only at the end; its engine, history and metrics rows."""
    config = tiny_config(**{"checkpoint.every_steps": 0, "checkpoint.async_save": False,
                            **overrides})
    loop = make_loop(config, tmp_path)
    history = run_sft(loop)
    loop.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return loop, history, rows


def test_metrics_reach_tensorboard_and_jsonl_with_throughput_and_mfu(tmp_path):
    loop, history, rows = _sft_rows(tmp_path, **{"trainer.steps": 3})
    assert [r["step"] for r in rows] == [1, 2, 3] == [h["step"] for h in history]
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_s", "step_time_s",
                "model_flops_per_s", "mfu", "token_accuracy", "skipped"):
        assert key in rows[-1], key
    assert rows[-1]["mfu"] > 0 and rows[0]["learning_rate"] == 0.0  # warmup starts at 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert loop.checkpointer.all_steps() == [3]  # every_steps = 0: only the final save


def test_metrics_are_written_at_the_first_step_then_every_log_every_and_the_last(tmp_path):
    _, history, rows = _sft_rows(tmp_path, **{"trainer.log_every": 4})
    assert [r["step"] for r in rows] == [1, 4, 6]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]  # every step is still read


def test_engine_state_and_params_after_a_step_are_the_trained_ones(tmp_path):
    config = tiny_config()
    loop = make_loop(config, tmp_path)
    before = jax.device_get(loop.state.params)
    data = RandomIterator(config.trainer.batch_size, config.trainer.seq_len)
    for step in (1, 2):  # the warm-up's first rate is 0: the second step moves the params
        loop.dispatch(step, put_batch(TrainBatch.from_mapping(data.batch(step)), loop.batch_sh))
    params = loop.params  # read first: built from the params' leaves alone
    state = loop.state
    assert int(state.step) == 2 and int(state.weight_version) == 2
    assert loop.state is state  # one view until the next step
    assert jax.tree.structure(params) == jax.tree.structure(state.params)
    assert all(a is b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params),
                                      strict=True))
    assert unchanged_leaves(jax.device_get(params), before) == []
    loop.close()


def test_engine_refuses_a_state_of_another_structure(tmp_path):
    loop = make_loop(tiny_config(), tmp_path)
    state = loop.state
    with pytest.raises(ValueError, match="does not fit this engine's step"):
        loop.state = state.replace(opt_state=())
    assert loop.state is state  # the refused state replaced nothing
    loop.close()


@pytest.mark.slow  # the SFT job's default-run end to end: tests/jobs/test_real_model_recipes.py
def test_sft_job_runs_end_to_end_from_main_and_writes_summary(tmp_path):
    env = cpu_env(2)
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
                          "--workdir", str(tmp_path), "--config.logging.progress_bar=false"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["devices"] == 2
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0 and 0 <= summary["eval_token_accuracy"] <= 1
    assert summary["eval_sequences"] > 0
    assert summary["data"]["examples"] > 0 and summary["data"]["dropped_overlong_sequence"] == 0
    assert (tmp_path / "checkpoints" / "6").is_dir()


def test_an_evaluation_step_is_timed_before_its_evaluation_runs(tmp_path):
    # The evaluation waits for the step's params; timed after it, that wait would leave the
    # step's own time (and so its tokens/s and MFU). So the step's metrics are read first.
    from meshrl.trainer.sft_loop import periodic_eval

    loop = make_loop(tiny_config(**{"trainer.steps": 6, "trainer.eval_every": 2,
                                    "checkpoint.every_steps": 0}), tmp_path)
    seen: list[int] = []

    def evaluate(params):
        seen.append(int(loop.history[-1]["step"]))
        return {}

    run_sft(loop, hooks=[periodic_eval(evaluate)])
    loop.close()

    assert seen == [2, 4]  # read before the hook: the history holds the step


def test_a_steps_evaluation_is_written_before_its_checkpoint_starts(tmp_path):
    # A kill after a durable checkpoint resumes past its step: that step's evaluation row must
    # already be in metrics.jsonl, or it is never written.
    from meshrl.trainer.sft_loop import periodic_eval

    loop = make_loop(tiny_config(**{"trainer.steps": 6, "trainer.eval_every": 3,
                                    "checkpoint.every_steps": 3,
                                    "checkpoint.async_save": False}), tmp_path)
    saved_at_eval: list[list[int]] = []

    def evaluate(params):
        saved_at_eval.append(loop.checkpointer.all_steps())
        return {"eval_loss": 1.0}

    try:
        run_sft(loop, hooks=[periodic_eval(evaluate)])
    finally:
        loop.close()

    assert saved_at_eval == [[]]  # step 3's checkpoint started after its evaluation
    assert loop.checkpointer.all_steps()[-2:] == [3, 6]


def test_a_stop_request_between_checkpoints_writes_the_stopped_steps_row_once(tmp_path):
    from meshrl.utils import interrupt

    config = tiny_config(**{"checkpoint.every_steps": 0, "trainer.steps": 4})

    def ctrl_c_at_2(step: int, engine) -> None:
        if step == 2:
            interrupt.request()  # what the first SIGINT does

    engine = make_loop(config, tmp_path)
    try:
        with pytest.raises(interrupt.Stopped):
            run_sft(engine, hooks=[ctrl_c_at_2])
    finally:
        engine.close()
        interrupt.clear()
    resumed = make_loop(config, tmp_path)
    try:
        run_sft(resumed)
    finally:
        resumed.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
