"""gather_bytes: byte strings from every rank to one, never unpickled, in bounded memory.

The protocol, on every rank of the group:

1. Status round (all-gather of a 2 KiB record per rank): each rank's argument checks, its
   byte count, ``chunk_bytes`` and ``dst``. Any failure, or ranks disagreeing on ``dst`` or
   ``chunk_bytes``, raises on every rank before anything is allocated.
2. Allocation round (all-gather again): ``dst`` allocates the outputs, the NCCL path its
   staging and device chunks; an allocation failure (MemoryError, CUDA OOM) raises on every
   rank.
3. Data: only real bytes move, no padding and no traffic for a rank with nothing left.
   gloo: point-to-point sends of ``chunk_bytes`` views of the sender's own buffer straight
   into views of ``dst``'s output bytearrays, posted and waited for by a worker thread while
   the caller watches its peers (:mod:`distributed_ext._watch`): a peer that dies is named
   within seconds on every survivor. NCCL: see :mod:`distributed_ext._device_pipeline`.
4. Final round (all-gather again): a failure during the data phase -- a progress callback
   that raised on dst, an interrupt that arrived mid-transfer and waited for it to finish --
   makes every rank raise, so no rank returns while another fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext import _agree, _native, _watch, runtime
from distributed_ext._device_pipeline import DeviceGather
from distributed_ext._source import ByteSource, byte_tensor

__all__ = ["DEFAULT_CHUNK_BYTES", "GLOO_PIECE_BYTES", "ProgressCallback", "gather_bytes",
           "gather_source"]

DEFAULT_CHUNK_BYTES = 268435456  # 256 MiB

ProgressCallback = Callable[[int, int], None]
"""``progress(done, total)``: bytes received on dst from the other ranks so far, of ``total``."""

# On gloo there is no device memory for chunk_bytes to bound, and smaller pieces keep the
# transfer steady and the progress fine-grained (256 MiB pieces swung far more from call to
# call: docs/measurements.md).
GLOO_PIECE_BYTES = 16 * 2**20


def _as_byte_view(data: object) -> memoryview:
    """A flat, read-only byte view of ``data`` (no copy); TypeError naming the type otherwise."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"gather_bytes: data must be bytes, bytearray, memoryview or another contiguous "
            f"buffer, got {type(data).__name__}; encode it first (e.g. str.encode())"
        ) from None
    if not view.c_contiguous:
        raise TypeError(
            f"gather_bytes: data is a non-contiguous {type(data).__name__} buffer; pass "
            "bytes(data) or a contiguous copy"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"gather_bytes: {name} must be an int, got {type(value).__name__}")
    return value


def _check_args(dst: object, chunk_bytes: object, ctx: _agree.GroupContext) -> None:
    chunk = _check_int("chunk_bytes", chunk_bytes)
    if chunk <= 0 or chunk >= 2**62:  # the status record carries it as an int64
        raise ValueError(
            f"gather_bytes: chunk_bytes must be a positive number of bytes below 2**62, got "
            f"{chunk}; the default is {DEFAULT_CHUNK_BYTES} (256 MiB)"
        )
    d = _check_int("dst", dst)
    if ctx.group_rank_of(d) is None:
        raise ValueError(
            f"gather_bytes: dst={d} is not a member of the group (global ranks {ctx.ranks}); "
            "dst is a global rank, also for a subgroup"
        )


def allocate_outputs(sizes: Sequence[int], me: int) -> list[bytearray]:
    """dst's outputs, uninitialized: the ones the transport receives into advised to use
    transparent huge pages (the kernel's copy out of the socket fills them, 512x fewer page
    faults), dst's own copy of its bytes in ordinary pages. Why the two differ: this split ran at raw gloo's
    speed on a first call, where all in huge pages, all in 4 KiB pages or huge pages
    prefaulted by threads were slower (a user-space copy into fresh huge pages stalls on a
    VM whose freed memory is handed back to the host): docs/measurements.md."""
    return [_native.empty_bytearray(n, huge_pages=r != me) for r, n in enumerate(sizes)]


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, nbytes - start)) for start in range(0, nbytes, chunk)]


def _gather_gloo(source: ByteSource, sizes: Sequence[int], outputs: list[bytearray] | None,
                 dst: int, chunk: int, ctx: _agree.GroupContext, what: str,
                 on_progress: Callable[[int], None] | None) -> BaseException | None:
    """Chunks of the sender's bytes straight into views of dst's outputs (point-to-point).

    A chunk inside one of the sender's segments is sent as a view of it; one that straddles
    segments is packed into one of two staging chunks, so packing overlaps sending. The
    posting and waiting run in a worker thread (see :func:`_watch.run_watched`): every posted
    work is waited for on every path, a dead peer is named, and an interrupt waits for the
    transfer to finish.

    Returns:
        The progress callback's exception, if it raised (carried to the final round).
    """
    me = ctx.rank
    dst_rank = ctx.group_rank_of(dst)

    def send(worker: Any) -> None:
        # Every work is waited exactly once: a second wait() on a finished gloo send waits
        # for a completion that never comes.
        pending: list[Any] = []
        slot_work: list[Any] = [None, None]
        failure: BaseException | None = None

        def settle(work: Any) -> None:
            nonlocal failure
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - the first failure is raised below
                if failure is None:
                    failure = _watch.PeerFailure(dst, exc)

        staging: torch.Tensor | None = None
        packed = 0
        for i, (start, n) in enumerate(_chunks(source.nbytes, chunk)):
            if failure is not None:
                break  # the receiver is gone: nothing more would arrive
            piece = source.view(start, n)
            slot = -1
            if piece is None:
                if staging is None:
                    staging = torch.empty((2, min(chunk, source.nbytes)), dtype=torch.uint8)
                slot = packed % 2
                packed += 1
                if slot_work[slot] is not None:  # the staging slot's last send has left
                    settle(slot_work[slot])
                    slot_work[slot] = None
                    if failure is not None:
                        break
                piece = staging[slot, :n]
                source.pack(start, piece)
            work = dist.isend(piece, dst, group=ctx.group, tag=i)
            if slot >= 0:
                slot_work[slot] = work
            else:
                pending.append(work)
        for w in pending + [w for w in slot_work if w is not None]:
            settle(w)
        if failure is not None:
            raise failure

    def receive(worker: Any) -> None:
        assert outputs is not None
        works = []
        for r, nbytes in enumerate(sizes):
            if r == me or nbytes == 0:
                continue
            target = byte_tensor(outputs[r])
            works += [(dist.irecv(target[s : s + n], ctx.ranks[r], group=ctx.group, tag=i),
                       ctx.ranks[r], n) for i, (s, n) in enumerate(_chunks(nbytes, chunk))]
        # dst's own bytes: one native copy (GIL released) while the receives run; progress
        # counts only what arrives from the other ranks.
        if source.nbytes:
            source.pack(0, byte_tensor(outputs[me]))
        done = 0
        worker.report(done)
        failure: BaseException | None = None
        for w, src, n in works:
            try:
                w.wait()
            except BaseException as exc:  # noqa: BLE001 - keep waiting for the rest
                if failure is None:
                    failure = _watch.PeerFailure(src, exc)
                continue
            done += n
            worker.report(done)
        if failure is not None:
            raise failure

    body = send if me != dst_rank else receive
    return _watch.run_watched(body, ctx.ranks, what,
                              on_progress if me == dst_rank else None)


def gather_bytes(
    data: bytes | bytearray | memoryview,
    dst: int,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    progress: ProgressCallback | None = None,
) -> list[bytearray] | None:
    """Gathers byte strings to global rank ``dst`` only, without unpickling anything on the way.

    Unlike ``torch.distributed.gather_object`` it never runs pickle, and it moves
    ``chunk_bytes`` per rank at a time to bound device memory. Sizes may differ between ranks
    (0 included); only real bytes move. On gloo, where there is no device memory to bound,
    data moves in pieces of at most ``min(chunk_bytes, GLOO_PIECE_BYTES)`` (16 MiB).

    Collective: every rank of ``group`` calls it, with the same ``dst`` and ``chunk_bytes``
    (ranks that disagree raise ValueError, every one of them). Any failure on one rank -- a bad
    argument, an allocation that fails, a progress callback that raises on dst, a Ctrl-C that
    arrives mid-transfer (the posted transfers finish first) -- makes every rank raise (that
    rank its own error, the others a RuntimeError naming it), and the group stays usable. A
    rank that dies is named by every survivor within seconds (RuntimeError), whatever the group's timeout; the
    group is unusable after that.

    Memory at peak:
        gloo: ``dst`` holds the outputs (the sum of all sizes) and nothing else; a sender
        holds nothing beyond its own ``data`` (chunks are sent from views of it).
        Both: one waiting thread per call (its stack; it references the transfer's buffers
        until every posted work has completed).
        NCCL: ``dst`` holds the outputs, ``2 x world x chunk_bytes`` of device memory and as
        much pinned host staging; a sender ``2 x chunk_bytes`` of each. The pinned staging is
        kept in a bounded cache for the next call (pinning costs ~0.5 s/GiB); device chunks
        are freed on return (to torch's caching allocator).

    Args:
        data: This rank's bytes: bytes, bytearray, memoryview or any C-contiguous buffer.
        dst: The global rank that receives (a global rank also for a subgroup).
        group: The process group (default: the world); only its members call.
        chunk_bytes: Bytes per rank per transfer; a positive int, the same on every rank.
        progress: Called on dst only, as ``progress(done, total)`` with the bytes received
            from the other ranks so far (dst's own bytes are not counted), after every piece,
            from the calling thread; keyword-only, beyond the spec's signature. If it raises,
            it is not called again, the transfer completes, and the call fails on every rank
            (dst with that exception).

    Returns:
        On ``dst``, one bytearray per rank of ``group`` in group rank order; None elsewhere.

    Raises:
        TypeError: ``data`` is not a contiguous buffer, or ``dst``/``chunk_bytes`` not ints.
        ValueError: ``chunk_bytes`` not positive, or ``dst`` not in the group, or ranks disagree.
        RuntimeError: another rank failed (its rank and error are named).
    """

    def resolve_source() -> ByteSource:
        return ByteSource([byte_tensor(_as_byte_view(data))])

    return gather_source(resolve_source, dst, group, chunk_bytes, "gather_bytes", progress)


def gather_source(
    resolve_source: Callable[[], ByteSource],
    dst: int,
    group: dist.ProcessGroup | None,
    chunk_bytes: int,
    what: str,
    progress: ProgressCallback | None = None,
) -> list[bytearray] | None:
    """The collective behind gather_bytes, for any ByteSource.

    ``resolve_source`` runs inside the status round, so an exception it raises (a bad
    argument, a state that does not encode) is carried to every rank, which all raise.
    """
    if not runtime.is_initialized():
        ctx = _agree.GroupContext(None, 0, [0], torch.device("cpu"))
        _check_args(dst, chunk_bytes, ctx)
        return [resolve_source().to_bytearray()]

    ctx = _agree.resolve_group(group, what)
    with _watch.DeferredInterrupts() as deferred:
        return _gather_agreed(resolve_source, dst, chunk_bytes, ctx, what, deferred, progress)


def _gather_agreed(resolve_source: Callable[[], ByteSource], dst: int, chunk_bytes: int,
                   ctx: _agree.GroupContext, what: str, deferred: _watch.DeferredInterrupts,
                   progress: ProgressCallback | None) -> list[bytearray] | None:
    """The rounds of the collective; see the module docstring."""
    # Round 1: arguments and sizes. Any failure (BaseException too) is carried to every rank.
    held: dict[str, Any] = {}

    def resolve_sizes() -> tuple[int, ...]:
        _check_args(dst, chunk_bytes, ctx)
        held["source"] = source = resolve_source()
        return (source.nbytes, chunk_bytes, dst)

    statuses = _agree.agree(what, ctx, resolve_sizes)
    source = held["source"]
    sizes = [s.fields[0] for s in statuses]
    for name, index in (("chunk_bytes", 1), ("dst", 2)):
        values = [s.fields[index] for s in statuses]
        if len(set(values)) > 1:
            listing = ", ".join(f"rank {ctx.ranks[i]}: {v}" for i, v in enumerate(values))
            raise ValueError(f"{what}: ranks passed different {name} ({listing}); every "
                             f"rank must pass the same {name}")
    chunk = int(chunk_bytes)
    dst_rank = ctx.group_rank_of(int(dst))

    # Round 2: allocation, which can fail on one rank only. On a group with NCCL (alone or
    # as cpu:gloo,cuda:nccl) data moves through the device; this round then runs on NCCL too,
    # so that every rank joins the communicator's creation before the point-to-point steps.
    data_ctx = ctx
    if _agree.group_has_nccl(ctx.group):
        data_ctx = dataclasses.replace(ctx, device=torch.device("cuda",
                                                                 torch.cuda.current_device()))

    def allocate() -> None:
        interrupted = deferred.take()  # an interrupt during round 1 fails the call here
        if interrupted is not None:
            raise interrupted
        if ctx.rank == dst_rank:
            held["outputs"] = allocate_outputs(sizes, ctx.rank)
        if data_ctx.device.type == "cuda":
            held["pipeline"] = DeviceGather(sizes, data_ctx, dst_rank, chunk)

    _agree.agree(what, ctx, allocate, stage="allocating", via=data_ctx)
    outputs: list[bytearray] | None = held.get("outputs")
    pipeline = held.get("pipeline")

    # Data. Progress is reported on dst only; a callback that raises is not called again and
    # its exception fails the call on every rank in the final round, after the transfer.
    total = sum(sizes) - sizes[dst_rank]
    on_progress = None if progress is None else (lambda done: progress(done, total))
    callback_error: BaseException | None = None
    try:
        if pipeline is not None:
            callback_error = _run_pipeline(pipeline, source, outputs, on_progress)
        else:
            callback_error = _gather_gloo(source, sizes, outputs, int(dst),
                                          min(chunk, GLOO_PIECE_BYTES), ctx, what, on_progress)
    except _watch.PeerFailure as exc:
        raise _agree.peer_failure_error(what, exc) from exc.cause

    # Final round: every rank learns whether the data phase failed anywhere (a callback on
    # dst, an interrupt that waited for the transfer to finish), so all raise or none does.
    _agree.agree(what, ctx, failure=callback_error or deferred.take(), stage="transfer")
    return outputs


def _run_pipeline(pipeline: Any, source: ByteSource, outputs: list[bytearray] | None,
                  on_progress: Callable[[int], None] | None) -> BaseException | None:
    """Runs the NCCL pipeline in this thread; a progress callback's exception is returned."""
    errors: list[BaseException] = []

    def safe(done: int) -> None:
        if on_progress is not None and not errors:
            try:
                on_progress(done)
            except BaseException as exc:  # noqa: BLE001 - carried to the final round
                errors.append(exc)

    pipeline.run(source, outputs, safe)
    return errors[0] if errors else None
