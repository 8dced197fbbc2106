"""The data round: each sender's messages streamed to dst while dst writes its own pieces
(every buffer allocated before, :mod:`transport.prepare`); a sender and dst's receiver are separate
paths that run on their own ranks. With every rank writing, each then writes its own long
runs (short ones go to dst, but a TP layout's rows: to their region's owner,
:mod:`plan.tp_regions`), and the blocks runs share go to their owners (:mod:`transport.shared_blocks`)."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext import _agree, _direct_io, _watch
from distributed_ext.export.plan.messages import Segment, _message_nbytes, _placement, _rows
from distributed_ext.export.transport import shared_blocks as _edges
from distributed_ext.export.transport.prepare import _Prepared
from distributed_ext.export.transport.stager import _Stager
from distributed_ext.export.transport.stop import StopSignal

EXPORT_CHUNK_BYTES = 16 * 2**20


def _write_own(stager: _Stager, sink: Any, messages: list[list[Segment]],
               middles: bool = False, stop: StopSignal | None = None) -> None:
    """Writes this rank's own pieces to the sink, message by message (:func:`plan_messages`):
    small pieces packed, so the files see one batch of runs per chunk, not one call per
    tensor; GPU bytes through the stager's pinned slot (never a whole block on the host).
    ``middles`` (``writers="all"``, the pieces it writes itself): only the whole aligned
    blocks inside each run; their ends are written by the blocks' owners (:mod:`transport.shared_blocks`).
    ``stop``: read between messages; once some rank failed, the rest is not written (no
    peer waits on these writes). A failure here is raised; the caller that holds it back
    for the agreeing round raises ``stop`` for the others.

    Host bytes are staged a message ahead of the write: the packing or computing of the
    next message overlaps the write of this one -- written by a native thread where the
    files are written direct (:func:`_write_queued`), else by a thread of ours
    (:func:`_write_staged_ahead`)."""
    if not messages:
        return
    write = sink.write_middles if middles else sink.write_batch
    if len(messages) > 1 and stager.link.type == "cpu" and stager.pinned is None:
        if getattr(sink, "takes_queue", False):
            _write_queued(stager, sink, write, messages, stop)
        else:
            _write_staged_ahead(stager, sink, write, messages, stop)
        return
    for message in messages:
        if stop is not None and stop.seen():
            return
        data, _keep = stager.stage(message, 0, _placement(sink, message))
        if stager.failure is not None:
            raise stager.failure
        write(data, _rows(message))


def _write_staged_ahead(stager: _Stager, sink: Any, write: Callable[..., None],
                        messages: list[list[Segment]], stop: StopSignal | None) -> None:
    """:func:`_write_own` with the writes in a thread of their own, one message behind the
    staging here: message ``k`` is staged into host slot ``k % 3`` while message ``k - 1``
    is written; the hand-over holds one message, so a slot is staged into again only once
    the write that read it has returned. Holds at most three messages' bytes (a computed
    message's own, or a slot)."""
    handed: queue.Queue = queue.Queue(maxsize=1)
    failed: list[BaseException] = []

    def writes() -> None:
        while True:
            item = handed.get()
            if item is None:
                return
            data, _keep, rows = item
            if failed:
                continue  # (the staging stops at its next message)
            try:
                write(data, rows)
            except BaseException as exc:  # noqa: BLE001 - raised by the staging thread
                failed.append(exc)

    writer = threading.Thread(target=writes, daemon=True, name="distributed_ext own writes")
    writer.start()
    try:
        for k, message in enumerate(messages):
            if failed or (stop is not None and stop.seen()):
                break
            data, keep = stager.stage(message, k % 3, _placement(sink, message))
            if stager.failure is not None:
                break
            handed.put((data, keep, _rows(message)))
    finally:
        handed.put(None)
        writer.join()
    if stager.failure is not None:
        raise stager.failure
    if failed:
        raise failed[0]


def _write_queued(stager: _Stager, sink: Any, write: Callable[..., None],
                  messages: list[list[Segment]], stop: StopSignal | None) -> None:
    """:func:`_write_staged_ahead` for a sink of files: the direct writes of each message
    queued to a native writer thread (:class:`~distributed_ext._direct_io.WriteQueue`)
    while the next is staged here, so that the disk never waits for the GIL between two
    writes (the rest -- a run's partial blocks, short runs -- is written here, through the
    page cache). Message ``k`` is staged into host slot ``k % 3`` once the writes of message
    ``k - 3`` (which read that slot) are done: at most three messages' bytes are held (a
    computed message's own, or a slot), as there. A failed write is raised here, after
    every queued write has ended."""
    stager.write_direct()  # (its slots in huge pages: few segments a write)
    queue = _direct_io.WriteQueue()
    # (the last ticket of each message whose writes may still run; the queue holds their
    # bytes until a wait covers it)
    pending: collections.deque[int] = collections.deque()
    try:
        for k, message in enumerate(messages):
            if stop is not None and stop.seen():
                break
            while len(pending) > 2:
                queue.wait(pending.popleft())  # its slot is free again
            data, _keep = stager.stage(message, k % 3, _placement(sink, message))
            if stager.failure is not None:
                break
            write(data, _rows(message), queue=queue)
            pending.append(queue.last)
        queue.wait()
    finally:
        queue.close()  # every queued write has ended before its bytes may go
    if stager.failure is not None:
        raise stager.failure


def _start_own_writes(writes: Callable[[], None], ctx: _agree.GroupContext,
                      stop: StopSignal | None, failures: list[BaseException], what: str
                      ) -> threading.Thread:
    """Starts ``writes()`` -- this rank's own pieces, which no peer waits on -- in a thread
    (on the rank's GPU where it has one). A failure there is appended to ``failures``, for
    the caller to raise once the thread is joined, and raises ``stop`` so that the other
    ranks' own writes stop too."""

    def run() -> None:
        try:
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)  # a new thread starts on GPU 0
            writes()
        except BaseException as exc:  # noqa: BLE001 - this rank's: raised by the caller
            failures.append(exc)
            if stop is not None:
                stop.post()

    thread = threading.Thread(target=run, daemon=True,
                              name=f"distributed_ext {what} (own pieces)")
    thread.start()
    return thread


# Buffers of transfers that were posted when a peer failed: the transport may still read or
# write them, so they are never freed (the group is unusable by then anyway).
_ABANDONED: list[Any] = []


def _transfer(state: dict[str, torch.Tensor], prepared: _Prepared, sink: Any,
              ctx: _agree.GroupContext, dst_rank: int, what: str,
              own_after: list[tuple[threading.Thread, list[BaseException]]] | None = None
              ) -> None:
    """Moves every piece to dst's sink: dst's own directly, the others' over the link.

    Each rank's pieces travel as the messages of :func:`plan_messages`: a large piece's from
    its own memory, small pieces packed by the compiled core into one chunk. The link carries
    host chunks on a CPU backend (gloo) and device chunks on NCCL; bytes that live elsewhere
    than the link wants cross over chunk by chunk (:class:`_Stager`): a GPU shard through
    pinned slots to gloo, a host shard through device slots to NCCL, and on dst a received
    device chunk through a pinned slot to the sink. No block is ever copied whole. Every
    buffer was allocated by :func:`_prepare_transfer`; the pinned ones are released here
    (kept forever where a peer failed with transfers posted).

    ``own_after``: on dst, where every message arrived and nothing failed, its own writes
    (a thread) are not waited for here but appended with their failures, and the buffers
    not released: the caller joins them, then calls ``prepared.release()``. So its shared
    blocks' exchange overlaps them, as a sender's does (the exchange after dst's own writes
    was a tenth of a fast FP8 export).
    """
    me = ctx.rank
    on_device = ctx.device.type == "cuda"
    if prepared.gpu_shards:
        # Our threads copy on their own (default) streams: whatever the caller's streams
        # still compute into the shards lands first.
        torch.cuda.synchronize()

    def body(_worker: Any) -> None:
        if on_device:
            torch.cuda.set_device(ctx.device)  # a new thread starts on GPU 0
        if me != dst_rank:
            _send()
        else:
            _receive()

    def _send() -> None:
        in_flight: collections.deque = collections.deque()  # two sends, with what they read
        stager = prepared.stager
        done = False

        def wait_oldest() -> None:
            work, _keep = in_flight.popleft()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - names the receiver
                _ABANDONED.append((in_flight, stager.abandon()))
                raise _watch.PeerFailure(ctx.ranks[dst_rank], exc) from exc

        try:
            for i, message in enumerate(prepared.messages):
                if len(in_flight) == 2:
                    wait_oldest()  # its slot is free again
                data, keep = stager.stage(message, i % 3)
                in_flight.append((dist.isend(data, ctx.ranks[dst_rank], group=ctx.group),
                                  keep))
            while in_flight:
                wait_oldest()
            if on_device:
                torch.cuda.current_stream(ctx.device).synchronize()  # every send has left
            done = True
        finally:
            if done:
                prepared.release()
        if stager.failure is not None:
            raise _watch.LocalFailure(stager.failure)

    def _receive() -> None:
        failures: list[BaseException] = []  # the first is raised; appended from two threads
        pinned, plans, free = prepared.pinned, prepared.plans, prepared.free

        def write(message: list[Segment], data: torch.Tensor) -> None:
            # A sink that fails (a full disk) stops writing, but dst keeps receiving, so no
            # sender is left blocked; the failure is raised once everything has arrived.
            if failures:
                return
            try:
                sink.write_batch(data, _rows(message))
            except BaseException as exc:  # noqa: BLE001
                failures.append(exc)
                if prepared.stop is not None:  # (the others' own writes stop)
                    prepared.stop.post()

        def write_own() -> None:
            _write_own(prepared.stager, sink, prepared.messages)
            _write_own(prepared.stager, sink, prepared.local_messages, middles=True,
                       stop=prepared.stop)

        # Two receives in flight per sender, each written as it lands, while a second thread
        # writes dst's own pieces: the link, the disk and the senders all keep busy.
        pending: dict[int, collections.deque] = {r: collections.deque() for r in plans}

        def post(r: int) -> None:
            while plans[r] and free[r]:
                message = plans[r].popleft()
                n = _message_nbytes(message)
                raw = free[r].pop()
                if on_device:
                    buf = raw[:n]
                else:
                    # Placed as aligned as its place in the file: written direct, no copy.
                    buf = _direct_io.place(raw, n, _placement(sink, message))
                work = dist.irecv(buf, ctx.ranks[r], group=ctx.group)
                pending[r].append((work, raw, buf, message))

        for r in plans:
            post(r)
        # (a failure there is raised after the others arrive)
        own = _start_own_writes(write_own, ctx, prepared.stop, failures, what)
        clean = handed = False
        try:
            while any(pending.values()):
                for r in plans:
                    if not pending[r]:
                        continue
                    work, raw, buf, message = pending[r].popleft()
                    try:
                        work.wait()
                    except BaseException as exc:  # noqa: BLE001 - names the sender
                        # Receives still posted keep writing into their buffers: keep them.
                        _ABANDONED.append((pending, free, pinned))
                        raise _watch.PeerFailure(ctx.ranks[r], exc) from exc
                    if on_device:
                        assert pinned is not None
                        host = pinned.view(1, buf.numel(), _placement(sink, message))
                        host.copy_(buf)  # stream-ordered after the receive; host waits
                        write(message, host)
                    else:
                        write(message, buf)
                    free[r].append(raw)
                    post(r)
            clean = True
            if own_after is not None and not failures:
                own_after.append((own, failures))  # (the caller joins it: the docstring)
                handed = True
        finally:
            if not handed:
                own.join()  # its writes end before anything closes the sink's files
                if clean:
                    prepared.release()
        if failures and not handed:
            raise _watch.LocalFailure(failures[0])

    _watch.run_watched(body, ctx.ranks, what)


def _write_data(state: dict[str, torch.Tensor], prepared: _Prepared, sink: Any,
                ctx: _agree.GroupContext, dst_rank: int, what: str
                ) -> BaseException | None:
    """The data round on this rank: its messages to dst (:func:`_transfer`); with
    ``writers="all"`` then its own runs written (a sender's, in a thread) while the shared
    blocks' fragments go to their owners (:func:`transport.shared_blocks.exchange`), and
    what it wrote made durable.

    Returns this rank's failure (a full disk, a piece that failed to read), for the caller
    to agree; raises :class:`~distributed_ext._watch.PeerFailure` for a peer's."""
    failure: BaseException | None = None

    def failed(exc: BaseException) -> None:
        nonlocal failure
        failure = failure or exc
        if prepared.stop is not None:
            prepared.stop.post()

    try:
        own: threading.Thread | None = None
        own_failures: list[BaseException] = []
        # (dst's own writes, where they go on past its receives: joined after the exchange)
        dst_own: list[tuple[threading.Thread, list[BaseException]]] = []
        try:
            _transfer(state, prepared, sink, ctx, dst_rank, what, dst_own)
            if prepared.local_messages and ctx.rank != dst_rank:  # (dst's: in _transfer)
                stager = prepared.start_local(state)
                # Its own runs, which no peer waits on, written in a thread while the shared
                # blocks' rounds below (which wait on every peer they meet) go on: one
                # rank's slower own writes no longer hold its peers' exchange up.
                own = _start_own_writes(
                    lambda: _write_own(stager, sink, prepared.local_messages, middles=True,
                                       stop=prepared.stop),
                    ctx, prepared.stop, own_failures, what)
        except _watch.PeerFailure:
            raise
        except BaseException as exc:  # noqa: BLE001 - this rank's: agreed by the caller
            failed(exc)
        try:
            edge_plan = prepared.edges
            # Its peers wait on this rank's fragments: it takes part whatever failed here
            # (writing nothing then; and nothing more once its own writes fail: ``stop``),
            # unless the group is gone (a rank found dead; asked only after a failure, as
            # posted_failure wants).
            if edge_plan is not None and edge_plan.stager is not None and \
                    (failure is None or _watch.posted_failure() is None):
                _edges.exchange(edge_plan, sink if failure is None else None, ctx, what,
                                prepared.stop)
        finally:
            if own is not None:
                own.join()  # its writes end before anything closes the sink's files
            for thread, failures in dst_own:
                thread.join()
                own_failures.extend(failures)
                prepared.release()  # (the buffers its writes read: _transfer's docstring)
            prepared.release_local()
        if own_failures:
            failed(own_failures[0])
        if failure is None and ctx.rank != dst_rank and sink is not None:
            sink.finish()
    except _watch.PeerFailure:
        raise
    except BaseException as exc:  # noqa: BLE001
        failed(exc)
    return failure
