"""Each process loads its own batch rows: a mesh whose DCN axes do not split the rows across
processes (tensor or context across hosts) is refused before a batch is put together wrong.
Processes are stood in for by blocks of the 8 fake CPU devices (the blocks fake DCN uses)."""

from __future__ import annotations

import pytest

from meshrl.configs.schema import MeshConfig
from meshrl.mesh import MeshShapeError, check_process_rows, create_mesh, rules_for
from meshrl.trainer.step import batch_shardings


def _rows_sharding(cfg: MeshConfig):
    return batch_shardings(create_mesh(cfg), rules_for("train", cfg.fsdp), 16, 32).input_ids


def _two_processes(device) -> int:
    return device.id // 4


@pytest.mark.parametrize("cfg", [MeshConfig(data=4, dcn_data=2), MeshConfig(data=8),
                                 MeshConfig(data=2, tensor=2, dcn_data=2),
                                 MeshConfig(data=2, context=2, dcn_data=2, fsdp=True)])
def test_rows_split_over_processes_by_data_pass(cfg):
    check_process_rows(_rows_sharding(cfg), cfg, _two_processes)


@pytest.mark.parametrize("cfg, axis", [(MeshConfig(data=4, dcn_context=2), "dcn_context=2"),
                                       (MeshConfig(data=4, dcn_tensor=2), "dcn_tensor=2")])
def test_tensor_or_context_across_processes_is_refused_naming_the_sizes(cfg, axis):
    with pytest.raises(MeshShapeError, match=r"the batch's rows \(sharded .*\) are not split "
                                             r"across the 2 processes, whole rows to each") as e:
        check_process_rows(_rows_sharding(cfg), cfg, _two_processes)
    assert axis in str(e.value)


def test_rows_of_one_process_need_not_be_adjacent():
    # A TPU pod's device order may interleave the hosts along data: each still loads its own
    # rows, placed where the sharding puts them.
    cfg = MeshConfig(data=8)
    check_process_rows(_rows_sharding(cfg), cfg, lambda d: d.id % 2)


def test_one_process_holds_every_row_and_passes():
    cfg = MeshConfig(data=4, dcn_context=2)
    check_process_rows(_rows_sharding(cfg), cfg)  # the real process index: all 0
