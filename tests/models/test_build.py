"""One model builder for every job: ``model.hf_path`` plus every runtime field of ``model.*``
reach the built model of RL, RL eval and sample; a bad ``model.hf_path`` is one error line
naming it, before anything is written."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs import generate as generate_config
from meshrl.configs.loader import base_config, from_config_dict
from meshrl.configs.schema import ModelConfig
from meshrl.jobs import dispatch
from meshrl.jobs import generate as generate_job
from meshrl.jobs.weights_source import load_source
from meshrl.mesh import create_mesh
from meshrl.models import build_model, load, resolve_model_config
from meshrl.tests.models.conftest import TINY, hf_logits, random_ids
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.tests.xla import cpu_env
from meshrl.utils.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME = {"model.compute_dtype": "bfloat16", "model.remat": "full", "model.scan_layers": True,
           "model.attention": "einsum",  # not the default (blockwise)
           "model.tokenizer": "char"}  # a byte-vocabulary checkpoint, no tokenizer.json


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[pathlib.Path, object]:
    """A tiny LlamaForCausalLM saved by transformers; a byte vocabulary (char tokenizer)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, "vocab_size": 256}, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _assert_runtime(cfg: ModelConfig) -> None:
    assert (cfg.compute_dtype, cfg.remat, cfg.scan_layers) == ("bfloat16", "full", True)
    assert cfg.attention == "einsum"
    assert (cfg.param_dtype, cfg.vocab_size) == ("float32", 256)  # arch from config.json


def test_build_model_loads_hf_path_weights_with_runtime_fields_of_model(llama_dir):
    path, torch_model = llama_dir
    cfg = ModelConfig(hf_path=str(path), compute_dtype="bfloat16", remat="full",
                      scan_layers=True, attention="einsum", num_layers=5)  # num_layers: the checkpoint decides

    model = build_model(cfg)

    _assert_runtime(model.cfg)
    assert model.cfg == resolve_model_config(cfg)
    assert model.embed.get_value().dtype == jnp.float32
    ids_BxL = random_ids(1, 5, vocab=256)
    # bf16 matmuls against float32 torch: bf16's 8-bit mantissa bounds the tolerance.
    np.testing.assert_allclose(np.asarray(model(ids_BxL), np.float32),
                               hf_logits(torch_model, ids_BxL), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("role", ["train", "sample"])
def test_load_of_an_rl_config_builds_the_model_with_model_runtime_fields(llama_dir, role):
    config = tiny_rl_config(**{"model.hf_path": str(llama_dir[0]), "rl.warm_start_steps": 0,
                               **RUNTIME})
    mesh = create_mesh(config.mesh)

    loaded = load(config, mesh, role)

    # loaded.arch is what a job hands its sampler (rollouts, evaluation, the generate job).
    _assert_runtime(loaded.arch)
    _assert_runtime(nnx.merge(loaded.graphdef, loaded.params).cfg)


def test_generate_job_builds_the_hf_path_model_with_model_runtime_fields(llama_dir, tmp_path):
    cfg = generate_config.get_config()
    cfg.generate.source = "hf_path"
    cfg.model.hf_path = str(llama_dir[0])
    for key, value in RUNTIME.items():
        setattr(cfg.model, key.split(".")[1], value)
    config = from_config_dict(cfg)
    src = generate_job.resolve_source(config, tmp_path)

    loaded, _ = load_source(config, tmp_path, src, create_mesh(config.mesh), "sample")

    _assert_runtime(loaded.arch)
    _assert_runtime(nnx.merge(loaded.graphdef, loaded.params).cfg)


def test_preflight_reads_the_checkpoint_config_json_once(llama_dir, monkeypatch):
    from meshrl.models import hf_config

    reads = []
    original = hf_config.read_hf_config
    monkeypatch.setattr(hf_config, "read_hf_config", lambda p: reads.append(p) or original(p))
    import meshrl.models.build as build

    monkeypatch.setattr(build, "read_hf_config", hf_config.read_hf_config)
    config = tiny_rl_config(**{"model.hf_path": str(llama_dir[0]), "model.tokenizer": "char"})

    effective = dispatch.preflight(config)

    assert len(reads) == 1 and effective.config.hidden_size == TINY["hidden_size"]
    assert effective.checkpoint_dtype == "float32"


def _bad_dirs(root: pathlib.Path, llama: pathlib.Path) -> dict[str, pathlib.Path]:
    """name -> a model.hf_path that is wrong in that way."""
    out = {"absent": root / "absent"}
    out["no_config"] = root / "no_config"
    out["no_config"].mkdir()
    (out["no_config"] / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    out["no_weights"] = root / "no_weights"
    out["no_weights"].mkdir()
    (out["no_weights"] / "config.json").write_text((llama / "config.json").read_text())
    out["gpt2"] = root / "gpt2"
    out["gpt2"].mkdir()
    (out["gpt2"] / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    hf = json.loads((llama / "config.json").read_text())
    (out["gpt2"] / "config.json").write_text(json.dumps(
        {**hf, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return out


@pytest.mark.parametrize("job", ["sft", "rl"])
@pytest.mark.parametrize("bad, match", [
    ("absent", r"model.hf_path = '.*/absent': no such directory"),
    ("no_config", r"model.hf_path = '.*/no_config': no config.json"),
    ("no_weights", r"model.hf_path = '.*/no_weights': no \*.safetensors"),
    ("gpt2", r".*/gpt2/config.json: HF config model_type = 'gpt2': unsupported"),
])
def test_bad_hf_path_is_one_error_naming_it_and_nothing_is_written(llama_dir, tmp_path, job,
                                                                  bad, match):
    path = _bad_dirs(tmp_path, llama_dir[0])[bad]
    cfg = base_config(job)
    cfg.model.hf_path = str(path)
    if job == "rl":
        cfg.rl.warm_start_steps = 0
    config = from_config_dict(cfg)
    workdir = tmp_path / "run"

    with pytest.raises(UserError, match=match):
        dispatch.run(config, str(workdir))
    with pytest.raises(UserError, match=match):
        dispatch.dry_run(config)

    assert not workdir.exists()


def test_main_with_unsupported_hf_architecture_prints_one_error_line(llama_dir, tmp_path):
    path = _bad_dirs(tmp_path, llama_dir[0])["gpt2"]
    env = cpu_env()
    workdir = tmp_path / "run"

    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "sft_synthetic.py"), "--workdir", str(workdir),
                          f"--config.model.hf_path={path}"],
                         capture_output=True, text=True, env=env, timeout=300)

    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}/config.json: HF config model_type = 'gpt2': "
                           f"unsupported"), out.stderr[-2000:]
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr
    assert not workdir.exists()
