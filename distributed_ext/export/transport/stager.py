"""A rank's pieces as the bytes of its messages, on the device the link wants: views of
their own memory, packed by the compiled core, or copied through pinned or device slots."""

from __future__ import annotations

import array
import math

import torch
import torch.nn as nn

from distributed_ext import _direct_io, _native, _staging
from distributed_ext.export.plan.entries import _local
from distributed_ext.export.plan.messages import Segment, _message_nbytes, pack_cap
from distributed_ext.export.plan.types import Entry, Piece


def _piece_tensor(state: dict[str, torch.Tensor], entry: Entry, piece: Piece) -> torch.Tensor:
    """A piece's elements as a contiguous tensor, in the written tensor's row-major order, on
    the device they live on: the local block itself where the piece is all of it, a view
    where they are contiguous in it, else one contiguous copy of the piece (never of more).
    A computed piece (``entry.transform``): the block it is computed from, as such a tensor
    (:func:`_computed_bytes` computes the bytes). A saved checkpoint's source
    (:class:`~distributed_ext.export.files.saved.SavedSource`) is sliced alike: its
    ``__getitem__`` reads the box from its file."""
    t = _local(state[piece.source or entry.source])
    if t.requires_grad:
        t = t.detach()
    if piece.local is not None:
        t = t[piece.local]
        if piece.perm is not None:
            t = t.permute(piece.perm)
        t = t.reshape((piece.block if piece.src is None else piece.src).shape)
    return t if t.is_contiguous() else t.contiguous()


def _computed_bytes(source: torch.Tensor, entry: Entry, piece: Piece, s: int, n: int,
                    shift: int | None = None, into: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Bytes ``s .. s + n`` of a computed piece, computed from only the rows of its source
    block (``source``) that make them: a message's worth at a time, whatever the block (a
    quantized weight's shard is never computed whole). ``shift``: the bytes start at an
    address of ``shift`` (mod ``ALIGN``), where the rows' dtype allows
    (:meth:`Transform.rows_of`); computed into ``into`` (uint8, a slot) where they fit."""
    t = entry.transform
    assert t is not None and piece.src is not None
    group = math.prod(piece.block.shape[1:]) * entry.dtype.itemsize * t.out_rows
    first, last = s // group, -(-(s + n) // group)  # groups of written rows
    at = s - first * group

    empty = None
    if shift is not None:  # (the rows' first output byte at `shift`, mod ALIGN)
        want = (shift - at) % _direct_io.ALIGN

        def empty(nbytes: int) -> torch.Tensor:
            if into is not None and nbytes + _direct_io.ALIGN <= into.numel():
                return _direct_io.place(into, nbytes, want)
            return _direct_io.aligned_empty(nbytes, want)

    out = t.rows_of(source[first * t.step : last * t.step], piece.src.offset[0] + first * t.step,
                    empty)
    return _flat_bytes(out if out.is_contiguous() else out.contiguous())[at : at + n]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _PinnedSlots:
    """``count`` pinned host chunks, for GPU bytes on their way to the link or the disk.

    Leased from :mod:`distributed_ext._staging` (pinned memory has one owner) and returned
    by :meth:`release`; a slot may be used until then, and only by one transfer at a time.
    """

    def __init__(self, count: int, chunk: int) -> None:
        self.size = chunk + 2 * _direct_io.ALIGN
        self.lease = _staging.acquire(count * self.size)

    def view(self, slot: int, n: int, shift: int = 0) -> torch.Tensor:
        """``n`` bytes of slot ``slot``, starting at an address ``shift`` (mod ``ALIGN``), so
        that a direct write of them to a file offset with that shift needs no copy."""
        base = self.lease.tensor[slot * self.size : (slot + 1) * self.size]
        return _direct_io.place(base, n, shift)

    def release(self) -> None:
        self.lease.release()


def _needs_pinned(state: dict[str, torch.Tensor], messages: list[list[Segment]]) -> bool:
    """Whether any of these messages' bytes live on a GPU (only then is pinned memory taken).
    (A DTensor is on its local shard's device.)"""
    if not torch.cuda.is_initialized():  # no tensor can be on a GPU: skip the walk
        return False
    return any(state[p.source or e.source].is_cuda for m in messages for e, p, _s, _n in m)


class _Stager:
    """A rank's pieces as the bytes of its messages, on the device ``link`` wants.

    A message that is one host segment (a large piece, or one small piece alone) is a view of
    the piece's own memory; several host segments are packed by the compiled core into a host
    slot; bytes on another device than ``link`` are copied chunk by chunk through a slot
    (pinned for GPU bytes to the host, device for host bytes to NCCL). Three slots, so that
    two messages can be in flight while the third is filled.

    A piece that fails to read (``failure``) turns this and every later message into zeros
    of the same size: the stream keeps its shape, so no peer waits, and the failure is
    agreed afterwards.

    Everything it will need is allocated by :meth:`reserve`, in the round that agrees the
    ranks are ready, so that no allocation fails mid-stream (a peer would wait for bytes that
    never come).
    """

    def __init__(self, state: dict[str, torch.Tensor], chunk: int, link: torch.device,
                 pinned: _PinnedSlots | None, slot_bytes: int | None = None) -> None:
        """``slot_bytes``: the most bytes of a packed message, the size of each host slot
        (default :func:`pack_cap` of ``chunk``)."""
        self.state, self.chunk, self.link, self.pinned = state, chunk, link, pinned
        self.slot_bytes = pack_cap(chunk) if slot_bytes is None else slot_bytes
        self.failure: BaseException | None = None
        # The last piece read (a large one spans several messages), with its entry: one
        # Piece object serves every entry of a signature.
        self.current: tuple[Entry | None, Piece | None, torch.Tensor | None] = (None, None, None)
        self.zeros: torch.Tensor | None = None
        self.zeros_filled = False
        self.dev_slots: torch.Tensor | None = None
        self.host_slots: torch.Tensor | None = None
        self.huge_slots: torch.Tensor | None = None  # (:meth:`write_direct`)

    def _bytes(self, e: Entry, p: Piece) -> torch.Tensor | None:
        """The piece as a contiguous tensor (of its own dtype: a byte view is only made where
        one is sliced), or None once a piece failed to read."""
        if self.failure is not None:
            return None
        if self.current[1] is p and self.current[0] is e:  # a large piece, over messages
            return self.current[2]
        self.current = (None, None, None)  # (dropped first: a piece may be a copy)
        try:
            data = _piece_tensor(self.state, e, p)
        except BaseException as exc:  # noqa: BLE001 - agreed after the stream ends
            self.failure = exc
            return None
        self.current = (e, p, data)
        return data

    def reserve(self, messages: list[list[Segment]]) -> None:
        """Allocates the slots these messages need and the buffer zeros are sent from after
        a failure (host: uninitialized until then; device: a slot is zeroed instead)."""
        if not messages:
            return
        packed = any(len(m) > 1 for m in messages)
        if self.link.type == "cuda":
            if packed or any(not _local(self.state[p.source or e.source]).is_cuda
                             for m in messages for e, p, _s, _n in m):
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return
        if packed and self.pinned is None:
            self.host_slots = torch.empty(
                (3, self.slot_bytes + 2 * _direct_io.ALIGN), dtype=torch.uint8)
        self.zeros = torch.empty(max(_message_nbytes(m) for m in messages), dtype=torch.uint8)

    def write_direct(self) -> None:
        """The host messages staged from here on are written direct to files: a packed one,
        and a computed one alone, are staged into three slots of transparent huge pages
        (:func:`~distributed_ext._direct_io.huge_empty`: a direct write from them goes to the
        device in few segments) instead of ``host_slots`` and fresh buffers. Each slot holds
        the larger of ``slot_bytes`` and ``chunk``, and 2 MiB more (a computed message's
        partial row groups; larger outputs still get buffers of their own). Only what is
        touched takes memory: at most three messages' bytes, as before. A message of a
        piece's own memory is still written from there: copied into slots it would add
        three chunks to a rank's peak memory, and copying a model's shards through huge
        pages made a 1 GiB fp32 export no quicker (1.69 s against 1.73 s, medians of five
        alternating calls, ext4). (Made here, not by :meth:`reserve`: only a rank's own
        writes call it, and a failure there is agreed after them; no peer waits on them.)"""
        if self.huge_slots is None and self.link.type == "cpu" and self.pinned is None:
            page = _direct_io.HUGE_PAGE
            size = -(-(max(self.slot_bytes, self.chunk) + page) // page) * page
            self.huge_slots = _direct_io.huge_empty(3 * size).view(3, size)

    def _failed_bytes(self, slot: int, n: int) -> torch.Tensor:
        """``n`` zero bytes to send in place of a message after a failure."""
        if self.link.type == "cuda":
            if self.dev_slots is None:  # (every message was sent from its own memory so far)
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return self.dev_slots[slot, :n].zero_()
        assert self.zeros is not None, "reserve() was not called"
        if not self.zeros_filled:
            self.zeros.zero_()
            self.zeros_filled = True
        return self.zeros[:n]

    def _slot(self, slot: int, n: int, shift: int) -> torch.Tensor:
        if self.link.type == "cuda":
            if self.dev_slots is None:
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return self.dev_slots[slot, :n]
        if self.pinned is not None:
            return self.pinned.view(slot, n, shift)
        if self.huge_slots is not None:
            return _direct_io.place(self.huge_slots[slot], n, shift)
        if self.host_slots is None:  # only packed messages come here: at most `slot_bytes`
            self.host_slots = torch.empty((3, self.slot_bytes + 2 * _direct_io.ALIGN),
                                          dtype=torch.uint8)
        return _direct_io.place(self.host_slots[slot], n, shift)

    def stage(self, message: list[Segment], slot: int, shift: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The message's bytes, and what must stay alive while they are read (a piece's own
        memory sent without a copy). ``shift``: the address (mod ``ALIGN``) a write of them
        to the files wants (None: they are sent, any address will do)."""
        want, shift = shift, shift or 0
        if len(message) > 1 and self.link.type == "cpu" and self.failure is None:
            packed = self._pack_whole_blocks(message, slot, shift)
            if packed is not None:
                return packed, None
        n = _message_nbytes(message)
        # Each segment as (a tensor, the segment's first byte in it); a message that is one
        # computed segment is computed at the address its direct write wants.
        alone = want if len(message) == 1 and self.link.type == "cpu" else None
        into = None if alone is None or self.huge_slots is None else self.huge_slots[slot]
        sources = [self._segment(e, p, s, m, alone, into) for e, p, s, m in message]
        if self.failure is not None:
            return self._failed_bytes(slot, n), None
        if len(message) == 1 and sources[0][0].device.type == self.link.type:
            d, s = sources[0]
            data = _flat_bytes(d)
            return data[s : s + n], data  # from where it lives (or was computed)
        out = self._slot(slot, n, shift)
        if self.link.type == "cpu" and not any(d.is_cuda for d, _s in sources):
            # Many small host pieces: one native pass, no Python per byte.
            rows, at = [], 0
            for (_e, _p, _s, m), (d, s) in zip(message, sources):
                rows.append((d.data_ptr() + s, at, m))
                at += m
            _native.pack_segments(out, rows)  # the sources are alive: held here
        else:
            # Device copies are stream-ordered after the send that last read this slot (its
            # wait() made the current stream wait for it); D2H into pinned memory returns
            # once the bytes are there.
            at = 0
            for (_e, _p, _s, m), (d, s) in zip(message, sources):
                out[at : at + m].copy_(_flat_bytes(d)[s : s + m])
                at += m
        return out, None

    def _segment(self, e: Entry, p: Piece, s: int, n: int, shift: int | None = None,
                 into: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """A segment's bytes: the piece (:meth:`_bytes`) and ``s``; for a computed piece,
        the ``n`` bytes themselves (:func:`_computed_bytes`, at an address of ``shift``
        where one is given, into the slot ``into`` where given) and 0. After a failure, an
        empty tensor (the message is then sent as zeros)."""
        data = self._bytes(e, p)
        if data is None:
            return torch.empty(0, dtype=torch.uint8), 0
        if e.transform is None:
            return data, s
        try:
            return _computed_bytes(data, e, p, s, n, shift, into), 0
        except BaseException as exc:  # noqa: BLE001 - agreed after the stream ends
            self.failure = exc
            return torch.empty(0, dtype=torch.uint8), 0

    def _pack_whole_blocks(self, message: list[Segment], slot: int, shift: int
                           ) -> torch.Tensor | None:
        """Packs a message of small pieces that are each a whole, contiguous host block (a
        model's small tensors): their bytes are their own memory, so there is nothing to
        read that can fail, and one table goes to the compiled core. None, with nothing
        done, where any piece is something else (the general path then reads it)."""
        rows = array.array("q")
        at = 0
        state = self.state
        for e, p, s, m in message:
            if p.local is not None or e.transform is not None:
                return None
            t = state[p.source or e.source]
            kind = type(t)
            if (kind is not torch.Tensor and kind is not nn.Parameter) or not t.is_cpu \
                    or not t.is_contiguous():
                return None
            rows.extend((t.data_ptr() + s, at, m))
            at += m
        out = self._slot(slot, at, shift)
        # The blocks are held by ``state`` while the copy runs (it returns once done).
        _native.pack_segments(out, torch.frombuffer(rows, dtype=torch.int64).reshape(-1, 3))
        return out

    def abandon(self) -> tuple:
        """What a transport may still read after a peer failed (kept, never freed)."""
        return (self.pinned, self.dev_slots, self.host_slots, self.huge_slots)
