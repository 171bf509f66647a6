"""GKE (any Kubernetes with JobSet) recipe: a ``jobset.x-k8s.io/v1alpha2`` JobSet, one pod per host.

One replicated job ``workers`` (1 replica) of ``num_hosts`` indexed pods (parallelism =
completions = ``num_hosts``), each asking for ``devices_per_host`` of the ``accelerator``
resource. The start is explicit: the coordinator is pod 0's DNS name,
``<name>-workers-0-0.<name>`` (JobSet's ``<jobset>-<replicatedJob>-<job index>-<pod index>``
hostname under the subdomain set in ``spec.network``), and each pod's process id is its
completion index, exposed through the downward API (annotation
``batch.kubernetes.io/job-completion-index``, the one ``JOB_COMPLETION_INDEX`` is set from) as
``MESHRL_PROCESS_ID`` so that ``$(MESHRL_PROCESS_ID)`` in the command expands. jax's own
Kubernetes detection (``K8sCluster``) would need the ``kubernetes`` package and a service
account allowed to read pods, so the recipe does not use ``distributed.initialize=auto``.

Multi-host TPU slices on GKE also need the TPU runtime's worker variables (``TPU_WORKER_ID``,
``TPU_WORKER_HOSTNAMES``); the recipe assumes GKE sets them for TPU pods, as documented for TPU
node pools, and sets none itself. Not yet run on a real cluster (see BUILD_NOTES.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.launch.recipes.common import (
    RecipeError,
    devices_text,
    explicit_start,
    main_argv,
    mesh_overrides,
    require_port,
    require_size,
    require_text,
)

REPLICATED_JOB = "workers"
PROCESS_ID_ENV = "MESHRL_PROCESS_ID"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_./-]+$")


def _check_name(name: str) -> None:
    require_text("name", name)
    host = f"{name}-{REPLICATED_JOB}-0-0"
    if not _DNS_LABEL.match(name) or len(host) > 63:
        raise RecipeError(f"name = {name!r}: must be lowercase letters, digits and '-', start "
                          f"with a letter, and keep the pod hostname {host!r} within 63 "
                          f"characters (a DNS label)")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if value == {}:
        return "{}"
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines for dicts, lists, strings, ints and bools."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            key = k if _PLAIN_KEY.match(k) else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                lines += [f"{pad}{key}:", *_yaml(v, indent + 2)]
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
        return lines
    lines = []
    for item in value:
        if isinstance(item, (dict, list)) and item:
            sub = _yaml(item, indent + 2)
            lines += [f"{pad}- {sub[0][indent + 2:]}", *sub[1:]]
        else:
            lines.append(f"{pad}- {_scalar(item)}")
    return lines


def _container(image: str, repo_dir: str, command: list[str], accelerator: str,
               devices_per_host: int, port: int) -> dict[str, Any]:
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    return {"name": "meshrl", "image": image, "workingDir": repo_dir, "command": command,
            "env": [{"name": PROCESS_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": index}}}],
            "ports": [{"containerPort": port}],
            "resources": {"limits": {accelerator: devices_per_host}}}


def gke_jobset(*, name: str, num_hosts: int, devices_per_host: int, image: str,
               accelerator: str, config: str, workdir: str, repo_dir: str, port: int = 8476,
               node_selector: Mapping[str, str] | None = None, max_restarts: int = 0,
               python: str = "python3", mesh: Mapping[str, int] | None = None,
               overrides: Sequence[str] = ()) -> str:
    """The JobSet YAML. ``accelerator`` is the extended resource (``google.com/tpu``,
    ``nvidia.com/gpu``); ``node_selector`` picks the node pool (TPU type and topology labels);
    ``repo_dir`` is the meshrl checkout inside ``image``; ``workdir`` should be storage every pod
    reaches; ``max_restarts`` is JobSet's whole-set restart budget (a rerun resumes)."""
    _check_name(name)
    require_size("num_hosts", num_hosts)
    require_size("devices_per_host", devices_per_host)
    require_size("max_restarts", max_restarts, minimum=0)
    require_port(port)
    for field, value in (("image", image), ("accelerator", accelerator),
                         ("repo_dir", repo_dir)):
        require_text(field, value)
    if "/" not in accelerator:
        raise RecipeError(f"accelerator = {accelerator!r}: must be a Kubernetes extended "
                          f"resource name such as google.com/tpu or nvidia.com/gpu")
    for key, value in (node_selector or {}).items():
        require_text("node_selector key", key)
        require_text(f"node_selector[{key!r}]", value)
    total, text = devices_text([(num_hosts, "hosts"), (devices_per_host, "devices per host")])
    coordinator = f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"
    start = explicit_start(coordinator, str(num_hosts), f"$({PROCESS_ID_ENV})")
    command = main_argv(python, config, workdir,
                        [*mesh_overrides(mesh or {}, total, text), *start], overrides)
    pod: dict[str, Any] = {"restartPolicy": "Never"}
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    pod["containers"] = [_container(image, repo_dir, command, accelerator, devices_per_host,
                                    port)]
    job = {"parallelism": num_hosts, "completions": num_hosts, "completionMode": "Indexed",
           "backoffLimit": 0, "template": {"spec": pod}}
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
        "spec": {"failurePolicy": {"maxRestarts": max_restarts},
                 "network": {"enableDNSHostnames": True, "subdomain": name},
                 "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                     "template": {"spec": job}}]},
    }
    header = [f"# meshrl recipe gke_jobset: {text}, one pod per host; coordinator {coordinator}."]
    return "\n".join([*header, *_yaml(jobset), ""])
