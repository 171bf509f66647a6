"""Complete, quiet outputs of the sample and export jobs, on real_model's tiny Qwen2 (BPE
tokenizer, ChatML template) edited so that greedy decoding emits EOS at once: the export's
config.json carries the tokenizer's EOS and transformers' generate stops there without a
generation_config.json; the export folder has the user's umask; the generate job names its weight
source and version, keeps an earlier samples.jsonl, and prints no TPU or Orbax notice."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from meshrl.configs import from_config_dict
from meshrl.configs import generate as generate_config
from meshrl.configs import sft_chat as sft_chat_config
from meshrl.inference.published import publish_weights
from meshrl.jobs import dispatch
from meshrl.jobs import generate as generate_job
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import build_model, split_model
from meshrl.models.tokenizer import HFTokenizer
from meshrl.tests.jobs import real_model
from meshrl.tests.xla import cpu_env
from meshrl.utils.paths import first_free

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION = 3


def _emit_eos_first(src: pathlib.Path, out: pathlib.Path, eos: int) -> None:
    """``src`` with weights under which the last position's logits are ``n0 * E[:, 0]``, n0 > 0:
    embedding column 0 is 1 (EOS: 5) and no layer writes residual dim 0, so that dim holds the
    input token's 1; the final norm keeps dim 0 only; the tied head makes EOS the argmax."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        emb[eos, 0] = 5.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The edited checkpoint, chat rows, and a workdir with its params published as VERSION."""
    root = tmp_path_factory.mktemp("quiet")
    real_model.save_qwen2(root / "src")
    tokenizer = HFTokenizer(str(root / "src"))
    _emit_eos_first(root / "src", root / "hf", tokenizer.eos_id)
    chat = real_model.write_jsonl(root / "chat.jsonl", real_model.chat_rows(2, 0))
    cfg = sft_chat_config.get_config("tiny")
    cfg.model.hf_path = str(root / "hf")
    cfg.data.path = cfg.data.eval_path = str(chat)
    config = from_config_dict(cfg)
    model = build_model(config.model, mesh=create_mesh(config.mesh),
                        rules=rules_for("train", True))
    workdir = root / "run"
    publish_weights(split_model(model)[1], workdir, VERSION)
    return {"cfg": cfg, "workdir": workdir, "tokenizer": tokenizer, "hf": root / "hf",
            "chat": chat}


def test_export_writes_special_ids_with_umask_and_generate_stops_at_eos(run, tmp_path):
    import torch
    import transformers

    cfg = run["cfg"].copy_and_resolve_references()
    cfg.job, cfg.export.path, cfg.export.version = "export", str(tmp_path / "out"), VERSION
    tok = run["tokenizer"]

    dispatch.run(from_config_dict(cfg), str(run["workdir"]))

    out = tmp_path / "out"
    hf = json.loads((out / "config.json").read_text())
    assert (hf["eos_token_id"], hf["pad_token_id"]) == (tok.eos_id, tok.pad_id)
    assert "bos_token_id" not in hf  # the tokenizer has no BOS
    # The checkpoint's own generation_config.json (saved by transformers, no ids) gets them.
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (tok.eos_id, tok.pad_id)
    assert generation["transformers_version"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    (out / "generation_config.json").unlink()  # config.json alone must stop generation
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = torch.tensor([tok.encode("Tom has 3 apples.")])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert ids[0, prompt.shape[1]:].tolist() == [tok.eos_id]


def test_sample_output_path_keeps_an_earlier_file_unless_overwrite(tmp_path):
    (tmp_path / "samples.jsonl").write_text("earlier\n")
    (tmp_path / "samples-1.jsonl").write_text("earlier too\n")

    assert first_free(tmp_path / "samples.jsonl", False) == tmp_path / "samples-2.jsonl"
    assert first_free(tmp_path / "samples.jsonl", True) == tmp_path / "samples.jsonl"
    assert first_free(tmp_path / "new" / "samples.jsonl", False) == tmp_path / "new" / "samples.jsonl"


def test_sample_job_keeps_earlier_samples_and_names_its_weight_source(tmp_path, caplog):
    cfg = generate_config.get_config()
    cfg.data.num_examples = 2
    (tmp_path / "samples.jsonl").write_text("earlier\n")

    with caplog.at_level(logging.INFO):
        generate_job.run(from_config_dict(cfg), str(tmp_path))

    assert (tmp_path / "samples.jsonl").read_text() == "earlier\n"
    assert len((tmp_path / "samples-1.jsonl").read_text().splitlines()) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("sampling from a random" in m and "weight version 0" in m for m in messages)
    assert any(m.endswith(f"to {tmp_path / 'samples-1.jsonl'}") for m in messages), messages


@pytest.mark.slow  # a main.py subprocess that loads, compiles and samples (~15 s on 2 cores)
def test_sample_run_of_a_version_names_it_and_prints_no_tpu_or_orbax_notice(run, tmp_path):
    env = cpu_env(8)
    env.pop("JAX_PLATFORMS")  # let JAX probe every backend, as on a user's machine
    args = [f"--config.model.hf_path={run['hf']}", f"--config.data.path={run['chat']}",
            f"--config.data.eval_path={run['chat']}", "--config.job=generate",
            "--config.generate.source=version", "--config.sampler.max_new_tokens=4"]

    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                           str(ROOT / "configs" / "sft_chat.py") + ":tiny",
                           f"--workdir={run['workdir']}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"sampling from weight version {VERSION} of {run['workdir']}" in proc.stderr
    assert "Unable to initialize backend 'tpu'" not in proc.stderr, proc.stderr
    assert "Given directory is read only" not in proc.stderr, proc.stderr
