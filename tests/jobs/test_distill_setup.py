"""On-policy distillation's set-up: the ``distill`` section's rules, the teacher source's error
lines, and a teacher of another width scoring a student's batch on a sharded mesh
(``trainer.reference.ReferencePolicy`` with ``distill``), checked against a one-device forward
and the advantage's definition."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.losses import token_logprobs
from meshrl.configs.distill_schema import teacher_model
from meshrl.configs.fields import ConfigError
from meshrl.jobs.distill import check_vocab, load_teacher, teacher_source
from meshrl.mesh import create_mesh
from meshrl.models import load
from meshrl.tests.trainer.tiny import tiny_rl_config
from meshrl.tests.xla import cpu_env
from meshrl.trainer.engine import Trainee, put_batch
from meshrl.trainer.reference import ReferencePolicy
from meshrl.trainer.spec import rl_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
T = 0.7  # the sampler's temperature: the teacher must be scored at it
TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 logprobs, tensor-parallel vs one-device sums


@pytest.mark.parametrize(("overrides", "match"), [
    ({"distill.teacher": "/t", "distill.teacher_steps": 3},
     r"distill.teacher = '/t': must be empty when distill.teacher_steps = 3"),
    ({"distill.teacher_hidden_size": 64},
     r"distill.teacher_hidden_size = 64: shapes only a teacher trained in this run"),
    ({"distill.teacher": "/t", "rl.kl_coef": 0.1},
     r"rl.kl_coef = 0.1: must be 0 with distill.teacher = '/t'"),
    ({"distill.teacher_steps": 2, "rollout.filter_equal_groups": True},
     r"rollout.filter_equal_groups = True: must be False with distill.teacher_steps = 2"),
    ({"distill.teacher_steps": 2, "distill.teacher_hidden_size": 30},
     r"distill.teacher_\* = \{'hidden_size': 30\}: the teacher's model section is invalid: "
     r"model.hidden_size = 30"),
    ({"distill.reward_weight": -1.0}, r"distill.reward_weight"),
])
def test_bad_distill_section_is_one_config_error_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_rl_config(**overrides)


def test_teacher_sizes_shape_the_in_run_teacher_and_default_to_the_student():
    config = tiny_rl_config(**{"distill.teacher_steps": 2, "distill.teacher_hidden_size": 64})
    deeper = tiny_rl_config(**{"distill.teacher_steps": 2, "distill.teacher_num_layers": 3,
                               "distill.teacher_intermediate_size": 96})

    model = teacher_model(config.model, config.distill)
    deep = teacher_model(deeper.model, deeper.distill)

    assert (model.hidden_size, model.num_layers) == (64, config.model.num_layers)
    assert model.intermediate_size == config.model.intermediate_size
    assert (deep.hidden_size, deep.num_layers, deep.intermediate_size) == (32, 3, 96)
    assert model.vocab_size == deep.vocab_size == config.model.vocab_size


def test_missing_teacher_path_is_one_line_naming_it(tmp_path):
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path / "nope")})

    with pytest.raises(ConfigError) as e:
        teacher_source(config)

    assert str(e.value) == (f"distill.teacher = '{tmp_path / 'nope'}': no such directory: point "
                            f"it at a Hugging Face checkpoint directory or a meshrl run's workdir")


@pytest.mark.slow  # main.py in a subprocess; the in-process test checks the line
def test_missing_teacher_path_is_one_error_line_from_main_in_a_dry_run(tmp_path):
    teacher = tmp_path / "nope"
    out = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                          str(ROOT / "configs" / "distill.py"), "--dry_run",
                          "--config.distill.teacher_steps=0",
                          "--config.distill.teacher_hidden_size=0",
                          "--config.distill.teacher_intermediate_size=0",
                          f"--config.distill.teacher={teacher}"],
                         capture_output=True, text=True, env=cpu_env(8), timeout=300)

    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: distill.teacher = '{teacher}': no such directory: point it at a Hugging Face "
        f"checkpoint directory or a meshrl run's workdir")
    assert "Traceback" not in out.stderr


def test_hugging_face_teacher_loads_at_its_own_width_with_the_students_tokenizer(tmp_path):
    from meshrl.models import create_model
    from meshrl.models.hf import save_hf_checkpoint
    from meshrl.models.tokenizer import CharTokenizer
    from meshrl.tests.inference.tiny import TINY

    wide = dataclasses.replace(TINY, vocab_size=256, hidden_size=64, intermediate_size=128)
    save_hf_checkpoint(create_model(wide, seed=3), tmp_path / "hf")  # no tokenizer.json
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path / "hf")})

    source = teacher_source(config)
    teacher = load_teacher(config, create_mesh(config.mesh), CharTokenizer(256), 256)

    assert (source.kind, source.model.tokenizer) == ("hf_path", "char")
    assert (teacher.arch.hidden_size, teacher.arch.num_layers) == (64, 2)
    assert config.model.num_layers == 1  # the checkpoint's config.json gives the shape


def test_teacher_dir_without_config_or_checkpoints_names_what_it_lacks(tmp_path):
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path)})

    with pytest.raises(ConfigError, match=r"neither a Hugging Face checkpoint \(no config.json\) "
                                          r"nor a meshrl run \(no checkpoints/ directory\)"):
        teacher_source(config)


def test_teacher_run_without_a_verified_checkpoint_says_so(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path)})

    with pytest.raises(ConfigError, match=r"no verified checkpoint under .*checkpoints: finish "
                                          r"\(or resume\) the teacher's run"):
        teacher_source(config)


def test_bad_teacher_path_fails_before_the_warm_start_trains(tmp_path):
    from meshrl.jobs import rl as rl_job

    config = tiny_rl_config(**{"distill.teacher": str(tmp_path / "nope"),
                               "rl.warm_start_steps": 2})

    with pytest.raises(ConfigError, match="no such directory"):
        rl_job.build(config, tmp_path / "run")

    assert not (tmp_path / "run" / "sft").exists()


def _swapped_tokenizer(src: pathlib.Path, out: pathlib.Path) -> None:
    """``src``'s tokenizer with two ordinary tokens' ids exchanged: as many tokens, other ids."""
    import json
    import shutil

    shutil.copytree(src, out)
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t in vocab if t.isalpha() and len(t) > 2][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(data))


def test_teacher_with_another_tokenizer_or_too_few_vocab_rows_is_rejected(tmp_path):
    from meshrl.models.tokenizer import CharTokenizer, HFTokenizer
    from meshrl.tests.jobs import real_model

    config = tiny_rl_config(**{"distill.teacher": "/teacher"})
    (tmp_path / "a").mkdir()
    real_model.train_tokenizer(tmp_path / "a")
    _swapped_tokenizer(tmp_path / "a", tmp_path / "b")
    ours, swapped = HFTokenizer(str(tmp_path / "a")), HFTokenizer(str(tmp_path / "b"))
    char = CharTokenizer(256)

    with pytest.raises(ConfigError, match=r"distill.teacher = '/teacher': its tokenizer has "
                                          r"512 tokens, the student's 256"):
        check_vocab(config, 512, CharTokenizer(512), char, 256)
    with pytest.raises(ConfigError, match=rf"its tokenizer has the student's {ours.vocab_size} "
                                          r"tokens but gives ids other tokens"):
        check_vocab(config, 512, swapped, ours, 512)
    with pytest.raises(ConfigError, match=r"its model has 256 vocabulary rows, fewer than the "
                                          r"student model's 320 \(the student may sample"):
        check_vocab(config, 256, char, char, 320)
    check_vocab(config, 320, char, char, 256)  # a padded teacher vocabulary: fine
    check_vocab(config, 512, HFTokenizer(str(tmp_path / "a")), ours, 512)  # one tokenizer


def _hf_teacher(out: pathlib.Path, vocab_size: int, tokenizer: bool) -> None:
    from meshrl.models import create_model
    from meshrl.models.hf import save_hf_checkpoint
    from meshrl.tests.inference.tiny import TINY
    from meshrl.tests.jobs import real_model

    wide = dataclasses.replace(TINY, vocab_size=vocab_size, hidden_size=64,
                               intermediate_size=128)
    save_hf_checkpoint(create_model(wide, seed=3), out)
    if tokenizer:
        real_model.train_tokenizer(out)


def test_a_teacher_with_its_own_tokenizer_is_read_with_it_not_the_students(tmp_path):
    _hf_teacher(tmp_path / "hf", 512, tokenizer=True)
    (tmp_path / "student_tok").mkdir()
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path / "hf"),
                               "model.tokenizer": str(tmp_path / "student_tok")})

    assert teacher_source(config).model.tokenizer == "auto"  # model.hf_path's: its own


def test_a_teacher_of_another_vocabulary_fails_before_the_warm_start_trains(tmp_path):
    from meshrl.jobs import rl as rl_job

    _hf_teacher(tmp_path / "hf", 512, tokenizer=True)
    config = tiny_rl_config(**{"distill.teacher": str(tmp_path / "hf"),
                               "rl.warm_start_steps": 2})

    with pytest.raises(ConfigError, match=r"its tokenizer has \d+ tokens, the student's 256"):
        rl_job.build(config, tmp_path / "run")

    assert not (tmp_path / "run" / "sft").exists()


def test_reference_and_teacher_forwards_split_as_finely_as_the_steps_proximal_pass():
    from meshrl.jobs.rl_setup import forward_microbatches

    config = tiny_rl_config(**{"trainer.microbatches": 3, "rl.ppo_minibatches": 2})

    assert forward_microbatches(config) == 6


def _host_batch(B: int, L: int, seed: int = 0) -> RLTrainBatch:
    """Hand-made rollout rows: random tokens, a prompt then a completion (the loss mask) per
    row, two rows packed with two sequences each."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 200, (B, L + 1)).astype(np.int32)
    mask = np.zeros((B, L), np.float32)
    seg = np.ones((B, L), np.int32)
    pos = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    sample = np.tile(np.arange(B, dtype=np.int32)[:, None], (1, L))
    for b in range(B):
        mask[b, 5:L - 4 - b] = 1.0
    for b in (1, 4):  # packed: a second sequence starts at L // 2
        h = L // 2
        seg[b, h:], pos[b, h:] = 2, np.arange(L - h)
        mask[b, h - 2:h], mask[b, h + 3:L - 2] = 0.0, 1.0
    return RLTrainBatch(
        input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=mask, positions=pos,
        segment_ids=seg,
        behaviour_logprobs=np.where(mask > 0, -rng.uniform(0.1, 6.0, (B, L)), 0.0).astype(
            np.float32),
        advantages=(rng.normal(size=(B, L)) * mask).astype(np.float32),
        versions=np.zeros((B, L), np.int32), sample_ids=sample)


@pytest.mark.distributed
def test_wider_teacher_on_a_sharded_mesh_sets_advantages_to_teacher_minus_student():
    config = tiny_rl_config(**{
        "mesh.data": 4, "mesh.tensor": 2, "rollout.prompts_per_step": 4,
        "sampler.temperature": T, "distill.teacher_steps": 1, "distill.reward_weight": 0.5,
        "distill.teacher_hidden_size": 64, "distill.teacher_intermediate_size": 128})
    mesh = create_mesh(config.mesh)
    tcfg = dataclasses.replace(config, model=teacher_model(config.model, config.distill))
    teacher = load(tcfg, mesh, "train")
    assert (teacher.arch.hidden_size, teacher.arch.intermediate_size) == (64, 128)
    forward = Trainee.of(teacher, tcfg).forward
    batch_sh = rl_spec(config, mesh).batch_sh
    host = _host_batch(8, config.trainer.seq_len)
    policy = ReferencePolicy(config.rl, forward, teacher.params, teacher.shardings, mesh,
                             batch_sh, samples=8, temperature=T, group_size=2, microbatches=2,
                             distill=config.distill, arch=teacher.arch)

    out, metrics = policy.apply(put_batch(host, batch_sh))

    params = jax.device_get(teacher.params)
    logits = jax.jit(forward)(params, host.input_ids, host.positions, host.segment_ids)
    teacher_BxL = np.where(host.loss_mask > 0,
                           np.asarray(token_logprobs(logits, jnp.asarray(host.targets), T)), 0)
    on = host.loss_mask > 0
    want = np.where(on, teacher_BxL - host.behaviour_logprobs + 0.5 * host.advantages, 0.0)
    np.testing.assert_allclose(np.asarray(out.advantages), want, **TOL)
    np.testing.assert_allclose(float(metrics["distill_reverse_kl"]),
                               (host.behaviour_logprobs - teacher_BxL)[on].mean(), **TOL)
    np.testing.assert_array_equal(np.asarray(out.behaviour_logprobs), host.behaviour_logprobs)
    assert policy.arch.hidden_size == 64


@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_distill_on_a_job_that_does_not_distil_is_refused_where_the_config_is_read(job):
    from meshrl.configs.loader import from_config_dict, to_config_dict

    values = to_config_dict(tiny_rl_config(**{"distill.teacher": "/no/such/teacher"}))
    values.job = job

    with pytest.raises(ConfigError, match=rf"distill.teacher = '/no/such/teacher': only job = rl "
                                          rf"distils \(job = {job}\)"):
        from_config_dict(values)


def test_the_teacher_is_evaluated_as_the_student_is(monkeypatch):
    import asyncio

    # With agent.env the student's held-out evaluation runs agent episodes: the teacher's must
    # go through the same function, not a single-turn one.
    from meshrl.jobs import distill
    from meshrl.models import create_model, split_model
    from meshrl.tests.inference.tiny import TINY

    config = tiny_rl_config(**{"distill.teacher": "/teacher"})
    calls = []

    async def held_out(cfg, engine, reward_pool, examples, tokenizer, *, version):
        calls.append((cfg, reward_pool, examples, tokenizer, version))
        return {"eval/greedy_accuracy": 0.5}

    monkeypatch.setattr(distill, "aevaluate_held_out", held_out)
    teacher = dataclasses.make_dataclass("T", ["arch", "params"])(
        TINY, split_model(create_model(TINY, seed=0))[1])
    loop = dataclasses.make_dataclass("L", ["reward_pool", "parts", "tokenizer"])(
        "pool", dataclasses.make_dataclass("P", ["examples"])("examples"), "tok")

    ev = asyncio.run(distill.aevaluate_teacher(config, teacher, create_mesh(config.mesh), loop))

    assert ev == {"eval/greedy_accuracy": 0.5}
    assert calls == [(config, "pool", "examples", "tok", 0)]
