"""Process state: where this process stands in a run, and owning the run's process group.

Everything here reads state; nothing initializes CUDA, NCCL or a process group at import.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from distributed_ext import _watch

__all__ = [
    "DistributedState",
    "abort",
    "backend",
    "barrier",
    "distributed_run",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_initialized",
    "is_master",
    "rank",
    "size",
]


def is_available() -> bool:
    """Returns whether the distributed package is available."""
    return dist.is_available()


def is_initialized() -> bool:
    """Returns whether the distributed package is initialized."""
    return dist.is_available() and dist.is_initialized()


def backend() -> str | None:
    """Returns the distributed backend: ``"torch"`` while torch.distributed is initialized, else None.

    This is the spec's source library's answer (it names the framework, not gloo/NCCL), kept so
    ported code keeps working; ``torch.distributed.get_backend()`` names the transport.
    """
    return "torch" if is_initialized() else None


def size(group: dist.ProcessGroup | None = None) -> int:
    """Returns the number of processes (of ``group``, default the world); 1 in a single process."""
    return dist.get_world_size(group=group) if is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """Returns the rank of the current process (in ``group``); 0 in a single process."""
    return dist.get_rank(group=group) if is_initialized() else 0


def is_master(group: dist.ProcessGroup | None = None) -> bool:
    """Returns whether the current process is the master process (rank 0 of ``group``)."""
    return rank(group) == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Synchronizes all processes (of ``group``); a no-op in a single process."""
    if is_initialized():
        dist.barrier(group=group)


def _launch_world_size() -> int:
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return 1
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"is_distributed_launch: WORLD_SIZE={raw!r} is not an integer; a launcher such as "
            "torchrun sets it to the number of ranks -- unset it or set it to a whole number"
        ) from None
    if value < 1:
        raise ValueError(
            f"is_distributed_launch: WORLD_SIZE={raw!r} must be at least 1; unset it for a "
            "single process"
        )
    return value


def is_distributed_launch() -> bool:
    """True if launched distributed (WORLD_SIZE>1), readable BEFORE the process group is set up.

    Env-based, so parse-time code can detect the launch mode before :func:`distributed_run` sets
    the process group up. Once it has, :func:`is_distributed_run` reads the live group.

    Raises:
        ValueError: WORLD_SIZE is set but is not a positive integer.
    """
    return _launch_world_size() > 1


def is_distributed_run() -> bool:
    """True if a real multi-rank job is running: the process group is initialized and world size > 1.

    Runtime state (checks the live process group), unlike :func:`is_distributed_launch`. A
    single process or a 1-rank group returns False. Backend-agnostic.
    """
    return is_initialized() and dist.get_world_size() > 1


@dataclass
class DistributedState:
    """This process's place in a run: its rank, the run's size, and the device it computes on.

    :func:`distributed_run` yields it, for a single process too (rank 0 of a run of one).
    """

    rank: int
    world_size: int
    device: torch.device | str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that writes the run's outputs."""
        return self.rank == 0


def abort(code: int = 1) -> NoReturn:
    """Leaves the process now, without touching the process group.

    Prints the exception being handled (if any) with its traceback, flushes stdout and stderr,
    and ``os._exit(code)``. Destroying the group, or running atexit handlers that do, could
    wait forever on peers sitting in a collective this rank never reaches; the launcher sees
    the exit and tears the job down.
    """
    exc = sys.exc_info()[1]
    prefix = f"[rank {rank()}] " if is_initialized() else ""
    if exc is not None:
        sys.stderr.write(f"{prefix}distributed_ext.abort: exiting with code {code} after:\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    else:
        sys.stderr.write(f"{prefix}distributed_ext.abort: exiting with code {code}\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"distributed_run: LOCAL_RANK={raw!r} is not an integer") from None


@contextlib.contextmanager
def distributed_run(
    timeout: datetime.timedelta | None = None, device: torch.device | str = "cuda"
) -> Iterator[DistributedState]:
    """Own the run's process group for the block, and yield this process's state.

    On a distributed launch (WORLD_SIZE>1) on a machine with GPUs this binds this rank's CUDA
    device (``cuda:LOCAL_RANK``), and sets the process group up (``cpu:gloo,cuda:nccl``, so
    CPU and CUDA collectives both work) with ``timeout`` unless the caller set one up already.
    It yields this rank's :class:`DistributedState` on that CUDA device, and refuses any other
    device with a ValueError. On a launch where torch sees no GPU (a CPU-only machine, or a
    CPU build of torch) the run is a CPU one: the group is gloo, the state is on the CPU, and
    ``device`` may be ``"cuda"`` (the default, which has nothing to bind) or ``"cpu"``. Either
    way this rank's liveness heartbeat starts with the group (see
    :mod:`distributed_ext._watch`), so a rank that dies is named by its peers even before
    its first collective. Without a launch it sets nothing up and the state is on ``device``
    -- except a CUDA device where torch sees no GPU: the state is then on the CPU, with a
    warning that says so (pass ``device="cpu"`` for a CPU run).
    The state's rank and size are always the live group's: rank 0 of a run of one
    for a single process, and this rank's place in a group the caller set up.

    On exit, even if the body raises, it destroys the group the run set up: the launch's, or
    one the body set up. A group that was already there when the run began is the caller's
    and is left as it is. A rank whose body raised (other than SystemExit) in a run of several
    ranks exits through :func:`abort` instead (traceback printed, exit code 1).

    Args:
        timeout: The process group's timeout when this run sets it up (torch's default if None).
        device: The device to compute on; on a launch it must be a CUDA device (or the CPU
            where torch sees no GPU).

    Yields:
        This process's DistributedState.
    """
    had_group = is_initialized()
    if is_distributed_launch():
        requested = torch.device(device)
        run_device: torch.device | str
        if torch.cuda.is_available():
            if requested.type != "cuda":
                raise ValueError(
                    f"distributed_run: device={str(device)!r} on a distributed launch "
                    f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}) on a machine with GPUs; a "
                    "launched rank computes on its own GPU, cuda:LOCAL_RANK -- pass "
                    "device='cuda' (or run without a launcher for a CPU run)"
                )
            local_rank = _local_rank()
            torch.cuda.set_device(local_rank)
            run_device, pg_backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"
        else:
            if requested.type not in ("cuda", "cpu"):
                raise ValueError(
                    f"distributed_run: device={str(device)!r} on a distributed launch without "
                    "GPUs; a launched rank computes on the CPU here -- pass device='cpu' or "
                    "leave the default"
                )
            run_device, pg_backend = torch.device("cpu"), "gloo"
        if not had_group:
            kwargs = {} if timeout is None else {"timeout": timeout}
            dist.init_process_group(backend=pg_backend, **kwargs)
        _watch.ensure_heartbeat()
    else:
        run_device = device
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            # A single process on a machine (or a torch build) without GPUs: a CPU run, as
            # on a launch without GPUs -- not a state whose first tensor fails.
            warnings.warn(
                f"distributed_run: device={str(device)!r}, but torch sees no GPU here (a "
                "CPU build of torch, or no GPU); the state is on the CPU. Pass "
                "device='cpu' to say so (and silence this)", stacklevel=3)
            run_device = torch.device("cpu")
    try:
        state = DistributedState(rank=rank(), world_size=size(), device=run_device)
        yield state
    except SystemExit:
        raise
    except BaseException:
        if is_distributed_run():
            abort(1)
        raise
    finally:
        if not had_group and is_initialized():
            dist.destroy_process_group()
