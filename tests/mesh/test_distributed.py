"""The explicit multi-process start takes every argument from config: no cluster detection, so
under SLURM no process is pinned to the one GPU SLURM_LOCALID names."""

from __future__ import annotations

import os
import subprocess
import sys

from meshrl.tests.xla import cpu_env

# One process, started as the slurm_gpu recipe starts each node's process; prints the GPU list
# JAX would use (jax_cuda_visible_devices), which SLURM detection narrows to SLURM_LOCALID.
SCRIPT = """
import socket, jax
from meshrl.configs.mesh_schema import DistributedConfig
from meshrl.mesh import initialize_distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
initialize_distributed(DistributedConfig(initialize="explicit", num_processes=1, process_id=0,
                                         coordinator_address=f"127.0.0.1:{port}"))
print("visible", jax.config._read("jax_cuda_visible_devices"))
jax.distributed.shutdown()
"""


def test_an_explicit_start_under_slurm_leaves_every_gpu_of_the_node_visible():
    env = {**cpu_env(1), "SLURM_JOB_ID": "42", "SLURM_LOCALID": "3", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "localhost"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["visible", "all"], out.stdout
