"""The short runs of a ``Shard(1)``/TP layout, each region written by the holder of most of
its bytes (``writers="all"``): pure planning.

A TP block's rows are short runs, interleaved in the file with the other TP ranks' rows:
written where they are held, every rank would write a few bytes between the others' (a
syscall per run, every block shared). Instead each region of such a tensor -- its whole
aligned blocks, cut where the file's ``region``-byte regions (1 MiB) begin -- is a *zone*,
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
from dataclasses import dataclass, field

import torch

from distributed_ext.export.messages import Segment
from distributed_ext.export.pieces import Entry, Piece


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


def zone_bounds(base: int, nbytes: int, align: int, region: int) -> tuple[list[int], int, int]:
    """The zones of a tensor of ``nbytes`` whose data starts at file offset ``base``: their
    bounds (offsets in the tensor, from 0 to ``nbytes``), and ``[a, z)``, the part covering
    whole aligned blocks (cut at every ``region`` boundary of the file); the bytes before
    ``a`` and from ``z`` on (partial blocks) form a zone each, as does the whole tensor
    where it covers no whole block."""
    a = -base % align
    z = (base + nbytes) // align * align - base
    if a >= z:
        return [0, nbytes], 0, 0
    first = (base + a) // region + 1
    inner = list(range(first * region - base, z, region))
    cuts = ([0] if a > 0 else []) + [a, *inner, z] + ([nbytes] if z < nbytes else [])
    return cuts, a, z


def piece_positions(piece: Piece, entry: Entry, offsets: torch.Tensor) -> torch.Tensor:
    """For each offset of the tensor (int64), how many of the piece's bytes lie before it:
    a piece's runs rise through the tensor, so the bytes it has in ``[x, y)`` are one range
    of its own, from the position of ``x`` to that of ``y``."""
    runs = piece.runs(entry)
    if not runs.counts:
        return (offsets - runs.base).clamp(0, piece.nbytes)
    if len(runs.counts) == 1:
        (count,), (stride,) = runs.counts, runs.strides
        i = torch.div(offsets - runs.base, stride, rounding_mode="floor").clamp(-1, count - 1)
        within = (offsets - runs.base - i * stride).clamp(0, runs.run)
        return torch.where(i < 0, 0, i * runs.run + within)
    starts = runs.table(0, piece.nbytes)[:, 0]
    k = torch.searchsorted(starts, offsets, right=True)  # runs starting at or before
    last = (k - 1).clamp(min=0)
    return torch.where(k == 0, 0, last * runs.run + (offsets - starts[last]).clamp(0, runs.run))


def _span(piece: Piece, entry: Entry) -> tuple[int, int]:
    """The first and one-past-last byte of a piece in its tensor."""
    runs = piece.runs(entry)
    if not runs.counts:
        return runs.base, runs.base + piece.nbytes
    return runs.base, runs.start_of(len(runs) - 1) + runs.run


def plan_zones(entries: list[Entry], bases: torch.Tensor, me: int, dst_rank: int,
               align: int, region: int) -> ZonePlan:
    """This rank's :class:`ZonePlan` over the zoned entries (``bases``: per entry index, the
    file offset of its data). Work: per zoned entry this rank holds a piece of, the pieces
    that meet the zones its own touch (a TP group's), a few tensor operations each."""
    plan = ZonePlan()
    for e in entries:
        if not e.zoned:
            continue
        mine = [p for p in e.pieces if p.rank == me and p.nbytes]
        if not mine and me != dst_rank:
            continue
        base = int(bases[e.index])
        cuts, a, z = zone_bounds(base, e.nbytes, align, region)
        # The zones this rank's pieces touch; dst's also the partial blocks at the ends,
        # which it owns (holding bytes there or not).
        zones: set[int] = set()
        if mine:
            lo = min(_span(p, e)[0] for p in mine)
            hi = max(_span(p, e)[1] for p in mine)
            zones.update(range(bisect.bisect_right(cuts, lo) - 1, bisect.bisect_left(cuts, hi)))
        if me == dst_rank:
            zones.update((0, len(cuts) - 2))
        order = sorted(zones)
        lo, hi = cuts[order[0]], cuts[order[-1] + 1]
        peers = [p for p in e.pieces if p.nbytes and _meets(_span(p, e), lo, hi)]
        # Per peer, its position at each zone's two ends: (peers, zones, 2).
        at = torch.tensor([(cuts[j], cuts[j + 1]) for j in order], dtype=torch.int64)
        held = torch.stack([piece_positions(p, e, at) for p in peers])
        starts, counts = held[..., 0].tolist(), (held[..., 1] - held[..., 0]).tolist()
        ranks = [p.rank for p in peers]
        slack = 2 * max(p.runs(e).run for p in peers)
        for j, k in enumerate(order):
            x, y = cuts[k], cuts[k + 1]
            owner = _owner([c[j] for c in counts], ranks, x >= a and y <= z and a < z,
                           (base + x) // region, dst_rank, slack)
            for i, p in enumerate(peers):
                n = counts[i][j]
                if not n:
                    continue
                seg = (e, p, starts[i][j], n)
                if p.rank == me:
                    if owner == me:
                        plan.kept.append(seg)
                    else:
                        plan.outgoing.setdefault(owner, []).append(seg)
                elif owner == me:
                    plan.incoming.setdefault(p.rank, []).append(seg)
    return plan


def _meets(span: tuple[int, int], lo: int, hi: int) -> bool:
    return span[0] < hi and lo < span[1]


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
