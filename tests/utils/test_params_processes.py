"""``process_local_copy`` across processes: every process gets the whole value of params that
are sharded over devices of several processes (two local processes, gloo collectives)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from meshrl.tests.xla import cpu_env

pytestmark = pytest.mark.distributed

CHILD = r"""
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))
from meshrl.utils.params import process_local_copy

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
whole = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
sharded = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, P("data")),
                                       lambda idx: whole[idx])
assert not sharded.is_fully_addressable
local = process_local_copy({"w": sharded})["w"]
assert local.is_fully_addressable and local.devices() == {jax.local_devices()[0]}, local.devices()
np.testing.assert_array_equal(np.asarray(local), whole)
print("ok", jax.process_index())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_process_local_copy_gives_every_process_the_whole_value_of_cross_process_shards():
    port = str(_free_port())
    env = cpu_env(2, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, port, str(i)], env=env, cwd="/",
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]

    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip().splitlines()[-1] for o in outs] == ["ok 0", "ok 1"]
