"""Collectives that run a function on every rank (or one) and fail together.

Trust boundary: the values of these collectives travel pickled between the ranks of one job,
which run the same code and trust each other (as ``torch.distributed.*_object`` do). Never
point them at bytes from outside the job; for that, :func:`distributed_ext.gather_bytes` and
:func:`distributed_ext.gather_state_dicts` never unpickle.

Cost: one collective round for the status records (2 KiB per rank) and, if every rank is ok,
one for the data.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distributed_ext import _agree, _watch, runtime

__all__ = ["all_reduce", "allgather", "allreduce", "broadcast", "broadcast_from", "master_only"]

_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])


def _check_label(label: object, what: str) -> None:
    if not isinstance(label, str):
        raise TypeError(f"{what}: label must be a str naming the call site, got "
                        f"{type(label).__name__}")


def _show(label: str) -> str:
    """A label for messages: clipped to 80 characters, lone surrogates escaped."""
    text = label if len(label) <= 80 else label[:77] + "..."
    return repr(text.encode("utf-8", "backslashreplace").decode("utf-8"))


def _require_group_if_launched(what: str) -> None:
    if runtime.is_distributed_launch():
        raise RuntimeError(
            f"{what}: this is a distributed launch (WORLD_SIZE={runtime._launch_world_size()}) "
            "but the process group is not set up; enter distributed_run() (or call "
            "torch.distributed.init_process_group) first, else each rank would run alone"
        )


def _run_and_pickle(fn: Callable[[], _V], label: str) -> tuple[_agree.Status, _V | None, bytes]:
    """Runs ``fn`` and pickles its value; a failure of either becomes the status.

    Every BaseException is caught: a KeyboardInterrupt, CancelledError or GeneratorExit that
    left this rank alone would leave its peers waiting in a round it never joins.
    """
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - carried to every rank, re-raised here
        return _agree.Status.failed(exc, label), None, b""
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001
        err = TypeError(
            f"the value returned by fn ({type(value).__name__}) does not pickle, and the "
            f"ranks exchange values pickled: {type(exc).__name__}: {exc}; return plain data "
            "(numbers, strings, lists, dicts, tensors) instead"
        )
        err.__cause__ = exc
        return _agree.Status.failed(err, label), None, b""
    return _agree.Status(label=label, fields=(len(payload),)), value, payload


# -- the data rounds (after every rank's status is agreed) ---------------------------------


def _allgather_payloads(payload: bytes, sizes: list[int], ctx: _agree.GroupContext,
                       what: str = "distributed_ext") -> list[bytes]:
    """All-gathers each rank's ``payload`` (``sizes`` agreed beforehand), padded to the largest."""
    longest = max(sizes) if sizes else 0
    if longest == 0:
        return [b"" for _ in sizes]
    buf = bytearray(longest)
    buf[: len(payload)] = payload
    mine = torch.frombuffer(buf, dtype=torch.uint8).to(ctx.device)
    out = [torch.empty_like(mine) for _ in sizes]
    work = dist.all_gather(out, mine, group=ctx.group, async_op=True)
    _watch.wait_work(work, ctx.ranks, f"{what} (data round)", ctx.device)
    return [bytes(_agree.tensor_bytes(t)[:n]) for t, n in zip(out, sizes)]


def _broadcast_payload(payload: bytes | None, nbytes: int, src: int, ctx: _agree.GroupContext,
                      what: str = "distributed_ext") -> bytes:
    """Broadcasts ``nbytes`` of ``payload`` from global rank ``src`` (None elsewhere)."""
    if nbytes == 0:
        return b""
    if payload is not None:
        t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(ctx.device)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    work = dist.broadcast(t, src=src, group=ctx.group, async_op=True)
    _watch.wait_work(work, ctx.ranks, f"{what} (data round)", ctx.device)
    return bytes(_agree.tensor_bytes(t))


def all_reduce(
    label: str,
    fn: Callable[[], _V],
    combine: Callable[[list[_V]], _V],
    group: dist.ProcessGroup | None = None,
) -> _V:
    """Return ``combine`` of every rank's ``fn()``, on every rank.

    ``combine`` takes the ranks' values in rank order and returns the one every rank gets, e.g.
    ``min`` for a batch size each rank's memory bounds. If ``fn`` raises on any rank, or
    returns a value that does not pickle, every rank raises instead of waiting in a gather
    that rank never joins, and every rank alike: if any rank's error is not a SystemExit, a
    rank with such an error raises its own and the others a RuntimeError naming the first one;
    else every rank exits, a rank that exited with its own SystemExit and the others with the
    first one's code. Ranks reducing different labels at the same point fail (RuntimeError on
    every rank, naming both labels and ranks). After any of these failures the group is still
    usable. In a single process ``fn`` runs alone; a rank of a launch whose process group is
    not set up yet raises RuntimeError instead.

    Values travel pickled between the ranks of one job (a trusted boundary; see the module).

    Memory at peak, on every rank: ``world`` x the largest rank's pickled value (the gather
    pads to it), on the group's device (host for gloo, the current GPU for NCCL), plus the
    unpickled values handed to ``combine``. Meant for small values, not tensors of GBs.

    Args:
        label: Names the call site; every rank must pass the same one at the same point.
        fn: Computes this rank's value.
        combine: Reduces the list of values (group rank order) to the result.
        group: The process group (default: the world); only its members call.

    Returns:
        ``combine([v_0, ..., v_{n-1}])``, the same on every rank.
    """
    _check_label(label, "all_reduce")
    if not runtime.is_initialized():
        _require_group_if_launched("all_reduce")
        return combine([fn()])
    ctx = _agree.resolve_group(group, "all_reduce")
    what = f"all_reduce({_show(label)})"
    with _watch.DeferredInterrupts():
        own, _, payload = _run_and_pickle(fn, label)
        statuses = _agree.exchange(own, ctx, what)
        other = next((i for i, s in enumerate(statuses) if not s.same_label(own)), None)
        if other is not None:
            raise RuntimeError(
                f"all_reduce: ranks reduce different labels at the same point: rank "
                f"{ctx.global_rank} {_show(label)}, rank {ctx.ranks[other]} "
                f"{_show(statuses[other].label)}; every rank must call all_reduce with the "
                "same label in the same order"
            )
        _agree.raise_first_failure(what, statuses, ctx, own)
        blobs = _allgather_payloads(payload, [s.fields[0] for s in statuses], ctx, what)
        values = [pickle.loads(b) for b in blobs]
    return combine(values)


def broadcast_from(
    label: str, fn: Callable[[], _V], rank: int = 0, group: dist.ProcessGroup | None = None
) -> _V:
    """Return ``fn()`` run on ``rank`` only, on every rank.

    For a value that depends on what each rank reads for itself (the environment, its GPU,
    files on its node), so that ranks computing it for themselves could disagree. If ``fn``
    raises, or returns a value that does not pickle, every rank raises instead of waiting in a
    broadcast ``rank`` never sends: ``rank`` its own error, the others a SystemExit with its
    code if that is what it was, else a RuntimeError naming it. A rank broadcasting another
    label than ``rank`` at the same point fails (after joining the data round, so the group
    stays usable); ``rank`` sees no other rank's label, and returns. Collective: every rank
    calls it at the same point, with the same ``rank``. In a single process ``fn`` runs alone;
    a rank of a launch whose process group is not set up yet raises instead.

    Values travel pickled between the ranks of one job (a trusted boundary; see the module).

    Memory at peak, on every rank: the pickled value twice (the bytes and the broadcast
    buffer, on the group's device) plus the unpickled value.

    Args:
        label: Names the call site; must match ``rank``'s label.
        fn: Computes the value; runs on ``rank`` only.
        rank: The global rank that runs ``fn``; must be a member of ``group``.
        group: The process group (default: the world); only its members call.

    Raises:
        ValueError: ``rank`` is not a member of ``group`` (on every rank, before any traffic).
    """
    _check_label(label, "broadcast_from")
    if not runtime.is_initialized():
        _require_group_if_launched("broadcast_from")
        if rank != 0:
            raise ValueError(f"broadcast_from: rank={rank} in a single process; only rank 0 exists")
        return fn()
    ctx = _agree.resolve_group(group, "broadcast_from")
    if isinstance(rank, bool) or not isinstance(rank, int) or ctx.group_rank_of(rank) is None:
        raise ValueError(
            f"broadcast_from: rank={rank!r} is not a member of the group (global ranks "
            f"{ctx.ranks}); pass the global rank of one of them"
        )
    what = f"broadcast_from({_show(label)})"
    with _watch.DeferredInterrupts():
        if ctx.global_rank == rank:
            own, value, payload = _run_and_pickle(fn, label)
            status = _agree.broadcast_status(own, rank, ctx, what)
            if not own.ok:
                assert own.exc is not None
                raise own.exc
            _broadcast_payload(payload, status.fields[0], rank, ctx, what)
            return value  # type: ignore[return-value]
        status = _agree.broadcast_status(None, rank, ctx, what)
        if status.kind == _agree.EXIT:
            raise SystemExit(status.code)
        if status.kind == _agree.ERROR:
            raise RuntimeError(
                f"broadcast_from({_show(status.label)}): rank {rank} failed with "
                f"{status.describe()}; every rank raises so that none waits in a broadcast that "
                "rank never sends"
            )
        blob = _broadcast_payload(None, status.fields[0], rank, ctx, what)
        if not status.same_label(_agree.Status(label=label)):
            raise RuntimeError(
                f"broadcast_from: rank {ctx.global_rank} broadcasts label {_show(label)} but rank "
                f"{rank} broadcasts {_show(status.label)} at the same point; every rank must call "
                "broadcast_from with the same label in the same order"
            )
        return pickle.loads(blob)


def allgather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gathers ``obj`` from every rank of ``group``, in group rank order, on every rank.

    A value that does not pickle fails on every rank alike. Values travel pickled (trusted,
    ranks of one job). ``[obj]`` in a single process.
    """
    if not runtime.is_initialized():
        return [obj]
    return all_reduce("distributed_ext.allgather", lambda: obj, list, group=group)


def _pairwise(tensor_op: Callable[[Any, Any], Any], scalar_op: Callable[[Any, Any], Any]
              ) -> Callable[[list[Any]], Any]:
    """Reduces a list left to right: element-wise for tensors, ``scalar_op`` otherwise."""

    def step(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return tensor_op(torch.as_tensor(a), torch.as_tensor(b))
        return scalar_op(a, b)

    return lambda values: functools.reduce(step, values)


_REDUCTIONS: dict[str, Callable[[list[Any]], Any]] = {
    "sum": _pairwise(torch.add, lambda a, b: a + b),
    "min": _pairwise(torch.minimum, lambda a, b: min(a, b)),
    "max": _pairwise(torch.maximum, lambda a, b: max(a, b)),
}


def allreduce(obj: Any, reduction: str = "sum", group: dist.ProcessGroup | None = None) -> Any:
    """Reduces ``obj`` over the ranks of ``group``, on every rank.

    ``"sum"`` adds (``+``); ``"min"`` and ``"max"`` take the smaller or larger value, and
    tensors reduce element-wise (``torch.minimum``/``torch.maximum``, broadcasting), so an
    amax tensor of many channels syncs channel by channel. Values travel pickled (trusted,
    ranks of one job). ``obj`` itself in a single process.

    Raises:
        ValueError: ``reduction`` is not ``"sum"``, ``"min"`` or ``"max"`` (on every rank,
            before any traffic).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"allreduce: reduction={reduction!r} is not supported; pass one of "
            f"{sorted(_REDUCTIONS)} (or use all_reduce() with your own combine)"
        )
    return _REDUCTIONS[reduction](allgather(obj, group=group))


def broadcast(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Returns global rank ``src``'s ``obj`` on every rank of ``group`` (others pass anything)."""
    if not runtime.is_initialized():
        return obj
    return broadcast_from("distributed_ext.broadcast", lambda: obj, rank=src, group=group)


def master_only(func: _F) -> _F:
    """Decorator: run ``func`` on the master (global rank 0) only and return its value everywhere.

    A failure of ``func`` on the master raises on every rank (see :func:`broadcast_from`).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return broadcast_from(
            f"master_only:{func.__qualname__}", lambda: func(*args, **kwargs), rank=0
        )

    return wrapper  # type: ignore[return-value]
