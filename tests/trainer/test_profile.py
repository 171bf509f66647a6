"""logging.profile_steps writes a jax.profiler trace of that window of training steps, for the
SFT loop and the RL job alike, and rejects a window that is not (first, last) with
1 <= first <= last."""

from __future__ import annotations

import pytest

from meshrl.configs import ConfigError, base_config, from_config_dict
from meshrl.tests.trainer.tiny import make_loop, tiny_config, tiny_rl_config
from meshrl.trainer.profile import ProfileWindow
from meshrl.trainer.sft_loop import run_sft


def _traces(workdir) -> list:
    return list((workdir / "profile" / "process_0").rglob("*.xplane.pb"))


@pytest.mark.slow  # a traced SFT run
def test_sft_run_with_window_2_3_writes_one_nonempty_trace(tmp_path):
    config = tiny_config(**{"checkpoint.every_steps": 0, "checkpoint.async_save": False,
                            "trainer.steps": 3, "logging.profile_steps": (2, 3)})
    loop = make_loop(config, tmp_path)
    run_sft(loop)
    loop.close()
    (trace,) = _traces(tmp_path)
    assert trace.stat().st_size > 0
    assert loop.profile.done and not loop.profile.active


@pytest.fixture
def profiler_calls(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    monkeypatch.setattr("jax.profiler.start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr("jax.profiler.stop_trace", lambda: calls.append(("stop",)))
    return calls


def test_window_traces_its_steps_once_and_stops_after_the_last(tmp_path, profiler_calls):
    window = ProfileWindow((2, 3), tmp_path, 0)
    for step in range(1, 6):
        window.before(step)
        profiler_calls.append(("step", step))
        window.after(step, [])
    window.close()
    assert profiler_calls == [("step", 1), ("start", str(tmp_path / "profile" / "process_0")),
                              ("step", 2), ("step", 3), ("stop",), ("step", 4), ("step", 5)]


def test_resumed_run_starts_inside_the_window_and_close_stops_the_open_trace(tmp_path,
                                                                             profiler_calls):
    window = ProfileWindow((3, 9), tmp_path, 1)
    for step in (5, 6):  # a run resumed at step 4 that ends at step 6
        window.before(step)
        window.after(step, [])
    assert profiler_calls == [("start", str(tmp_path / "profile" / "process_1"))]
    assert window.active
    window.close()
    window.close()
    assert profiler_calls[1:] == [("stop",)] and window.done and not window.active


def test_resume_past_the_window_or_no_window_never_traces(tmp_path, profiler_calls):
    for steps, first_step in (((2, 3), 4), ((), 1)):
        window = ProfileWindow(steps, tmp_path, 0)
        window.before(first_step)
        window.after(first_step, [])
        window.close()
    assert profiler_calls == []


@pytest.mark.parametrize("value", [(3,), (0, 2), (-1, 2), (4, 2), (1, 2, 3), (1.5, 2)])
def test_bad_profile_window_is_one_line_naming_field_value_and_rule(value):
    cfg = base_config("sft")
    cfg.logging.profile_steps = value
    with pytest.raises(ConfigError, match=r"^logging.profile_steps(\[0\])? = .*: must be") as e:
        from_config_dict(cfg)
    assert "\n" not in str(e.value)


def test_rl_warm_start_profiles_nothing():
    from meshrl.jobs.rl_setup import warm_start_config

    cfg = base_config("rl")
    cfg.logging.profile_steps = (2, 3)
    assert warm_start_config(from_config_dict(cfg), 5).logging.profile_steps == ()


@pytest.mark.slow
def test_rl_run_with_window_writes_a_trace(tmp_path):
    from meshrl.jobs import rl

    rl.run(tiny_rl_config(**{"logging.profile_steps": (2, 2)}), str(tmp_path))
    (trace,) = _traces(tmp_path)
    assert trace.stat().st_size > 0
