"""The one multi-rank harness of the tests, on the package's own spawner.

``run_ranks(fn, world_size, *args)`` runs ``fn(*args)`` in ``world_size`` real processes on
gloo (:func:`distributed_ext._spawn.run_local`: forkserver with torch preloaded, a file
rendezvous in a fresh temp dir, a hard timeout, stragglers SIGKILLed by pid) and returns one
:class:`RankResult` per rank: the value, or the exception's type and message, or the exit
code, plus everything the rank wrote to stdout/stderr.

``fn`` must be importable by name (a module-level function of a test module).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from distributed_ext._spawn import PRELOAD as SPAWN_PRELOAD
from distributed_ext._spawn import TRANSFORMERS_PRELOAD, run_local
from distributed_ext._spawn import RankOutcome as RankResult

__all__ = ["REPO", "RankResult", "assert_all_ok", "free_port", "nccl_group_of_one", "outcome",
           "read_rss", "rename_failing_at", "rss_growth_during", "run_command", "run_ranks",
           "run_torchrun"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 90.0,
              pg_timeout: float = 60.0, init: bool = True, env: dict[str, str] | None = None,
              rank_env: dict[int, dict[str, str]] | None = None) -> list[RankResult]:
    """Runs ``fn(*args)`` in ``world_size`` real processes; see the module docstring."""
    # One thread per rank: tests run many ranks on few cores.
    return run_local(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, init=init,
                     env={"OMP_NUM_THREADS": "1", **(env or {})}, rank_env=rank_env,
                     preload=PRELOAD)


# What the ranks' forkserver imports once: transformers' modeling code too where it is
# installed (most multi-rank tests build models with it).
PRELOAD = TRANSFORMERS_PRELOAD if importlib.util.find_spec("transformers") else SPAWN_PRELOAD


@contextlib.contextmanager
def nccl_group_of_one(path: str) -> Iterator[None]:
    """An NCCL process group of world 1 for the block (NCCL refuses two ranks on one GPU)."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def outcome(call: Any) -> tuple:
    """``("ok",)``, or ``("raised", type name, message)`` of what ``call()`` raised here (a
    rank's result the test asserts on)."""
    try:
        call()
        return ("ok",)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("raised", type(exc).__name__, str(exc))


def rename_failing_at(n: int, error: OSError) -> Any:
    """A stand-in for ``os.rename`` whose ``n``-th call raises ``error`` (the others rename)."""
    real, calls = os.rename, []

    def rename(a: Any, b: Any) -> None:
        calls.append(1)
        if len(calls) == n:
            raise error
        real(a, b)

    return rename


def read_rss() -> int:
    """This process's resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_growth_during(fn: Any, trim: bool = False) -> int:
    """The peak growth of this process's RSS while ``fn()`` runs (sampled every 5 ms).
    ``trim``: first hand the C heap's free memory back (glibc ``malloc_trim``), so that what
    ``fn`` allocates shows as growth rather than reusing what earlier work freed."""
    import threading

    if trim:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak, stop = [read_rss()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak.append(read_rss())

    before = read_rss()
    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return max(peak) - before


def run_command(args: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """Runs a command that starts its own ranks (torchrun, a local spawner) in a new session.

    On timeout the whole process group is SIGKILLed, so no rank it started outlives the test,
    and the test fails with the output so far.
    """
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{args} ran past {timeout} s; killed its process group\n"
                             f"{err[-3000:]}") from None
    finally:
        # Stragglers of a finished launcher (same group) are killed too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 300
                 ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc <args>`` on a free local port (gloo over loopback),
    through :func:`run_command`: its whole process group is killed on timeout."""
    return run_command(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--master-port", str(free_port()), *args],
        timeout=timeout, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )


def free_port() -> int:
    """A TCP port free on localhost right now (for a launcher's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_all_ok(results: list[RankResult]) -> list[Any]:
    """Asserts every rank succeeded; returns the values in rank order."""
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(
        f"rank {r.rank}: exit={r.exit_code} timed_out={r.timed_out} "
        f"{r.error_type}: {r.error_message}\n{r.traceback}\n{r.output[-2000:]}" for r in bad
    )
    return [r.value for r in results]
