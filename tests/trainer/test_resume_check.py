"""Resuming with another config: a change the checkpoint's counters cannot follow, or fewer
total steps than it holds, is refused with one line; other changes to what is trained are
logged in one warning line; where the run writes and how long it runs change freely."""

from __future__ import annotations

import json
import logging

import pytest

from meshrl.configs.loader import base_config, from_config_dict
from meshrl.tests.trainer.tiny import make_loop, tiny_config
from meshrl.trainer.resume_check import ResumeConfigError, check_resume
from meshrl.trainer.sft_loop import run_sft


def _config(**changes) -> dict:
    """``Config.to_dict()`` as a checkpoint stores it (JSON: tuples become lists)."""
    cfg = base_config("rl")
    for path, value in changes.items():
        section, key = path.split(".")
        cfg[section][key] = value
    return json.loads(json.dumps(from_config_dict(cfg).to_dict()))


@pytest.mark.parametrize("field, value", [("rollout.prompts_per_step", 4),
                                          ("rollout.group_size", 8),
                                          # the schedule's index: update count // K x E
                                          ("rl.ppo_minibatches", 2), ("rl.ppo_epochs", 3)])
def test_a_change_the_rl_counters_cannot_follow_is_refused_naming_both_values(field, value):
    saved = _config()
    was = saved[field.split(".")[0]][field.split(".")[1]]

    with pytest.raises(ResumeConfigError, match=rf"{field} = {value}: .* written with {was}"):
        check_resume(saved, _config(**{field: value}), step=4)


def test_a_checkpoint_of_another_job_is_refused_naming_both_jobs():
    saved = {**_config(), "job": "sft"}  # an SFT run left this workdir's checkpoints

    with pytest.raises(ResumeConfigError, match="job = 'rl': the workdir's checkpoints were "
                                                "written by the 'sft' job; pass another"):
        check_resume(saved, _config(), 6)


def test_fewer_total_steps_than_the_checkpoint_holds_is_refused():
    with pytest.raises(ResumeConfigError, match=r"trainer.steps = 3: .* at step 6"):
        check_resume(_config(**{"trainer.steps": 10}), _config(**{"trainer.steps": 3}), step=6)


def test_other_changes_are_logged_in_one_line_and_where_the_run_writes_is_not(caplog):
    saved = _config(**{"trainer.steps": 10, "optimizer.schedule": "constant"})
    now = _config(**{"trainer.steps": 20, "optimizer.weight_decay": 0.5,
                     "optimizer.schedule": "constant", "logging.level": "DEBUG",
                     "checkpoint.keep": 5})

    with caplog.at_level(logging.WARNING):
        check_resume(saved, now, step=4)

    lines = [r.getMessage() for r in caplog.records if "config changes" in r.getMessage()]
    assert len(lines) == 1 and "optimizer.weight_decay" in lines[0], lines
    assert "trainer.steps" not in lines[0] and "logging" not in lines[0]
    assert "checkpoint" not in lines[0]


def test_more_steps_under_a_decaying_schedule_say_its_horizon_moved(caplog):
    saved = _config(**{"trainer.steps": 10, "optimizer.schedule": "cosine"})

    with caplog.at_level(logging.WARNING):
        check_resume(saved, _config(**{"trainer.steps": 20, "optimizer.schedule": "cosine"}),
                     step=4)

    (line,) = [r.getMessage() for r in caplog.records if "config changes" in r.getMessage()]
    assert "trainer.steps: 10 -> 20 (the cosine learning-rate schedule now decays to step 20)" \
        in line


def test_unchanged_config_resumes_without_a_word(caplog):
    with caplog.at_level(logging.WARNING):
        check_resume(_config(), _config(), step=4)
    assert not [r for r in caplog.records if "config changes" in r.getMessage()]


def test_an_sft_run_resumed_with_fewer_steps_than_its_checkpoint_stops_with_one_line(tmp_path):
    loop = make_loop(tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2}), tmp_path)
    run_sft(loop)
    loop.close()

    with pytest.raises(ResumeConfigError, match=r"trainer.steps = 2: .* at step 4"):
        make_loop(tiny_config(**{"trainer.steps": 2, "checkpoint.every_steps": 2}), tmp_path)
