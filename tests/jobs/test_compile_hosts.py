"""The compile job on multi-host TPU slices (libtpu's topology description: devices that carry
the process of their host; nothing runs): the run's own batch-row check (``TrainEngine``'s
``check_process_rows``) refuses a mesh in the job and in its search, and the 8-chip v5e and
v6e slices are one host, as Google Cloud sells them."""

from __future__ import annotations

import importlib.util

import pytest

from meshrl.jobs import compile as compile_job
from meshrl.jobs import compile_search
from meshrl.mesh import MeshShapeError
from meshrl.tests.jobs.compile_configs import compile_config
from meshrl.utils.errors import UserError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler is not installed: pip install -e '.[tpu]' -c constraints.txt")

ROWS_REFUSED = r"the batch's rows \(sharded .*\) are not split across the 4 processes"


def _config(job: str, topology: str, **fields: object):
    return compile_config(job, compile__topology=topology, **fields)


def _never(config, devices, chip, names=None):
    raise AssertionError(f"compiled a mesh the run refuses: {config.mesh}")


def test_v5e_16_has_four_hosts_and_the_8_chip_slices_one():
    hosts = {t: {d.process_index for d in compile_job.target(
        _config("sft", t).compile)[0]} for t in ("v5e-16", "v5e-8", "v6e-8")}

    assert hosts == {"v5e-16": {0, 1, 2, 3}, "v5e-8": {0}, "v6e-8": {0}}


@pytest.mark.parametrize("job", ["sft", "rl"])
def test_compile_job_refuses_a_mesh_that_gives_every_host_every_row(job):
    # tensor=4 spans hosts: each process would hold parts of every row, which TrainEngine
    # refuses before the first step.
    config = _config(job, "v5e-16", mesh__data=4, mesh__tensor=4)
    devices, chip, _ = compile_job.target(config.compile)

    with pytest.raises(MeshShapeError, match=ROWS_REFUSED):
        compile_job.compile_all(config, devices, chip, ("train",))


def test_search_refuses_before_compiling_the_meshes_the_run_refuses():
    # 4 rows over 4 hosts: no split of 16 chips gives each host whole rows of its own.
    config = _config("sft", "v5e-16", compile__search=True, trainer__batch_size=4)
    devices, chip, _ = compile_job.target(config.compile)

    with pytest.raises(UserError, match=f"none of the 15 meshes is valid on 16 x v5e: .*"
                                        f"{ROWS_REFUSED}"):
        compile_search.search(config, devices, chip, _never)
