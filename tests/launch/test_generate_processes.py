"""The generate job on two processes (launch/local.py): each process samples its block of the
prompts from a run's checkpoint on its own devices, and process 0 writes the records of one
process, in prompt order."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "local.py")]
CONFIG = ["--config", str(ROOT / "configs" / "sft_synthetic.py") + ":smoke",
          "--config.mesh.data=-1", "--config.mesh.tensor=2", "--config.logging.progress_bar=false"]
# Five prompts: the processes take blocks of 3 and 2.
SAMPLE = ["--config.job=generate", "--config.generate.source=checkpoint",
          "--config.sampler.temperature=0.0", "--config.sampler.max_new_tokens=6",
          "--config.data.num_examples=5"]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _env(devices: int) -> dict[str, str]:
    return cpu_env(devices)


def _run(argv: list[str], devices: int = 4) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=ROOT, env=_env(devices), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out


def _samples(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]


def test_two_processes_sample_a_checkpoint_like_one_process(tmp_path):
    run = tmp_path / "run"
    _run([sys.executable, "main.py", *CONFIG, "--workdir", str(run), "--config.trainer.steps=2",
          "--config.trainer.eval_every=0"])

    _run([sys.executable, "main.py", *CONFIG, *SAMPLE, "--workdir", str(run)])
    a = _samples(run)
    (run / "samples.jsonl").unlink()
    multi = _run([*LAUNCH, "--num_processes", "2", "--devices_per_process", "2", "--",
                  "main.py", *CONFIG, *SAMPLE, "--workdir", str(run)])
    b = _samples(run)

    assert len(a) == 5
    assert [r["prompt_ids"] for r in b] == [r["prompt_ids"] for r in a]
    assert [r["tokens"] for r in b] == [r["tokens"] for r in a]
    assert all(set(r["versions"]) == {2} for r in b)
    assert "[p1] " in multi.stdout


# main.py with process 0 held back where the job picks its output file, as a slower host.
SLOW_FIRST = '''
import runpy, sys, time
import jax
from meshrl.utils import paths
first_free = paths.first_free
def held_back(path, overwrite):
    if jax.process_index() == 0:
        time.sleep(8)
    return first_free(path, overwrite)
paths.first_free = held_back
sys.argv[0] = {main!r}
runpy.run_path({main!r}, run_name="__main__")
'''
AGENT = ["--config", str(ROOT / "configs" / "agent_calc.py") + ":smoke", "--config.job=generate",
         "--config.generate.source=random", "--config.data.num_examples=4",
         "--config.sampler.max_new_tokens=16", "--config.logging.progress_bar=false"]


def test_two_processes_write_agent_episodes_once_in_prompt_order(tmp_path):
    run = tmp_path / "run"
    _run([sys.executable, "main.py", *AGENT, "--workdir", str(run)], devices=1)
    one = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    script = tmp_path / "slow_first.py"
    script.write_text(SLOW_FIRST.format(main=str(ROOT / "main.py")))

    _run([*LAUNCH, "--num_processes", "2", "--devices_per_process", "1", "--", str(script),
          *AGENT, "--config.generate.overwrite=true", "--workdir", str(run)], devices=1)

    two = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert [r["group_id"] for r in two] == [r["group_id"] for r in one] == [0, 1, 2, 3]
    assert [r["turns"] for r in two] == [r["turns"] for r in one]
    assert not list(run.glob("episodes-*.jsonl"))
