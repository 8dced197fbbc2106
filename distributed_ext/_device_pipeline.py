"""The NCCL path of gather_bytes: pinned host staging and device chunks, double-buffered.

Per step, every rank that still has bytes moves one chunk of at most ``chunk_bytes``:

    sender:  host segments --ByteSource.pack--> pinned[slot]
             --copy_async(H2D, side stream)--> dev[slot] --NCCL send-->
    dst:     --NCCL recv--> dev[slot, i] --copy_async(D2H, side stream)--> pinned[slot, i]
             --unpack_segments--> output bytearrays

Two slots: while step ``s`` is on the wire, the host packs (sender) or unpacks (dst) step
``s-1``/``s+1`` with the GIL released, and the side stream copies. Events order every reuse of
a slot after the work that last read it.

Memory: a sender holds ``2 x chunk`` device bytes and ``2 x chunk`` pinned bytes; dst holds
``2 x (world-1) x chunk`` of each. Device chunks are ordinary torch allocations, returned to
torch's caching allocator when the call ends. Pinned staging is leased from
:mod:`distributed_ext._staging` (its one cached buffer is reused across calls, because pinning
costs ~0.5 s per GiB; ``_staging.release_staging()`` frees it) and returned when the call
ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from distributed_ext import _agree, _native, _staging
from distributed_ext._source import ByteSource, byte_tensor

__all__ = ["DeviceGather", "roundtrip_through_device"]

def _steps(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


def stage_to_device(source: ByteSource, start: int, nbytes: int, pinned: torch.Tensor,
                    dev: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Source bytes -> pinned (native pack, GIL released) -> device (async on ``stream``).

    The caller keeps the source, ``pinned`` and ``dev`` alive until ``stream`` passes the copy.
    """
    source.pack(start, pinned[:nbytes])
    _native.copy_async(dev.data_ptr(), pinned.data_ptr(), nbytes, stream.cuda_stream)


def stage_to_host(dev: torch.Tensor, pinned: torch.Tensor, nbytes: int,
                  stream: torch.cuda.Stream) -> None:
    """Device -> pinned, async on ``stream``; the caller syncs before reading ``pinned``."""
    _native.copy_async(pinned.data_ptr(), dev.data_ptr(), nbytes, stream.cuda_stream)


def roundtrip_through_device(data: bytes, chunk: int, device: torch.device | None = None) -> bytearray:
    """host -> pinned -> device chunk -> pinned -> output, chunk by chunk (the pipeline as a component)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    out = _native.empty_bytearray(len(data))
    if not data:
        return out
    source = ByteSource([byte_tensor(memoryview(data))])
    dst = byte_tensor(out)
    c = min(chunk, len(data))
    dev = torch.empty(c, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    with _staging.acquire(2 * c) as pinned:
        pinned_in, pinned_out = pinned[:c], pinned[c:]
        for s in range(_steps(len(data), c)):
            start, n = s * c, min(c, len(data) - s * c)
            stage_to_device(source, start, n, pinned_in, dev, stream)
            stage_to_host(dev, pinned_out, n, stream)
            stream.synchronize()
            _native.copy_bytes(dst.data_ptr() + start, pinned_out.data_ptr(), n)
    return out


class DeviceGather:
    """One gather over an NCCL group; allocating happens in __init__ (the allocation round)."""

    def __init__(self, sizes: Sequence[int], ctx: _agree.GroupContext, dst_rank: int | None,
                 chunk: int) -> None:
        assert dst_rank is not None
        self.sizes = list(sizes)
        self.ctx = ctx
        self.dst_rank = dst_rank
        self.senders = [r for r in range(ctx.size) if r != dst_rank]
        sent = [self.sizes[r] for r in self.senders]
        # Never allocate a chunk larger than the largest payload: same answer on every rank.
        self.chunk = max(1, min(chunk, max(sent, default=0)))
        self.device = ctx.device  # the current GPU (gather_source's data context)
        self.on_progress: Callable[[int], None] | None = None
        self.stream = torch.cuda.Stream(self.device)
        self.steps = max((_steps(n, self.chunk) for n in sent), default=0)
        me = ctx.rank
        if me == dst_rank:
            rows = len(self.senders)
        else:
            rows = 1 if self.sizes[me] else 0
        self.lease = _staging.acquire(2 * rows * self.chunk)  # released when run() ends
        self.pinned = self.lease.tensor.view(2, rows, self.chunk)
        self.dev = torch.empty((2, rows, self.chunk), dtype=torch.uint8, device=self.device)

    def run(self, source: ByteSource, outputs: list[bytearray] | None,
            on_progress: Callable[[int], None] | None = None) -> None:
        """Moves the data; on dst, ``on_progress(bytes received from the others)`` per step."""
        self.on_progress = on_progress
        try:
            if self.ctx.rank == self.dst_rank:
                assert outputs is not None
                self._receive(source, outputs)
            else:
                self._send(source)
        finally:
            # No copy may still read or write the staging when its lease ends.
            torch.cuda.current_stream(self.device).synchronize()
            self.stream.synchronize()
            self.lease.release()

    def _send(self, source: ByteSource) -> None:
        nbytes = source.nbytes
        if nbytes == 0:
            return
        dst_global = self.ctx.ranks[self.dst_rank]
        h2d = [torch.cuda.Event(), torch.cuda.Event()]
        sent = [torch.cuda.Event(), torch.cuda.Event()]
        current = torch.cuda.current_stream(self.device)
        for s in range(_steps(nbytes, self.chunk)):
            slot = s % 2
            start, n = s * self.chunk, min(self.chunk, nbytes - s * self.chunk)
            h2d[slot].synchronize()  # pinned[slot] no longer read by its last H2D
            self.stream.wait_event(sent[slot])  # dev[slot] no longer read by its last send
            stage_to_device(source, start, n, self.pinned[slot, 0], self.dev[slot, 0],
                            self.stream)
            h2d[slot].record(self.stream)
            current.wait_event(h2d[slot])
            ops = [dist.P2POp(dist.isend, self.dev[slot, 0, :n], dst_global, self.ctx.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # the current stream waits for NCCL; the host does not
            sent[slot].record(current)

    def _receive(self, source: ByteSource, outputs: list[bytearray]) -> None:
        me = self.ctx.rank
        if source.nbytes:  # dst's own bytes never touch the device
            source.pack(0, byte_tensor(outputs[me]))
        self.done = 0  # progress counts the bytes from the other ranks
        out_ptrs = [byte_tensor(outputs[r]).data_ptr() if self.sizes[r] else 0
                    for r in self.senders]
        d2h = [torch.cuda.Event(), torch.cuda.Event()]
        received = [torch.cuda.Event(), torch.cuda.Event()]
        current = torch.cuda.current_stream(self.device)
        pending: list[tuple[int, list[tuple[int, int, int]]]] = []
        for s in range(self.steps):
            slot = s % 2
            current.wait_event(d2h[slot])  # dev[slot] no longer read by its last D2H
            ops, rows = [], []
            for i, r in enumerate(self.senders):
                start = s * self.chunk
                n = min(self.chunk, self.sizes[r] - start)
                if n <= 0:
                    continue  # that rank has finished: no traffic
                ops.append(dist.P2POp(dist.irecv, self.dev[slot, i, :n], self.ctx.ranks[r],
                                      self.ctx.group))
                rows.append((i, start, n))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            received[slot].record(current)
            self.stream.wait_event(received[slot])
            for i, _start, n in rows:
                stage_to_host(self.dev[slot, i], self.pinned[slot, i], n, self.stream)
            d2h[slot].record(self.stream)
            table = [(out_ptrs[i] + start, (slot * len(self.senders) + i) * self.chunk, n)
                     for i, start, n in rows]
            pending.append((slot, table))
            if len(pending) == 2:  # finish step s-1 while step s is in flight
                self._unpack(pending.pop(0), d2h)
        while pending:
            self._unpack(pending.pop(0), d2h)

    def _unpack(self, item: tuple[int, list[tuple[int, int, int]]],
                d2h: list[torch.cuda.Event]) -> None:
        slot, table = item
        d2h[slot].synchronize()
        _native.unpack_segments(self.pinned.view(-1), table)
        self.done += sum(n for _p, _o, n in table)
        if self.on_progress is not None:
            self.on_progress(self.done)
