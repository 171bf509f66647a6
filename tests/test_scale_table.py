"""scripts/scale_table.py: a row's config is the one main.py compiles for its flags."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2 ** 30


def _scale_table():
    spec = importlib.util.spec_from_file_location("scale_table", ROOT / "scripts" / "scale_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report() -> dict:
    def program(name: str, hbm: float, weights: float, state: float) -> dict:
        return {"program": name, "hbm_per_chip_gib": hbm, "weights_bytes_per_chip": weights * GiB,
                "state_bytes_per_chip": state * GiB, "hbm_capacity_gib": 95.0}

    return {"programs": [program("train", 55.6, 7.5, 15.0), program("prefill", 48.6, 15.0, 32.0),
                         program("decode", 49.0, 15.0, 32.0)]}


@pytest.mark.parametrize("value, released", [("false", False), ("true", True)])
def test_colocated_row_reads_a_boolean_override_as_main_py_does(value, released):
    scale_table = _scale_table()
    row = ("llama3_8b", "grpo", "v5p-8", (f"rl.release_sampler_cache={value}",))

    both = scale_table._colocated(row, _report())

    assert both["kv_cache_released"] is released
    assert both["peak_phase"] == ("sampling" if released else "all")


def test_row_flags_are_main_pys_with_the_compile_job_and_overrides():
    row = ("llama3_8b", "grpo", "v5p-8", ("sampler.slots=128",))

    argv = _scale_table().config_argv(row)

    assert argv[0] == "--config" and argv[1].endswith("configs/llama3_8b.py:grpo@v5p-8")
    assert argv[2:] == ["--config.job=compile", "--config.sampler.slots=128"]
