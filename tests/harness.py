"""The one multi-rank harness: real processes on gloo, hard timeouts, stragglers killed by pid.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forkserver, with torch
and distributed_ext preloaded so each start costs milliseconds, not an import of torch), sets
up a gloo process group in each through a file rendezvous in a fresh temp dir, runs
``fn(*args)`` and returns one :class:`RankResult` per rank: the value, or the exception's type
and message, or the exit code, plus everything the rank wrote to stdout/stderr. A run that
passes ``timeout`` kills every rank still alive (SIGKILL by pid) and marks it ``timed_out``.

``fn`` must be importable by name (a module-level function of a test module).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "distributed_ext"]


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str = ""
    exit_code: int | None = None
    output: str = ""
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.timed_out and self.exit_code == 0

    def unwrap(self) -> Any:
        assert self.ok, f"rank {self.rank} did not succeed: {self}"
        return self.value


def _child(fn: Callable[..., Any], rank: int, world_size: int, tmpdir: str, args: tuple,
           env: dict[str, str], init: bool, pg_timeout: float) -> None:
    out_fd = os.open(os.path.join(tmpdir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.environ.update(env)
    result: dict[str, Any]
    code = 0
    try:
        import torch.distributed as dist

        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{os.path.join(tmpdir, 'rendezvous')}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
            # Every rank finishes connecting before any may exit: a rank that leaves early
            # would break a peer still inside connectFullMesh.
            dist.barrier()
        value = fn(*args)
        result = {"value": value}
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        result = {"exit": code}
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        code = 1
        result = {
            "error_type": type(exc).__name__,
            "error_message": str(exc),
            "traceback": traceback.format_exc(),
        }
    try:
        with open(os.path.join(tmpdir, f"rank{rank}.result.tmp"), "wb") as f:
            pickle.dump(result, f)
    except Exception as exc:  # an unpicklable value is a test bug: say so
        with open(os.path.join(tmpdir, f"rank{rank}.result.tmp"), "wb") as f:
            pickle.dump({"error_type": "HarnessError",
                         "error_message": f"result does not pickle: {exc}"}, f)
    os.replace(os.path.join(tmpdir, f"rank{rank}.result.tmp"),
               os.path.join(tmpdir, f"rank{rank}.result"))
    for stream in ("stdout", "stderr"):
        import sys

        getattr(sys, stream).flush()
    # Leave without atexit/destroy: a peer may have died, and teardown must not wait on it.
    os._exit(code)


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 60.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> list[RankResult]:
    """Runs ``fn(*args)`` in ``world_size`` real processes; see the module docstring.

    Args:
        fn: A module-level function; runs after the gloo group is set up (unless ``init`` is
            False).
        world_size: The number of ranks.
        timeout: Hard wall-clock limit for the whole run, in seconds.
        pg_timeout: The process group's own timeout, in seconds.
        init: Whether to set the gloo group up before calling ``fn``.
        env: Extra environment for every rank; ``rank_env`` per rank.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="dext-ranks-") as tmpdir:
        procs = []
        for r in range(world_size):
            child_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
            child_env.update(env or {})
            child_env.update((rank_env or {}).get(r, {}))
            p = ctx.Process(
                target=_child,
                args=(fn, r, world_size, tmpdir, args, child_env, init, pg_timeout),
                daemon=True,
            )
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        timed_out = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                timed_out.add(r)
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.join(10)
        results = []
        for r, p in enumerate(procs):
            res = RankResult(rank=r, exit_code=p.exitcode, timed_out=r in timed_out)
            out_path = os.path.join(tmpdir, f"rank{r}.out")
            if os.path.exists(out_path):
                with open(out_path, errors="replace") as f:
                    res.output = f.read()
            result_path = os.path.join(tmpdir, f"rank{r}.result")
            if os.path.exists(result_path):
                with open(result_path, "rb") as f:
                    data = pickle.load(f)  # written by our own child: trusted
                res.value = data.get("value")
                res.error_type = data.get("error_type")
                res.error_message = data.get("error_message")
                res.traceback = data.get("traceback", "")
            results.append(res)
        return results


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
