"""The MFU denominator: a configured peak, else the device kind's spec-sheet peak at the
model's compute dtype, else a measured matmul peak."""

from __future__ import annotations

import types

import pytest

from meshrl.trainer.metrics import peak_flops_per_device, table_peak

H100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("dtype, column", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                           ("float16", "bfloat16")])
def test_the_table_peak_follows_the_models_compute_dtype(dtype, column):
    assert peak_flops_per_device(0.0, H100, compute_dtype=dtype) == table_peak(
        H100.device_kind, column)
    assert table_peak(H100.device_kind, "float32") < table_peak(H100.device_kind, "bfloat16")


def test_a_configured_peak_wins():
    assert peak_flops_per_device(123.0, H100, compute_dtype="float32") == 123.0
