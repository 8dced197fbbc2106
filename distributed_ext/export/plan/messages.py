"""How pieces travel: packed into messages (computed alike by a sender and dst), and where a
message's bytes go, as row tables a sink maps with a few tensor operations."""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Any

import torch

from distributed_ext._direct_io import ALIGN
from distributed_ext.export.plan.types import Entry, Piece

# The most small pieces one message packs (less than a chunk: the stages then overlap).
PACK_BYTES = 2**20


def pack_cap(chunk: int) -> int:
    """The most bytes of one packed message at ``chunk_bytes`` ``chunk``."""
    return min(chunk, PACK_BYTES)


# Columns of a row table (:func:`_rows`): which entry, where in it, where in the message, how
# many bytes. A table, not a list of tuples: a sink maps a message of a thousand small pieces
# to file offsets and copies them with a few tensor operations and one native call.
ROW_ENTRY, ROW_OFFSET, ROW_AT, ROW_NBYTES = range(4)


def _rows(message: list[Segment], at: int = 0) -> torch.Tensor:
    """Where a message's bytes go: an int64 table of ``(entry index, offset in the written
    tensor, offset in the message, nbytes)``, one row per contiguous run (one per segment,
    mostly); ``at``: where the first segment starts in the message. Computed per message
    from each piece's :class:`Runs`: at most a message's worth of rows exists at a time."""
    return _segment_rows(message, at)[0]


# A segment spanning more runs than this has its rows computed as tensors (Runs.table);
# fewer, one by one (cheaper than a few tensor operations).
_TABLE_RUNS = 16


def _segment_rows(message: list[Segment], at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rows`, and per row the index of its segment in ``message`` (int64)."""
    flat, owner = array.array("q"), array.array("q")
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        if flat:
            parts.append((torch.frombuffer(flat[:], dtype=torch.int64).reshape(-1, 4),
                          torch.frombuffer(owner[:], dtype=torch.int64)))
            del flat[:], owner[:]

    for j, (e, p, start, n) in enumerate(message):
        runs = p.runs(e)
        i = e.index
        if not runs.counts:  # most pieces: one run, no search
            flat.extend((i, runs.base + start, at, n))
            owner.append(j)
        elif (start + n - 1) // runs.run - start // runs.run < _TABLE_RUNS:
            for offset, a, m in runs.pieces(start, n, at):
                flat.extend((i, offset, a, m))
                owner.append(j)
        else:
            flush()
            table = runs.table(start, n, at)
            rows = torch.empty((len(table), 4), dtype=torch.int64)
            rows[:, 0] = i
            rows[:, 1:] = table
            parts.append((rows, torch.full((len(table),), j, dtype=torch.int64)))
        at += n
    flush()
    if not parts:
        return torch.empty((0, 4), dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    if len(parts) == 1:
        return parts[0]
    return torch.cat([r for r, _o in parts]), torch.cat([o for _r, o in parts])


def _placement(sink: Any, message: list[Segment]) -> int:
    """The address shift at which a message's bytes go to the sink without a copy (the file
    offset's of its first byte, where that starts a run), else 0."""
    e, p, start, _n = message[0]
    runs = p.runs(e)
    return sink.address_shift(e.index, runs.base + start) if not runs.counts else 0


# A message: the (entry, piece, start, nbytes) segments it carries, back to back.
Segment = tuple[Entry, Piece, int, int]


def plan_messages(items: Iterable[tuple[Entry, Piece]], chunk: int,
                  bases: torch.Tensor | None = None) -> list[list[Segment]]:
    """How one rank's pieces travel, computed alike by a sender and dst (and by dst for its
    own pieces on their way to the files).

    A piece of at least ``chunk`` bytes goes alone, in messages of ``chunk`` bytes (sent from
    its own memory); smaller pieces are packed back to back into messages of up to
    ``PACK_BYTES`` (1 MiB), so that a model of 100k small tensors costs a few messages, not
    100k, and dst writes one while the sender packs the next.

    ``bases`` (per entry index, the file offset of its data; for the pieces a rank writes
    itself): a one-run piece is cut where the file is aligned (``ALIGN``), its first message
    shorter, so that no block is shared between two of its messages (:func:`edge_table`).
    """
    return _plan(items, chunk, None, bases)[0]


def plan_streams(items: Iterable[tuple[Entry, Piece]], chunk: int, world: int,
                 bases: torch.Tensor | None = None) -> list[list[list[Segment]]]:
    """Every rank's messages (:func:`plan_messages` of its pieces), from all ranks' pieces in
    plan order, in one pass: dst plans every sender's stream. A list per group rank."""
    return _plan(items, chunk, world, bases)


def _cuts(e: Entry, p: Piece, chunk: int, bases: torch.Tensor | None) -> list[int]:
    """Where a piece of at least ``chunk`` bytes is cut into messages (their starts): every
    ``chunk`` bytes, or -- ``bases`` given, one run, ``chunk`` a multiple of ``ALIGN`` -- at
    the file's aligned bytes, the first message shorter."""
    first = chunk
    runs = p.runs(e)
    if bases is not None and not runs.counts and chunk % ALIGN == 0:
        first = -(int(bases[e.index]) + runs.base) % ALIGN or chunk
    return [0, *range(first, p.nbytes, chunk)]


def _plan(items: Iterable[tuple[Entry, Piece]], chunk: int, world: int | None,
          bases: torch.Tensor | None = None) -> list[list[list[Segment]]]:
    """The streams of :func:`plan_streams` (``world`` None: one, of all ``items``)."""
    # Per rank: [its messages, the message being packed, its bytes so far]
    streams: list[list[Any]] = [[[], [], 0] for _ in range(world or 1)]
    # Packed messages stay small enough that a receiver writes one while the next is packed.
    cap = pack_cap(chunk)
    for e, p in items:
        n = p.nbytes
        if n == 0:
            continue
        stream = streams[p.rank if world else 0]
        if n >= chunk:
            cuts = [*_cuts(e, p, chunk, bases), n]
            stream[0].extend([(e, p, a, b - a)] for a, b in zip(cuts, cuts[1:]))
            continue
        packed = stream[1]
        if packed and stream[2] + n > cap:
            stream[0].append(packed)
            packed = stream[1] = []
            stream[2] = 0
        packed.append((e, p, 0, n))
        stream[2] += n
    for stream in streams:
        if stream[1]:
            stream[0].append(stream[1])
    return [stream[0] for stream in streams]


def _message_nbytes(message: list[Segment]) -> int:
    return sum(s[3] for s in message)


def aligned_middles(offset: torch.Tensor, n: torch.Tensor, align: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per run of ``n`` bytes at file ``offset`` (int64 vectors), the part ``[lo, hi)`` of
    it that covers whole aligned blocks (``lo == hi`` where it covers none): the bytes
    before ``lo`` and from ``hi`` on share their blocks with other runs."""
    lo = torch.minimum(n, torch.remainder(-offset, align))
    return lo, torch.maximum(lo, n - torch.remainder(offset + n, align))


def edge_table(messages: list[list[Segment]], bases: torch.Tensor, align: int
               ) -> tuple[list[Segment], torch.Tensor]:
    """The edges of a writer's own runs (``writers="all"``, each rank its own): the bytes of
    the blocks they share with other runs.

    A writer writes the whole aligned blocks inside each run of its ``messages`` (the rows
    of :func:`_rows`, one per run and message); a block that a run covers only in part is
    shared with other runs -- another rank's, or this rank's next message -- so its bytes
    go to one rank, the block's owner (:mod:`plan.block_owners`), which writes the block: every block
    of a file has one writer. Returns the segments ``(entry, piece, start, nbytes)`` of those
    partial blocks, in order (under ``align`` bytes each, each inside one block and one
    run, at most two per run), and their fragment table (one row each, ``ROW_AT`` unused):
    computed as tables, not per run. ``bases``: per entry index, the file offset of its
    data."""
    segments = [seg for message in messages for seg in message]
    if not segments:
        return [], torch.empty((0, 4), dtype=torch.int64)
    # Every message's rows as one table (each message's own positions in ROW_AT), and
    # where each segment starts in its message.
    tables, owners, at = [], [], []
    first = 0
    for message in messages:
        rows, owner = _segment_rows(message)
        tables.append(rows)
        owners.append(owner + first)
        pos = 0
        for seg in message:
            at.append(pos)
            pos += seg[3]
        first += len(message)
    rows, owner = torch.cat(tables), torch.cat(owners)
    starts = torch.tensor([seg[2] for seg in segments], dtype=torch.int64)
    entry, offset, n = rows[:, ROW_ENTRY], rows[:, ROW_OFFSET], rows[:, ROW_NBYTES]
    # Each row's first byte in its piece's own bytes (what the stager reads).
    start = starts[owner] + rows[:, ROW_AT] - torch.tensor(at, dtype=torch.int64)[owner]
    lo, hi = aligned_middles(bases[entry] + offset, n, align)
    head, tail = lo > 0, hi < n
    # Per row its head (before lo), then its tail (from hi): in order.
    which = torch.stack((head, tail), 1).reshape(-1)
    pick = torch.arange(len(rows), dtype=torch.int64).repeat_interleave(2)[which]
    is_tail = torch.arange(2, dtype=torch.int64).repeat(len(rows))[which].bool()
    skip = torch.where(is_tail, hi[pick], 0)
    size = torch.where(is_tail, n[pick] - hi[pick], lo[pick])
    table = torch.stack((entry[pick], offset[pick] + skip, torch.zeros_like(skip), size), 1)
    out = [(segments[j][0], segments[j][1], s, k) for j, s, k in
           zip(owner[pick].tolist(), (start[pick] + skip).tolist(), size.tolist())]
    return out, table


def pack_bounds(sizes: Iterable[int], cap: int) -> list[int]:
    """Where a sequence of segments of ``sizes`` bytes is cut into messages of up to ``cap``
    bytes, packed back to back in order (a segment over ``cap`` goes alone): the start index
    of each message. Computed alike from the sizes alone by a sender and its receiver."""
    starts: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if not starts or size + n > cap:
            starts.append(i)
            size = 0
        size += n
    return starts


def pack(segments: list[Segment], cap: int) -> list[list[Segment]]:
    """``segments`` as messages of up to ``cap`` bytes (:func:`pack_bounds`)."""
    starts = pack_bounds((s[3] for s in segments), cap)
    return [segments[a:b] for a, b in zip(starts, [*starts[1:], len(segments)])]

