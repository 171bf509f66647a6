"""Keep libtpu quiet on a host without TPU chips.

With the TPU compiler installed (the ``tpu`` extra) on a machine with no TPU attached, libtpu
prints a worker-hostname error when JAX first probes its backends, JAX logs that the TPU
backend did not start, and a second process loading libtpu fails on its lock file.
``quiet_libtpu_probe`` sets libtpu's two single-host settings and lets several processes load
it (only where unset, only when no TPU chip is attached, before JAX starts a backend), so a CPU
or GPU run prints what it prints without the extra, and compile jobs can build TPU topologies
side by side. On a TPU host it changes nothing.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def tpu_chips_attached() -> bool:
    """Whether this host has TPU chips (JAX's own check; device files as a fallback)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError):  # a JAX without that private helper
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_libtpu_probe() -> bool:
    """Set libtpu's single-host defaults when libtpu is installed and no TPU is attached;
    returns whether it did."""
    if importlib.util.find_spec("libtpu") is None or tpu_chips_attached():
        return False
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    # No chip to guard: several processes (test workers, two compile jobs) may load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return True
