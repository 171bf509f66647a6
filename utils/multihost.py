"""Small host-side collectives over JAX's multi-controller runtime (no-ops on one process).

Every process must call each collective at the same point of the program; ``on_this_process``
is a local query.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np


def allgather_json(obj: Any) -> list[Any]:
    """``obj`` (JSON-able) of every process, in process order."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, :int(sizes[i, 0])].tobytes()) for i in range(rows.shape[0])]


def on_this_process(mesh: Any) -> bool:
    """Whether every device of ``mesh`` belongs to this process (its programs involve no
    other process)."""
    return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


def all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every process."""
    return all(allgather_json(bool(flag)))


def sync(name: str) -> None:
    """Wait until every process reaches the barrier ``name``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_block(n: int) -> range:
    """This process's contiguous block of ``n`` items (the first ``n % count`` processes take
    one more), so the processes' results concatenate in item order."""
    count, index = jax.process_count(), jax.process_index()
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))
