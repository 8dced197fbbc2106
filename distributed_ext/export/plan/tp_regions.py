"""The short runs of a ``Shard(1)``/TP layout, each region written by the holder of most of
its bytes (``writers="all"``): pure planning.

A TP block's rows are short runs, interleaved in the file with the other TP ranks' rows:
written where they are held, every rank would write a few bytes between the others' (a
syscall per run, every block shared). Instead each region of such a tensor -- its whole
aligned blocks, cut where the file's ``region``-byte regions (1 MiB) begin and where a DP
group's rows begin (FSDP x TP: its bytes then cross only within one TP group) -- is a *zone*,
assembled and written whole by one rank: the holder of most of its bytes (ties spread over
the tied holders in turn, by the region's index, so that TP ranks holding equal columns
share the writing), to which the others send their rows there. The tensor's partial
blocks at its two ends share a block with its neighbours in the file: dst's, as every
block that holds bytes dst writes anyway (the header, short runs of other tensors).

Every rank computes the same zones and owners from the plan alone -- every holder's block
of a zoned tensor is known (:attr:`~.pieces.Entry.zoned`): nothing is agreed over the link
and nothing read from it says where bytes go. A rank computes only the zones its own
pieces touch, and for those all the pieces with bytes there: a sender and the zone's owner
list the same segments in the same order, so both cut them into the same messages.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import torch

from distributed_ext.export.plan.blocks import Runs
from distributed_ext.export.plan.messages import Segment
from distributed_ext.export.plan.types import Entry, Piece


@dataclass
class ZonePlan:
    """What one rank does with the zones its pieces touch: segments ``(entry, piece, start,
    nbytes)`` of its own to write itself (``kept``), to send to each owner (``outgoing``),
    and the other ranks' it receives (``incoming``, per sender), each in plan order."""

    kept: list[Segment] = field(default_factory=list)
    outgoing: dict[int, list[Segment]] = field(default_factory=dict)
    incoming: dict[int, list[Segment]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.kept or self.outgoing or self.incoming)


def zone_bounds(base: int, nbytes: int, align: int, region: int,
                groups: tuple[int, ...] = ()) -> tuple[list[int], int, int]:
    """The zones of a tensor of ``nbytes`` whose data starts at file offset ``base``: their
    bounds (offsets in the tensor, from 0 to ``nbytes``), and ``[a, z)``, the part covering
    whole aligned blocks, cut at every ``region`` boundary of the file and at the block
    holding each offset of ``groups`` (where another group of holders begins: an FSDP x TP
    tensor's DP groups, so that a zone's bytes cross only within one TP group); the bytes
    before ``a`` and from ``z`` on (partial blocks) form a zone each, as does the whole
    tensor where it covers no whole block."""
    a = -base % align
    z = (base + nbytes) // align * align - base
    if a >= z:
        return [0, nbytes], 0, 0
    first = (base + a) // region + 1
    inner = set(range(first * region - base, z, region))
    inner.update(c for c in ((base + g) // align * align - base for g in groups) if a < c < z)
    cuts = ([0] if a > 0 else []) + [a, *sorted(inner), z] + ([nbytes] if z < nbytes else [])
    return cuts, a, z


def piece_position(piece: Piece, entry: Entry, offset: int) -> int:
    """How many of the piece's bytes lie before ``offset`` of the tensor: a piece's runs
    rise through the tensor, so the bytes it has in ``[x, y)`` are one range of its own,
    from the position of ``x`` to that of ``y``. Integer arithmetic (a TP block's runs are
    one stride apart); runs nested deeper are searched in their table."""
    runs = piece.runs(entry)
    if not runs.counts:
        return min(max(offset - runs.base, 0), piece.nbytes)
    if len(runs.counts) == 1:
        (count,), (stride,) = runs.counts, runs.strides
        i = (offset - runs.base) // stride
        if i < 0:
            return 0
        i = min(i, count - 1)
        return i * runs.run + min(max(offset - runs.base - i * stride, 0), runs.run)
    starts = _run_starts(runs, piece.nbytes)
    k = int(torch.searchsorted(starts, torch.tensor([offset]), right=True))
    if k == 0:
        return 0
    return (k - 1) * runs.run + min(max(offset - int(starts[k - 1]), 0), runs.run)


@functools.lru_cache(maxsize=64)
def _run_starts(runs: Runs, nbytes: int) -> torch.Tensor:
    """Where each run of a block nested deeper than one stride starts (int64)."""
    return runs.table(0, nbytes)[:, 0].contiguous()


def _span(piece: Piece, entry: Entry) -> tuple[int, int]:
    """The first and one-past-last byte of a piece in its tensor."""
    runs = piece.runs(entry)
    if not runs.counts:
        return runs.base, runs.base + piece.nbytes
    return runs.base, runs.start_of(len(runs) - 1) + runs.run


def plan_zones(entries: list[Entry], bases: torch.Tensor, me: int, dst_rank: int,
               align: int, region: int) -> ZonePlan:
    """This rank's :class:`ZonePlan` over the zoned entries (``bases``: per entry index, the
    file offset of its data). Work: per zoned entry this rank holds a piece of (dst: every
    zoned entry's two ends too), the pieces that meet each zone its own touch (a TP
    group's, found by bisection), a few integer operations each."""
    plan = ZonePlan()
    # Per list of pieces (every key of a signature shares one): its pieces by span, once.
    layouts: dict[tuple, _Layout] = {}
    for e in entries:
        if not e.zoned:
            continue
        key = (id(e.pieces), e.shape, e.dtype.itemsize)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _Layout(e, me)
        mine = layout.mine
        if not mine and me != dst_rank:
            continue
        base = int(bases[e.index])
        cuts, a, z = zone_bounds(base, e.nbytes, align, region, layout.groups)
        # The zones this rank's pieces touch; dst's also the partial blocks at the ends,
        # which it owns (holding bytes there or not).
        zones: set[int] = set()
        if mine:
            lo, hi = layout.mine_span
            zones.update(range(bisect.bisect_right(cuts, lo) - 1, bisect.bisect_left(cuts, hi)))
        if me == dst_rank:
            zones.update((0, len(cuts) - 2))
        for k in sorted(zones):
            x, y = cuts[k], cuts[k + 1]
            peers = layout.meeting(x, y)
            held = [(piece_position(p, e, x), piece_position(p, e, y)) for p in peers]
            counts = [after - before for before, after in held]
            slack = 2 * max(p.runs(e).run for p in peers)
            owner = _owner(counts, [p.rank for p in peers], x >= a and y <= z and a < z,
                           (base + x) // region, dst_rank, slack)
            for p, (start, _end), n in zip(peers, held, counts):
                if not n:
                    continue
                seg = (e, p, start, n)
                if p.rank == me:
                    if owner == me:
                        plan.kept.append(seg)
                    else:
                        plan.outgoing.setdefault(owner, []).append(seg)
                elif owner == me:
                    plan.incoming.setdefault(p.rank, []).append(seg)
    return plan


class _Layout:
    """A zoned list of pieces (shared by every key of a signature) by where they lie: the
    non-empty ones sorted by their first byte, so that the pieces meeting a range are found
    by bisection, not by a pass over every holder (1024 of them at world 1024)."""

    def __init__(self, entry: Entry, me: int) -> None:
        spanned = sorted(((_span(p, entry), p) for p in entry.pieces if p.nbytes),
                         key=lambda sp: sp[0][0])
        self.pieces = pieces = [p for _sp, p in spanned]
        self.starts = [a for (a, _b), _p in spanned]
        self.ends = [b for (_a, b), _p in spanned]
        self.longest = max((b - a for (a, b), _p in spanned), default=0)
        mine = [(sp, p) for sp, p in spanned if p.rank == me]
        self.mine = [p for _sp, p in mine]
        self.mine_span = (min(a for (a, _b), _p in mine),
                          max(b for (_a, b), _p in mine)) if mine else (0, 0)
        # Where a group of holders begins: the first row of each distinct row range.
        row = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0
        self.groups = tuple(sorted({p.block.offset[0] * row for p in pieces} - {0}))

    def meeting(self, lo: int, hi: int) -> list[Piece]:
        """The pieces with bytes between ``lo`` and ``hi`` (their spans meet it)."""
        first = bisect.bisect_right(self.starts, lo - self.longest)
        last = bisect.bisect_left(self.starts, hi)
        return [self.pieces[i] for i in range(first, last) if self.ends[i] > lo]


def _owner(nbytes: list[int], ranks: list[int], whole: bool, index: int, dst_rank: int,
           slack: int) -> int:
    """A zone's writer: dst for the partial blocks at a tensor's ends (``whole`` False);
    else the holder of most of its bytes, counted in whole rows: holders within ``slack``
    (two runs: a zone's two ends cut a row of each) of the most are tied -- the TP ranks
    of equal columns, which the cuts would otherwise rank the same way in every region of
    a tensor, one of them writing it all -- and ties are taken in turn by the region's
    ``index``."""
    if not whole:
        return dst_rank
    most = max(nbytes)
    tied = sorted(r for r, n in zip(ranks, nbytes) if n > 0 and n >= most - slack)
    return tied[index % len(tied)]
