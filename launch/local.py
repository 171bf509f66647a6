"""Start one job as N JAX processes on this machine: a pod run rehearsed on a laptop.

  python launch/local.py --num_processes 2 --devices_per_process 4 -- \\
      main.py --config configs/sft_synthetic.py:smoke --workdir /tmp/w

Each process runs ``<this interpreter> <the args after -->`` with ``--config.distributed.*``
set for an explicit start (coordinator on a free localhost port, process ids 0..N-1). Where
there is no accelerator (``--platform cpu``, the default) each process gets
``--devices_per_process`` fake CPU devices. Every output line is prefixed with ``[pK]``. When a
process exits non-zero, the launcher names it, stops the others (every process group, the failed
one's too, so no orphans) and exits with its code (128 + n for a process killed by signal n). Ctrl-C, SIGTERM and SIGHUP (a CI cancel, ``timeout``, a closed
ssh connection) stop them all the same way, and the launcher exits with 130, 143 or 129. On Linux
each process also dies with the launcher (``PR_SET_PDEATHSIG``), so a launcher killed with
SIGKILL leaves no process holding devices; elsewhere only that last case leaves them running.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs first in each process, then execs the job: the kernel kills the process when the thread
# that started it (the launcher's main thread) ends, SIGKILL of the launcher included, which no
# handler sees. The parent-pid check covers a launcher that died before prctl ran.
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "PR_SET_PDEATHSIG = 1\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:\n"
    "    sys.exit(f'launch/local.py: prctl(PR_SET_PDEATHSIG) failed, errno {ctypes.get_errno()}')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('launch/local.py: the launcher is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def process_command(args: Sequence[str], process_id: int, num_processes: int,
                    coordinator: str) -> list[str]:
    """The command line of process ``process_id``: ``args`` with the distributed overrides,
    started (on Linux) through a step that ties the process's life to the launcher's."""
    command = [sys.executable, *args, "--config.distributed.initialize=explicit",
               f"--config.distributed.coordinator_address={coordinator}",
               f"--config.distributed.num_processes={num_processes}",
               f"--config.distributed.process_id={process_id}"]
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command]


def process_env(devices_per_process: int, platform: str) -> dict[str, str]:
    env = dict(os.environ)
    if platform == "cpu":
        env.pop("JAX_NUM_CPU_DEVICES", None)  # it would override the device count below
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(
            [*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _pump(proc: subprocess.Popen, tag: str, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    closed = False
    for line in iter(proc.stdout.readline, b""):
        if closed:  # keep draining: a full pipe would block the process for good
            continue
        with lock:
            try:
                sys.stdout.write(f"[{tag}] {line.decode(errors='replace')}")
                sys.stdout.flush()
            except OSError:  # the reader went away (``| head``)
                closed = True


def _killpg(p: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:  # the whole group exited since the poll
        pass


def stop_groups(procs: Sequence[subprocess.Popen], first: signal.Signals,
                grace_s: float) -> None:
    """Stop ``procs``, each the leader of its own session: ``first`` to every process group,
    up to ``grace_s`` for the leaders to exit, then SIGKILL to every group, whether its leader
    exited or not (its children, such as a reward pool, stay in the group and keep its id)
    and whether or not the wait was interrupted (a second Ctrl-C)."""
    try:
        for p in procs:
            _killpg(p, first)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            _killpg(p, signal.SIGKILL)
            p.wait()


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    stop_groups(procs, signal.SIGTERM, grace_s)


class _SignalledError(BaseException):
    """SIGTERM or SIGHUP reached the launcher; the processes are stopped like on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def _catch_signals() -> dict[int, object]:
    """Turn the first SIGTERM/SIGHUP into ``_SignalledError`` in the main thread (a second one,
    while the processes are being stopped, is ignored); returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not seen:
            seen.append(signum)
            raise _SignalledError(signum)

    return {s: signal.signal(s, handler) for s in _FORWARDED}


def launch(args: Sequence[str], num_processes: int, devices_per_process: int,
           platform: str = "cpu", poll_s: float = 0.2) -> int:
    """Run the processes to the end; the first non-zero exit code (0 when all succeed)."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = process_env(devices_per_process, platform)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    previous = _catch_signals()
    try:
        for i in range(num_processes):
            p = subprocess.Popen(process_command(args, i, num_processes, coordinator), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            pumps.append(threading.Thread(target=_pump, args=(p, f"p{i}", lock), daemon=True))
            pumps[-1].start()
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                print(f"launch/local.py: process {i} ended with {how}; stopping the others",
                      file=sys.stderr, flush=True)
                _stop(procs)
                return 128 - code if code < 0 else code  # a signal: the shell's 128 + n
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    except _SignalledError as e:
        _stop(procs)
        return 128 + e.signum
    finally:
        _stop(procs)
        for s, h in previous.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: launch/local.py [options] -- main.py --config CFG --workdir W [...]",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--devices_per_process", type=int, default=4)
    ap.add_argument("--platform", default="cpu", choices=("cpu", "native"),
                    help="cpu: fake CPU devices per process; native: leave devices to JAX")
    opts = ap.parse_args(argv[:split])
    if opts.num_processes < 1 or opts.devices_per_process < 1:
        print(f"error: --num_processes = {opts.num_processes} and --devices_per_process = "
              f"{opts.devices_per_process}: both must be >= 1", file=sys.stderr)
        return 2
    return launch(argv[split + 1:], opts.num_processes, opts.devices_per_process,
                  opts.platform)


if __name__ == "__main__":
    sys.exit(main())
