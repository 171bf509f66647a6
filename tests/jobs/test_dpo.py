"""The preference job end to end: the synthetic task's held-out preference accuracy rises, the
summary is written, every loss trains, and bad settings fail with one clear line."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from meshrl.algorithms.batch import PreferenceBatch
from meshrl.configs import dpo as dpo_config
from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import from_config_dict
from meshrl.datasets import DatasetError
from meshrl.jobs import dispatch
from meshrl.jobs import dpo as job
from meshrl.mesh import create_mesh
from meshrl.tests.xla import cpu_env
from meshrl.trainer.spec import dpo_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The job's mesh fills data with all 8 fake devices: 4 rows (2 pairs) per shard.
pytestmark = pytest.mark.distributed


def _config(**overrides):
    cfg = dpo_config.get_config()
    cfg.trainer.steps = 120
    cfg.trainer.eval_every = 0
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.async_save = False
    cfg.logging.progress_bar = False
    cfg.data.num_examples = 400
    cfg.data.eval_examples = 64
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(cfg[section], name, value)
    return from_config_dict(cfg)


def test_dpo_job_raises_held_out_preference_accuracy_and_writes_summary(tmp_path):
    summary = job.run(_config(), str(tmp_path))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["eval_preference_accuracy"] == summary["eval_preference_accuracy"]
    gain = summary["eval_preference_accuracy"] - summary["eval_preference_accuracy_before"]
    assert gain >= 0.15, summary
    assert summary["final_loss"] < summary["first_loss"] and summary["loss_name"] == "dpo"
    assert summary["eval_pairs"] == 64.0 and 0.0 <= summary["reward_accuracy"] <= 1.0


def test_dpo_with_lora_scores_its_reference_on_the_quantised_base_the_policy_trains_on(
        tmp_path):
    # At the first step the adapters are zero, so policy and reference agree exactly: loss
    # log 2, margin 0. A reference on the float params it was quantised from disagrees.
    # The held-out "before" is that quantised base too: with a step that changes nothing,
    # before and after agree (on the float params they would differ by the quantisation).
    summary = job.run(_config(**{"lora.rank": 4, "lora.base_dtype": "int8",
                                 "trainer.steps": 1, "data.eval_examples": 8,
                                 "trainer.learning_rate": 1e-12}), str(tmp_path))
    assert summary["first_loss"] == pytest.approx(math.log(2), rel=0, abs=1e-6), summary
    assert summary["reward_margin"] == pytest.approx(0.0, rel=0, abs=1e-7), summary
    assert summary["eval_logp_margin_before"] == pytest.approx(
        summary["eval_logp_margin"], rel=0, abs=1e-5), summary


# Slow: each loss's math is checked against numpy in tests/algorithms/test_preference.py and
# the DPO run above covers the job; these rerun the job per loss.
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_other_losses_train_and_report_reward_metrics(tmp_path, loss):
    summary = job.run(_config(**{"dpo.loss": loss, "trainer.steps": 3}), str(tmp_path))
    assert summary["loss_name"] == loss and summary["steps"] == 3
    assert {"reward_margin", "reward_accuracy"} <= set(summary)


@pytest.mark.slow  # two job runs; the engine's resume itself is covered by tests/trainer
def test_dpo_resume_keeps_the_starting_policy_as_reference(tmp_path):
    first = job.run(_config(**{"trainer.steps": 2}), str(tmp_path))
    resumed = job.run(_config(**{"trainer.steps": 4}), str(tmp_path))
    assert resumed["start_step"] == 2
    assert (resumed["eval_preference_accuracy_before"]
            == first["eval_preference_accuracy_before"])


@pytest.mark.parametrize("overrides, rule", [
    ({"trainer.microbatches": 2}, r"trainer.microbatches = 2: job = 'dpo' needs 1"),
    ({"trainer.batch_size": 31}, r"trainer.batch_size = 31: job = 'dpo' needs an even"),
])
def test_layouts_that_split_pairs_are_refused_by_the_config(overrides, rule):
    with pytest.raises(ConfigError, match=rule):  # so the dry run refuses them too
        _config(**overrides)


@pytest.mark.parametrize("dpo, rule", [
    ({"label_smoothing": 0.5}, r"dpo.label_smoothing = 0.5: must be < 0.5"),
    ({"loss": "ipo", "label_smoothing": 0.1}, r"only the dpo loss uses it"),
    ({"beta": 0.0}, r"dpo.beta = 0.0: must be > 0"),
    ({"loss": "kto"}, r"dpo.loss = 'kto'"),
])
def test_bad_dpo_settings_name_field_value_and_rule(dpo, rule):
    cfg = dpo_config.get_config()
    for name, value in dpo.items():
        setattr(cfg.dpo, name, value)
    with pytest.raises(ConfigError, match=rule):
        from_config_dict(cfg)


def _spec_loss(**dpo) -> float:
    """The loss ``dpo_spec`` builds from the config, on one fixed hand-made pair."""
    base = _config()
    config = dataclasses.replace(base, dpo=dataclasses.replace(base.dpo, **dpo))
    spec = dpo_spec(config, create_mesh(config.mesh, jax.devices()[:1]))
    logits = jnp.log(jnp.array([[[0.6, 0.4]], [[0.3, 0.7]]]))  # 2 rows (a pair), 1 token
    batch = PreferenceBatch(input_ids=None, targets=jnp.zeros((2, 1), jnp.int32),
                            loss_mask=jnp.ones((2, 1)), positions=None, segment_ids=None,
                            ref_logprobs=jnp.log(jnp.array([[0.5], [0.5]])))
    return float(spec.loss_fn(logits, batch)[0])


def test_each_loss_setting_reaches_the_step_loss():
    base = _spec_loss()
    assert _spec_loss(beta=1.0) != pytest.approx(base)
    assert _spec_loss(label_smoothing=0.2) != pytest.approx(base)
    assert _spec_loss(loss="ipo") != pytest.approx(base)
    assert _spec_loss(loss="simpo", simpo_gamma=1.0) != pytest.approx(
        _spec_loss(loss="simpo"))


def test_dry_run_of_the_dpo_config_exits_zero():
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "dpo.py"), "--dry_run"],
                         capture_output=True, text=True, env=cpu_env(8), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dpo.loss = 'dpo'" in out.stdout


def test_missing_preference_file_fails_before_training_naming_the_field(tmp_path):
    config = _config(**{"dpo.path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(DatasetError, match=r"dpo.path = '.*nope.jsonl': no such file"):
        job.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w" / "summary.json").exists()


@pytest.mark.parametrize("field", ["dpo.path", "dpo.eval_path"])
def test_missing_preference_file_fails_the_dry_run_naming_the_field(tmp_path, field):
    good = tmp_path / "pairs.jsonl"
    good.write_text("{}\n")
    config = _config(**{"dpo.path": str(good), field: str(tmp_path / "nope.jsonl")})

    with pytest.raises(ConfigError, match=rf"^{field} = '.*nope.jsonl': no such file"):
        dispatch.dry_run(config)


def test_dry_run_lists_the_preference_files_as_its_inputs(tmp_path):
    paths = {name: tmp_path / f"{name}.jsonl" for name in ("dpo.path", "dpo.eval_path")}
    for path in paths.values():
        path.write_text("{}\n")

    out = dispatch.dry_run(_config(**{k: str(v) for k, v in paths.items()}))

    inputs = out.split("# inputs (checked)\n")[1].split("\n# ")[0]
    assert inputs.splitlines() == [f"  {k}: {v}" for k, v in paths.items()]


def test_synthetic_preference_task_of_another_source_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"^data.source = 'countdown': the synthetic "
                                          r"preference task needs 'arithmetic'"):
        _config(**{"data.source": "countdown"})  # so the dry run refuses it too
    assert _config(**{"data.source": "countdown", "dpo.path": "pairs.jsonl"}).dpo.path


def test_data_shuffle_seed_reorders_the_pairs_of_a_file(tmp_path):
    from meshrl.models.tokenizer import CharTokenizer

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="}],
                                        "chosen": str(i + 1), "rejected": str(i + 2)}) + "\n"
                            for i in range(64)))

    def first_batch(shuffle_seed: int):
        config = _config(**{"data.shuffle_seed": shuffle_seed, "dpo.path": str(path),
                            "trainer.seq_len": 48})
        return next(job.training_pairs(config, CharTokenizer()))["input_ids"]

    same, other = first_batch(0), first_batch(7)
    assert (first_batch(0) == same).all() and not (other == same).all()
