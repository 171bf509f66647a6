"""The real-model recipes rehearsed end to end on CPU, nothing downloaded. In the default run:
``configs/sft_chat.py:cpu`` as the README writes it, then its export. Marked slow: a Qwen2
checkpoint saved by transformers (with a BPE tokenizer and a ChatML template) goes through
``configs/rl_gsm8k.py:cpu`` on GSM8K-format JSONL, is exported and loaded by transformers, then
through ``configs/sft_chat.py:cpu`` on chat-format JSONL from that export, exported and loaded
again. Every run is ``main.py`` in a subprocess with the README's command line: the ``:cpu``
variants fit a 2-core CPU as written. The RL run adds only what lets a random-init model learn:
it earns no GSM8K reward (every group would be filtered, and the run stops at
``rollout.max_filtered_in_a_row``), so it pays for the share of letters in a completion
(``real_model.letter_share``), at a rate and for a number of steps at which that share clearly
rises; and ``rollout.filter_equal_groups=False``, because once every completion earns the full
reward the equal groups would be filtered and the run would stop the same way."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meshrl.tests.jobs import real_model
from meshrl.tests.trees import unchanged_leaves

pytestmark = pytest.mark.distributed  # 8 fake CPU devices: the recipes' FSDP meshes

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The :cpu variants are sized for a 2-core CPU as written; the RL run adds only what lets a
# random-init model learn (below).
# A reward the random model can earn and learn; 16 samples a step (groups of 8) and a rate far
# above the recipe's 1e-6 (no warm-up) take its mean from about 0.5 to about 0.9 in 12 steps.
RL_STEPS = 12
RL_LEARNS = ["--config.reward.names=('meshrl.tests.jobs.real_model:letter_share',)",
             "--config.rollout.filter_equal_groups=False",
             "--config.trainer.learning_rate=3e-2", "--config.optimizer.warmup_steps=0",
             f"--config.trainer.steps={RL_STEPS}", f"--config.trainer.eval_every={RL_STEPS // 2}",
             f"--config.checkpoint.every_steps={RL_STEPS // 2}"]


def _main(config: str, workdir: pathlib.Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                           str(ROOT / "configs" / config), f"--workdir={workdir}", *args],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _train_and_export(config: str, workdir: pathlib.Path, out: pathlib.Path,
                      hf_path: pathlib.Path, data: pathlib.Path, eval_data: pathlib.Path,
                      extra: list[str]) -> None:
    """The recipe's run from ``hf_path`` on ``data``, then ``job = export`` of it into ``out``
    (the same command line plus the export fields, as a user would type it)."""
    args = [f"--config.model.hf_path={hf_path}", f"--config.data.path={data}",
            f"--config.data.eval_path={eval_data}", *extra]
    _main(config, workdir, *args)
    _main(config, workdir, *args, "--config.job=export", f"--config.export.path={out}")


def _tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("recipes")
    hf = root / "qwen2"
    real_model.save_qwen2(hf)
    return {"hf": hf, "root": root,
            "train": real_model.write_jsonl(root / "train.jsonl", real_model.gsm8k_rows(32, 1)),
            "test": real_model.write_jsonl(root / "test.jsonl", real_model.gsm8k_rows(8, 2)),
            "chat": real_model.write_jsonl(root / "chat.jsonl", real_model.chat_rows(32, 3)),
            "chat_eval": real_model.write_jsonl(root / "chat_eval.jsonl",
                                                real_model.chat_rows(8, 4))}


@pytest.fixture(scope="module")
def rl_run(files) -> tuple[pathlib.Path, pathlib.Path]:
    """rl_gsm8k.py:cpu from the Qwen2 checkpoint, then its export."""
    workdir, out = files["root"] / "rl", files["root"] / "rl_hf"
    _train_and_export("rl_gsm8k.py:cpu", workdir, out, files["hf"], files["train"],
                      files["test"], RL_LEARNS)
    return workdir, out


def _rewards(workdir: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]


@pytest.mark.slow  # ~70 s with its run; the default run keeps the SFT :cpu recipe (below)
def test_rl_gsm8k_recipe_from_a_transformers_qwen2_raises_its_reward_and_exports(rl_run, files):
    workdir, out = rl_run
    summary = json.loads((workdir / "summary.json").read_text())
    rewards = _rewards(workdir)
    exported, source = _tensors(out), _tensors(files["hf"])

    assert summary["steps"] == RL_STEPS and summary["warm_start_steps"] == 0  # none from HF
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [RL_STEPS // 2, RL_STEPS]
    assert (workdir / "weights" / str(RL_STEPS)).is_dir()
    # Steps 1-3 train on samples of versions 0-2, steps 10-12 on versions 8-11 (staleness 1):
    # the later policy earns more. 0.2 is under half the rise these settings give (about 0.45
    # to 0.9), which one step's 16 samples measure to about +-0.05.
    assert len(rewards) == RL_STEPS, rewards
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert sorted(exported) == sorted(source)  # tied embeddings stay tied: no lm_head.weight
    assert all(np.isfinite(t).all() for t in exported.values())
    # Every tensor the loss depends on moved. A key bias adds the same amount to all of a
    # query's attention logits, which the softmax removes: its gradient is 0 up to rounding.
    still = [n for n in unchanged_leaves(exported, source) if "k_proj.bias" not in n]
    assert still == [], still
    # The run's tokenizer and chat template travel with the weights.
    assert (out / "tokenizer.json").read_bytes() == (files["hf"] / "tokenizer.json").read_bytes()


@pytest.mark.slow  # shares the RL run above
def test_rl_export_loads_in_transformers_with_the_runs_logits_and_chat_template(rl_run, files):
    import torch

    from meshrl.configs.loader import base_config, from_config_dict
    from meshrl.configs.schema import SamplerConfig
    from meshrl.inference.sampler import Sampler
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.models import build_model, forward
    from meshrl.models.tokenizer import tokenizer_for

    workdir, out = rl_run
    cfg = base_config("sft")
    cfg.model.hf_path = str(files["hf"])
    cfg.model.scan_layers = True  # the run's layout (rl_gsm8k.py): its published weights keep it
    config = from_config_dict(cfg)  # float32 compute: compared with transformers in float32
    mesh = create_mesh(config.mesh)
    built = build_model(config.model, mesh=mesh, rules=rules_for("train", False))
    sampler = Sampler(built.cfg, SamplerConfig(max_len=64, slots=2, prompt_buckets=(32,)), mesh,
                      workdir=str(workdir))
    sampler.load_weights(RL_STEPS)  # the version the run published last
    ours = tokenizer_for(config.model, real_model.QWEN2_TINY["vocab_size"])
    messages = [{"role": "user", "content": real_model.gsm8k_rows(1, 5)[0]["question"]}]
    ids = ours.encode(ours.apply_chat_template(messages, add_generation_prompt=True))

    model, hf_tok = real_model.load_in_transformers(out)
    hf_ids = real_model.hf_chat_ids(hf_tok, messages, add_generation_prompt=True)

    assert hf_ids == ids
    ids_BxL = np.asarray([ids], np.int32)
    want = np.asarray(forward(sampler.graphdef, sampler.params, ids_BxL))
    with torch.no_grad():
        got = model(input_ids=torch.tensor(ids_BxL.astype(np.int64))).logits.float().numpy()
    # float32 both sides; the remaining difference is op order (XLA vs torch matmuls).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~30 s; the default run keeps SFT from a transformers checkpoint in
# tests/jobs/test_export.py (hf_path at zero lr, bitwise export)
def test_sft_chat_recipe_from_the_rl_export_trains_and_exports_for_transformers(rl_run, files):
    import torch

    _, rl_hf = rl_run
    workdir, out = files["root"] / "sft", files["root"] / "sft_hf"

    _train_and_export("sft_chat.py:cpu", workdir, out, rl_hf, files["chat"],
                      files["chat_eval"], [])

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4 and np.isfinite(summary["first_loss"])
    assert np.isfinite(summary["final_loss"]) and summary["eval_sequences"] == 4
    before, after = _tensors(rl_hf), _tensors(out)
    assert sorted(after) == sorted(before)
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # it trained
    model, hf_tok = real_model.load_in_transformers(out)
    row = real_model.chat_rows(1, 4)[0]["messages"]
    ids = real_model.hf_chat_ids(hf_tok, row)
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert np.isfinite(float(loss))


@pytest.mark.slow  # ~15 s; the generate job itself runs in the default suite (tests/jobs)
def test_rl_cpu_run_samples_from_its_newest_version_as_the_readme_says(rl_run, files):
    workdir, _ = rl_run
    out = _main("rl_gsm8k.py:cpu", workdir, "--config.job=generate",
                "--config.generate.source=version", f"--config.model.hf_path={files['hf']}",
                f"--config.data.path={files['train']}",
                f"--config.data.eval_path={files['test']}")
    rows = [json.loads(x) for x in (workdir / "samples.jsonl").read_text().splitlines()]
    assert rows and all(set(r["versions"]) == {RL_STEPS} for r in rows), out[-2000:]


def test_sft_chat_cpu_recipe_as_written_trains_a_transformers_qwen2_and_exports_it(files):
    # The README's SFT rehearsal line with its paths filled in, then its export: the default
    # run's end-to-end check of a :cpu recipe (the RL chain above is slow).
    workdir, out = files["root"] / "sft_direct", files["root"] / "sft_direct_hf"
    _train_and_export("sft_chat.py:cpu", workdir, out, files["hf"], files["chat"],
                      files["chat_eval"], [])
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])
    assert summary["eval_sequences"] > 0  # the held-out chat file was read
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] is not None
    assert sorted(_tensors(out)) == sorted(_tensors(files["hf"]))
