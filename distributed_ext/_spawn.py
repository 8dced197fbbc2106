"""Local ranks: the one spawner of the CLI, the benchmarks, the example and the tests.

``run_local(fn, world, *args)`` starts ``world`` real processes, sets up a gloo process group
in each through a file rendezvous in a fresh temp dir, runs ``fn(*args)`` there and returns one
:class:`RankOutcome` per rank: its value, or its exception's type, message and traceback, or
its exit code, plus what it printed (when captured). It never hangs: past ``timeout`` every
rank still alive is SIGKILLed by pid; with ``stop_on_sigint`` a Ctrl-C stops every rank (the
ranks ignore SIGINT themselves, so none dies half-way through a collective on its own); and a
rank dies with the spawner (Linux ``PR_SET_PDEATHSIG``), so none outlives it.

Like torchrun, it gives each rank one intra-op thread (``OMP_NUM_THREADS=1``) where there are
several and the spawner's environment does not set it; ``OMP_NUM_THREADS`` (there, or in
``env``) is applied to torch in each rank. Processes start from a forkserver that has imported
torch and distributed_ext once, so a rank starts in milliseconds. ``fn`` must be importable
by name (a module-level function). Values travel back pickled through a file the rank
writes: they come from our own child processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed_ext._atomic import replacing

__all__ = ["RankOutcome", "run_local"]

PRELOAD = ("torch", "torch.distributed", "distributed_ext")
# ... and transformers' modeling code, for ranks that build or read transformers models: one
# import in the forkserver, shared by the forked ranks (each rank's own costs seconds of CPU).
TRANSFORMERS_PRELOAD = (*PRELOAD, "transformers", "transformers.modeling_utils")


@dataclass
class RankOutcome:
    """What one local rank did."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str = ""
    exit_code: int | None = None
    output: str = ""
    timed_out: bool = False
    interrupted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.error_type is None and not self.timed_out and not self.interrupted
                and self.exit_code == 0)

    def describe(self) -> str:
        if self.interrupted:
            return f"rank {self.rank}: stopped by Ctrl-C"
        if self.timed_out:
            return f"rank {self.rank}: killed after the timeout"
        if self.error_type is not None:
            return f"rank {self.rank}: {self.error_type}: {self.error_message}"
        return f"rank {self.rank}: exit code {self.exit_code}"


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the spawner dies (no orphans, even on SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(fn: Callable[..., Any], rank: int, world: int, tmpdir: str, args: tuple,
           env: dict[str, str], init: bool, pg_timeout: float, capture: bool,
           ignore_sigint: bool) -> None:
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if capture:
        out_fd = os.open(os.path.join(tmpdir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
    os.environ.update(env)
    code = 0
    try:
        import torch
        import torch.distributed as dist

        # torch sized its thread pool in the forkserver, before this rank's environment
        # existed: OMP_NUM_THREADS applies only through set_num_threads now.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))

        if init:
            dist.init_process_group(
                "gloo", init_method=f"file://{os.path.join(tmpdir, 'rendezvous')}", rank=rank,
                world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
            # Every rank finishes connecting before any may exit: a rank that leaves early
            # would break a peer still inside connectFullMesh.
            dist.barrier()
        result: dict[str, Any] = {"value": fn(*args)}
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        result = {"exit": code}
    except BaseException as exc:  # noqa: BLE001 - everything is reported, KeyboardInterrupt too
        code = 1
        result = {"error_type": type(exc).__name__, "error_message": str(exc),
                  "traceback": traceback.format_exc()}
    path = os.path.join(tmpdir, f"rank{rank}.result")
    try:
        with replacing(path) as f:
            pickle.dump(result, f)
    except Exception as exc:  # noqa: BLE001 - an unpicklable value is the caller's bug: say so
        with replacing(path) as f:
            pickle.dump({"error_type": "SpawnError",
                         "error_message": f"the value of fn does not pickle: {exc}"}, f)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _release_semaphores()
    # Leave without atexit or destroy_process_group: a peer may have died, and teardown
    # must not wait on it.
    os._exit(code)


def _release_semaphores() -> None:
    """Unlinks the named semaphores this rank made through ``multiprocessing`` (tqdm's write
    lock, which transformers' and ModelOpt's saves create, is one), as their finalizers would
    at a normal exit: ``os._exit`` skips those, and the spawner's resource tracker then
    reports them leaked when it shuts down. Only those finalizers run (none waits on
    anything); nothing else of multiprocessing's exit."""
    with contextlib.suppress(Exception):
        from multiprocessing import synchronize, util

        cleanup = synchronize.SemLock._cleanup
        for finalizer in list(util._finalizer_registry.values()):
            if getattr(finalizer, "_callback", None) is cleanup:
                finalizer()


_contexts: dict[tuple[str, ...], multiprocessing.context.BaseContext] = {}


def _context(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    key = tuple(preload)
    if key not in _contexts:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _contexts[key] = ctx
    return _contexts[key]


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(10)


def run_local(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 3600.0,
    pg_timeout: float = 600.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    capture_output: bool = True,
    stop_on_sigint: bool = False,
    preload: Sequence[str] = PRELOAD,
    on_start: Callable[[list[int]], None] | None = None,
) -> list[RankOutcome]:
    """Runs ``fn(*args)`` in ``world`` local ranks on gloo; see the module docstring.

    Args:
        fn: A module-level function, run after the gloo group is set up (unless ``init`` is
            False).
        world: The number of ranks.
        timeout: Hard wall-clock limit for the whole run, in seconds.
        pg_timeout: The process group's own timeout, in seconds.
        init: Whether to set the gloo group up before calling ``fn``.
        env: Extra environment for every rank; ``rank_env`` per rank.
        capture_output: Collect each rank's stdout/stderr into its outcome (else they go to
            the spawner's terminal).
        stop_on_sigint: The ranks ignore SIGINT; a Ctrl-C in the spawner kills every rank
            and marks it ``interrupted``.
        preload: Modules the forkserver imports once for every rank.
        on_start: Called with the ranks' pids once they have all started.

    Returns:
        One RankOutcome per rank, in rank order.
    """
    ctx = _context(preload)
    interrupted = threading.Event()
    previous = None
    if stop_on_sigint and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        # As torchrun does: ranks sharing a host's cores take one thread each unless the
        # spawner's environment says otherwise (two each on two cores spin against each
        # other: an export took twice as long). Passed on: the forkserver's environment is older.
        threads = os.environ.get("OMP_NUM_THREADS") or ("1" if world > 1 else "")
        base_env = {"GLOO_SOCKET_IFNAME": "lo"}
        if threads:
            base_env["OMP_NUM_THREADS"] = threads
        with tempfile.TemporaryDirectory(prefix="dext-ranks-") as tmpdir:
            procs = []
            for r in range(world):
                child_env = dict(base_env)
                child_env.update(env or {})
                child_env.update((rank_env or {}).get(r, {}))
                p = ctx.Process(target=_child, daemon=True,
                                args=(fn, r, world, tmpdir, args, child_env, init, pg_timeout,
                                      capture_output, stop_on_sigint))
                p.start()
                procs.append(p)
            try:
                if on_start is not None:
                    on_start([p.pid for p in procs])
                deadline = time.monotonic() + timeout
                while any(p.is_alive() for p in procs):
                    if interrupted.is_set() or time.monotonic() > deadline:
                        break
                    sentinels = [p.sentinel for p in procs if p.is_alive()]
                    multiprocessing.connection.wait(sentinels, timeout=0.1)
            except BaseException:
                # Leaving early (SIGTERM turned SystemExit, Ctrl-C): no rank outlives us, and
                # none is left writing into the directory about to be removed.
                _kill(procs)
                raise
            alive = {r for r, p in enumerate(procs) if p.is_alive()}
            _kill(procs)
            return [_collect(r, p, tmpdir, r in alive and not interrupted.is_set(),
                             r in alive and interrupted.is_set()) for r, p in enumerate(procs)]
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _collect(rank: int, proc: Any, tmpdir: str, timed_out: bool, interrupted: bool) -> RankOutcome:
    res = RankOutcome(rank=rank, exit_code=proc.exitcode, timed_out=timed_out,
                      interrupted=interrupted)
    out_path = os.path.join(tmpdir, f"rank{rank}.out")
    if os.path.exists(out_path):
        with open(out_path, errors="replace") as f:
            res.output = f.read()
    result_path = os.path.join(tmpdir, f"rank{rank}.result")
    if os.path.exists(result_path):
        with open(result_path, "rb") as f:
            data = pickle.load(f)  # written by our own child process: trusted
        res.value = data.get("value")
        res.error_type = data.get("error_type")
        res.error_message = data.get("error_message")
        res.traceback = data.get("traceback", "")
    return res
