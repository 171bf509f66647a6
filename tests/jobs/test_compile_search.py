"""The compile job's mesh search on the local (fake CPU) devices: which device count it splits,
the DCN sizes it keeps, and what it says when nothing was compiled. Multi-host topologies:
tests/jobs/test_compile_hosts.py."""

from __future__ import annotations

import math

import jax
import pytest

from meshrl.aot.chips import CHIPS
from meshrl.jobs import compile_search
from meshrl.tests.jobs.compile_configs import compile_config
from meshrl.utils.errors import UserError

ICI = ("data", "tensor", "context", "expert", "expert_tensor")


def _config(job: str, **fields: object):
    return compile_config(job, **{"compile__search": True, **fields})


def _recording(seen: list) -> compile_search.CompileAll:
    """A compile_all that records each candidate's mesh and reports a fitting train step."""

    def compile_all(config, devices, chip, names=None):
        seen.append(config.mesh)
        return [{"program": "train", "fits": True, "headroom": 0.5, "hbm_per_chip_gib": 1.0,
                 "step_s_roofline": 1.0 + len(seen), "mfu_roofline": 0.5,
                 "roofline": {"bound": "compute"}}]

    return compile_all


def test_search_with_split_placement_splits_only_the_trainers_devices():
    config = _config("rl", rl__placement="split", rl__sampler_devices=4, mesh__data=4)
    seen: list = []

    _, tried = compile_search.search(config, jax.devices()[:8], CHIPS["h100"], _recording(seen))

    assert seen and all(math.prod(getattr(m, a) for a in ICI) == 4 for m in seen)
    assert all(math.prod(row["mesh"].values()) == 4 for row in tried)
    assert seen[-1].data == 4  # the chosen mesh (the fastest here: the first) compiled again


def test_search_keeps_the_dcn_sizes_and_splits_what_lies_within_one_dcn_unit():
    config = _config("sft", mesh__data=-1, mesh__dcn_data=2)
    seen: list = []

    compile_search.search(config, jax.devices()[:8], CHIPS["h100"], _recording(seen))

    assert seen and all(m.dcn_data == 2 for m in seen)
    assert all(math.prod(getattr(m, a) for a in ICI) == 4 for m in seen)


def test_search_where_no_mesh_compiles_says_none_is_valid_not_that_none_fits():
    config = _config("sft")

    def unshardable(config, devices, chip, names=None):
        raise ValueError("a split the model code cannot shard")

    with pytest.raises(UserError, match=r"none of the \d+ meshes is valid on 8 x h100: each was "
                                        r"refused before its train step compiled"):
        compile_search.search(config, jax.devices()[:8], CHIPS["h100"], unshardable)
