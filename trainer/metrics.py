"""Metric sinks (tensorboardX + a JSONL file on process 0) and the MFU arithmetic."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from meshrl.utils import paths
from meshrl.utils.log import get_logger

_log = get_logger("trainer.metrics")

# Dense peak FLOP/s per chip from the vendors' spec sheets (no sparsity): (kind, bfloat16,
# float32). float32 is the peak of a float32 matmul at JAX's default precision: TF32 tensor cores
# on A100/H100/H200, one bfloat16 pass on TPU. More specific kinds come first (substring match).
_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h200", 989e12, 494.7e12), ("h100 pcie", 756e12, 378e12), ("h100", 989e12, 494.7e12),
    ("a100", 312e12, 156e12),
    ("tpu v6 lite", 918e12, 918e12), ("tpu v6e", 918e12, 918e12),
    ("tpu v5 lite", 197e12, 197e12), ("tpu v5e", 197e12, 197e12),
    ("tpu v5p", 459e12, 459e12), ("tpu v5", 459e12, 459e12), ("tpu v4", 275e12, 275e12),
)


def table_peak(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """The spec-sheet dense peak FLOP/s of one chip of ``device_kind`` for ``dtype``
    (``"bfloat16"`` or ``"float32"``), or ``None`` when the kind is not in the table (CPU)."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype = {dtype!r}: must be 'bfloat16' or 'float32'")
    kind = device_kind.lower()
    for name, bf16, f32 in _PEAKS:
        if name in kind:
            return bf16 if dtype == "bfloat16" else f32
    return None


def measure_matmul_peak(n: int = 1024, repeats: int = 5, dtype: Any = jnp.float32,
                        device: jax.Device | None = None) -> float:
    """Median-of-``repeats`` FLOP/s of one ``n x n`` matmul on ``device`` after a warm-up: the
    practical peak (a median, so one lucky timing does not set it)."""
    device = device or jax.local_devices()[0]  # devices()[0] is remote on process > 0
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def peak_flops_per_device(configured: float, device: jax.Device | None = None, *,
                          compute_dtype: str) -> float:
    """``configured`` if > 0, else the table's peak for the device kind at the model's
    ``compute_dtype`` (float32 matmuls against the float32 peak; 16-bit ones the bf16 peak),
    else (CPU or an unknown chip) a measured f32 matmul peak."""
    if configured > 0:
        return configured
    device = device or jax.local_devices()[0]  # devices()[0] is remote on process > 0
    column = "float32" if jnp.dtype(compute_dtype) == jnp.float32 else "bfloat16"
    peak = table_peak(device.device_kind, column)
    if peak is not None:
        return peak
    peak = measure_matmul_peak(device=device)
    _log.info("no peak FLOP/s known for device kind %r; measured f32 matmul peak %.1f GFLOP/s "
              "(set trainer.peak_flops to override)", device.device_kind, peak / 1e9)
    return peak


def summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without loading torch where it can be.

    tensorboardX's writer module imports torch whenever it is installed (Colab ships it), only
    to accept torch tensors: 1.2-1.7 s and hundreds of MB in a JAX process, on every run's
    start. meshrl writes Python floats. So unless torch is loaded already, the import first runs
    with torch marked unimportable (the mark is removed right after; tensorboardX imports torch
    lazily in the few methods, images and graphs, that need it). The mark is process-wide while
    it lasts: call this where no other thread imports torch (the job's set-up). A tensorboardX
    that cannot import without torch is imported again the ordinary way.
    """
    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules \
            or importlib.util.find_spec("torch") is None:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ImportError
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    except ImportError:
        pass
    finally:
        if sys.modules.get("torch", ...) is None:
            del sys.modules["torch"]
    _log.debug("tensorboardX needs torch to import; importing it with torch")
    for name in [m for m in sys.modules if m == "tensorboardX" or m.startswith("tensorboardX.")]:
        del sys.modules[name]  # half-imported under the mark
    from tensorboardX import SummaryWriter
    return SummaryWriter


class MetricsWriter:
    """Scalars to ``<workdir>/tb`` (tensorboardX) and ``<workdir>/metrics.jsonl``, process 0 only.

    The JSONL copy is flushed per write, so a killed run's log survives up to its last write.
    ``resume_step`` is the step the run restored (``None``: a fresh start). Rows a dead run wrote
    after that step did not happen in the resumed run's history: they move to
    ``metrics.discarded.jsonl`` (kept, appended), and TensorBoard purges events from
    ``resume_step + 1`` on (the restart marker TensorBoard reads). On a fresh start a
    ``summary.json`` left in the workdir is an earlier run's: it moves to
    ``summary.discarded.json`` (a numbered name when that exists), so that nothing reads it as
    this run's end until this run writes its own.
    """

    def __init__(self, workdir: paths.PathLike, *, tensorboard: bool, process_index: int,
                 resume_step: int | None = None, wandb: Any = None) -> None:
        self._enabled = process_index == 0
        self._wandb = wandb if self._enabled else None  # trainer/wandb_sink.py
        self._tb = None
        self._jsonl = None
        if not self._enabled:
            return
        workdir = paths.as_path(workdir)
        last_kept = -1 if resume_step is None else resume_step
        if resume_step is None:
            _move_aside(workdir / "summary.json")
        self._path = workdir / "metrics.jsonl"
        _drop_rows_after(self._path, last_kept)
        # The kinds of row (key sets) kept at the restored step: a resumed run that writes one
        # again there (the final evaluation of a finished run run again) replaces it.
        self._at_resume = (last_kept, _key_sets_at(self._path, last_kept))
        if tensorboard:
            self._tb = summary_writer_class()(str(workdir / "tb"), purge_step=last_kept + 1)
        self._jsonl = self._path.open("a")  # noqa: SIM115 (closed in close())

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self._enabled:
            return
        at, kinds = self._at_resume
        if step == at and frozenset(scalars) in kinds:
            kinds.discard(frozenset(scalars))
            assert self._jsonl is not None
            self._jsonl.close()
            _drop_rows(self._path, lambda row: row.get("step") == at
                       and frozenset(row) - {"step"} == frozenset(scalars))
            self._jsonl = self._path.open("a")  # noqa: SIM115 (closed in close())
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        assert self._jsonl is not None
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.close()


def _rows(path: epath.Path) -> list[tuple[str, dict | None]]:
    """Each non-blank line with its row (None: a line cut by a kill, not any step's record)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.strip():
            try:
                row = json.loads(line)
                ok = isinstance(row, dict) and isinstance(row.get("step"), int)
                out.append((line, row if ok else None))
            except ValueError:
                out.append((line, None))
    return out


def _key_sets_at(path: epath.Path, step: int) -> set[frozenset[str]]:
    return {frozenset(row) - {"step"} for _, row in _rows(path)
            if row is not None and row["step"] == step}


def _drop_rows(path: epath.Path, drop: Callable[[dict], bool]) -> int:
    """Move the rows ``drop`` picks (and cut lines) to ``metrics.discarded.jsonl``; the
    rewrite is atomic (tmp + rename), so a kill here loses no row."""
    kept, dropped = [], []
    for line, row in _rows(path):
        (dropped if row is None or drop(row) else kept).append(line)
    if dropped:
        with path.with_name("metrics.discarded.jsonl").open("a") as f:
            f.write("".join(line + "\n" for line in dropped))
        paths.write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(dropped)


def _drop_rows_after(path: epath.Path, last_kept: int) -> None:
    """Move rows of ``path`` whose step is after ``last_kept`` to ``metrics.discarded.jsonl``."""
    dropped = _drop_rows(path, lambda row: row["step"] > last_kept)
    if dropped:
        _log.warning("%s: %d rows after step %d came from a run that died before checkpointing "
                     "them; moved to metrics.discarded.jsonl", path, dropped, last_kept)


def _move_aside(path: Any) -> None:
    """``summary.json`` -> the first free ``summary.discarded[-n].json`` beside it."""
    if not path.exists():
        return
    stem, n = path.name.removesuffix(".json"), 1
    while (target := path.with_name(f"{stem}.discarded{'' if n == 1 else f'-{n}'}.json")).exists():
        n += 1
    path.rename(target)
    _log.warning("%s is an earlier run's (this run starts from step 0): moved to %s", path,
                 target)
