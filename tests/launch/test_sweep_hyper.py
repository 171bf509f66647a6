"""The sweep vocabulary in XManager's spelling: ``product([...])`` and ``zipit([...])`` take
the axes as one list, as big_vision's ``get_sweep(hyper)`` and scenic's ``get_hyper(hyper)``
write them, and give what the one-argument-per-axis form gives."""

from __future__ import annotations

import pytest

from meshrl.launch import sweep_hyper as hyper
from meshrl.launch.sweep_hyper import SweepError

LR = hyper.sweep("trainer.learning_rate", [1e-3, 3e-4])
SEED = hyper.sweep("trainer.seed", [0, 1])


def test_product_of_a_list_of_axes_equals_product_of_the_axes_as_arguments():
    got = hyper.product([LR, SEED])

    assert got == hyper.product(LR, SEED)
    assert got[:2] == [{"trainer.learning_rate": 1e-3, "trainer.seed": 0},
                       {"trainer.learning_rate": 1e-3, "trainer.seed": 1}]


def test_zipit_of_a_list_pairs_axes_and_nests_in_a_list_product():
    warmup = hyper.sweep("optimizer.warmup_steps", [10, 20])

    got = hyper.product([hyper.zipit([LR, warmup]), hyper.fixed("trainer.steps", 2)])

    assert got == [{"trainer.learning_rate": 1e-3, "optimizer.warmup_steps": 10,
                    "trainer.steps": 2},
                   {"trainer.learning_rate": 3e-4, "optimizer.warmup_steps": 20,
                    "trainer.steps": 2}]
    assert hyper.zip(LR, warmup) == hyper.zipit([LR, warmup])  # the earlier name stays


def test_product_of_one_axis_and_of_no_axes():
    assert hyper.product([SEED]) == hyper.product(SEED) == SEED
    assert hyper.product([]) == [{}]  # as XManager's: one trial, the base config


def test_big_vision_config_prefix_names_the_same_key():
    assert hyper.sweep("config.trainer.seed", [0]) == [{"trainer.seed": 0}]
    with pytest.raises(SweepError, match="'trainer.seed' appears in more than one axis"):
        hyper.product([hyper.sweep("config.trainer.seed", [0]), hyper.fixed("trainer.seed", 1)])


@pytest.mark.parametrize("call, expected", [
    (lambda: hyper.product([LR, 3]), r"product: axis 1 = 3: each axis must be a list of dicts"),
    (lambda: hyper.product([LR, SEED], LR), r"product: axis 0 = \[\[\{"),
    (lambda: hyper.zipit([LR, [1, 2]]), r"zipit: axis 1 = \[1, 2\]"),
    (lambda: hyper.zipit([LR, hyper.sweep("trainer.seed", [0, 1, 2])]),
     r"zipit: the axes have different lengths \[2, 3\]"),
    (lambda: hyper.fixed("seed", 0), "'section.field' string"),
])
def test_malformed_axes_raise_sweep_error_naming_the_rule(call, expected):
    with pytest.raises(SweepError, match=expected):
        call()
