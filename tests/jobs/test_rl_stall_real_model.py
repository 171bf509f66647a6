"""A user's own checkpoint and data whose answers the reward cannot read: a tiny Qwen2 saved by
transformers (local BPE tokenizer, ChatML template) on GSM8K-style rows that end in "The answer
is N." instead of "#### N". Every completion earns 0, so ``rollout.filter_equal_groups`` drops
every group; the run stops in one line naming the answer format and the setting, well within a
minute, and the checkpoint of the run before it still restores."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from meshrl.tests.jobs import real_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIT = ["--config.trainer.seq_len=128", "--config.data.max_prompt_len=64",
       "--config.data.eval_examples=4", "--config.trainer.microbatches=1",
       "--config.sampler.max_len=128", "--config.sampler.max_new_tokens=16",
       "--config.sampler.prompt_buckets=(64,)", "--config.sampler.slots=32",
       "--config.sampler.decode_chunk=8", "--config.rollout.group_size=8",
       "--config.rollout.prompts_per_step=2", "--config.reward.num_workers=1",
       "--config.checkpoint.every_steps=2", "--config.trainer.eval_every=100"]


def _main(workdir: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                           str(ROOT / "configs" / "rl_gsm8k.py"), f"--workdir={workdir}", *FIT,
                           *args], cwd=ROOT, env=dict(os.environ), capture_output=True,
                          text=True, timeout=600)


def _rows(n: int, seed: int) -> list[dict[str, str]]:
    return [{"question": r["question"],
             "answer": f"The answer is {r['answer'].rsplit('####', 1)[1].strip()}."}
            for r in real_model.gsm8k_rows(n, seed)]


def test_unreadable_answers_stop_the_run_in_one_line_and_keep_the_checkpoint(tmp_path):
    hf = tmp_path / "qwen2"
    real_model.save_qwen2(hf)
    data = real_model.write_jsonl(tmp_path / "train.jsonl", _rows(32, 0))
    evals = real_model.write_jsonl(tmp_path / "test.jsonl", _rows(4, 1))
    inputs = [f"--config.model.hf_path={hf}", f"--config.data.path={data}",
              f"--config.data.eval_path={evals}"]
    work = tmp_path / "run"
    # Two steps that keep every group leave a checkpoint at step 2.
    first = _main(work, *inputs, "--config.trainer.steps=2",
                  "--config.rollout.filter_equal_groups=False")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]

    start = time.monotonic()
    stalled = _main(work, *inputs, "--config.trainer.steps=4",
                    "--config.rollout.filter_equal_groups=True",
                    "--config.rollout.max_filtered_in_a_row=32")
    seconds = time.monotonic() - start

    out = stalled.stdout + stalled.stderr
    assert stalled.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert "####" in errors[0] and "rollout.filter_equal_groups=false" in errors[0], errors[0]
    assert "Traceback" not in out
    assert seconds < 60, f"the stalled run took {seconds:.0f} s to stop"
    ckpts = sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == ["2"], ckpts
    # The checkpoint restores: a run asked for no more steps resumes there and stops cleanly.
    again = _main(work, *inputs, "--config.trainer.steps=2",
                  "--config.rollout.filter_equal_groups=False")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resuming at step 2" in again.stdout + again.stderr
