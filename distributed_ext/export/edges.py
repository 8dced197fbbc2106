"""The shared blocks of the files (``writers="all"``): each written by its owner.

After every rank has written the whole blocks inside its own long runs, what is left are
their *fragments*, the bytes of blocks two runs share (:func:`.messages.edge_segments`).
dst, which plans every rank's pieces, decides who owns each such block -- the holder of most
of its bytes (:mod:`.owners`) -- and tells each rank with fragments, in the preparing round
(:func:`deliver`), where each of them goes and which fragments it receives. Then
(:func:`exchange`) every rank sends its fragments to their owners and writes the blocks it
owns: its own fragments there and those it receives. Every block of a file has one writer.

The exchange runs in rounds: in round ``k`` each rank posts its ``k``-th message to each
owner it sends to and its ``k``-th receive from each rank that sends to it, then waits for
them all. Every rank knows, for each pair it is part of, how many messages travel (both
ends compute them from the same tables), so no wait depends on a later round: it never
deadlocks, whatever the pattern, and holds one message (up to ``cap``, 1 MiB) per peer.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext import _agree, _direct_io, _watch
from distributed_ext.export import owners as _owners
from distributed_ext.export.messages import (
    ROW_ENTRY,
    ROW_NBYTES,
    ROW_OFFSET,
    Segment,
    _message_nbytes,
    _rows,
    aligned_middles,
    edge_segments,
    pack,
    pack_bounds,
    plan_messages,
)
from distributed_ext.export.pieces import Entry
from distributed_ext.export.stager import _Stager

# Plans whose buffers a transport may still use after a peer failed: never freed.
_ABANDONED: list[Any] = []


@dataclass
class EdgePlan:
    """One rank's fragments and, once known, their destinations and its receipts."""

    fragments: list[Segment]  # this rank's, in canonical order (:func:`_canonical`)
    rows: torch.Tensor  # their fragment table (:mod:`.owners`)
    dests: torch.Tensor | None = None  # the owner of each; dst: known when planned
    receipts: torch.Tensor | None = None  # what this rank receives (a receipt table)
    # dst only: each other rank's (destinations, receipts), to deliver
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Made by prepare(): messages out per owner, row tables in per sender, own ones kept.
    outgoing: dict[int, list[list[Segment]]] = field(default_factory=dict)
    incoming: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    kept: list[list[Segment]] = field(default_factory=list)
    send_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    recv_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    host: torch.Tensor | None = None  # NCCL: received or kept bytes on their way to a file
    stager: _Stager | None = None


def _canonical(rows: torch.Tensor) -> torch.Tensor:
    """The order of a fragment table's rows by (entry, offset): the order in which a rank's
    destinations are given, computed alike by the rank (from its messages) and dst (from
    its pieces), whatever order each made them in."""
    key = rows[:, ROW_ENTRY] * 2**40 + rows[:, ROW_OFFSET]
    return torch.sort(key, stable=True).indices


def fragment_table(fragments: list[Segment]) -> torch.Tensor:
    """The fragment table of ``fragments`` (one row each: each lies inside one run), in
    canonical order (:func:`_canonical`); ``fragments`` is put in the same order, in place."""
    rows = _rows(fragments)
    assert len(rows) == len(fragments), "a fragment spans runs"
    order = _canonical(rows)
    fragments[:] = [fragments[i] for i in order.tolist()]
    return rows[order]


def fragment_tables(written: list[tuple[Entry, Any]], skip: int, world: int,
                    bases: torch.Tensor | None, chunk: int) -> list[torch.Tensor]:
    """Every rank's fragment table (but ``skip``'s: dst's own, made from its messages),
    from the long pieces each writes (``written``, in plan order) -- on dst, which plans
    them all. A piece of one run (a Shard(0) block: nearly all) has its fragments at its
    run's two ends whatever its messages (they are cut where the file is aligned), so they
    are computed for all such pieces at once; a piece of many runs (a transposed block) from
    its messages (:func:`.messages.edge_segments`), which are its own (``chunk``)."""
    empty = torch.empty((0, 4), dtype=torch.int64)
    if not written or bases is None:
        return [empty] * world
    rank, index, start, nbytes = (array.array("q") for _ in range(4))
    many: list[list[tuple[Entry, Any]]] = [[] for _ in range(world)]
    for e, p in written:
        r = p.rank
        if r == skip:
            continue
        runs = p.runs(e)
        if runs.counts:
            many[r].append((e, p))
        else:
            rank.append(r)
            index.append(e.index)
            start.append(runs.base)
            nbytes.append(p.nbytes)
    out = [empty] * world
    if len(rank):
        r, i, a, n = (torch.frombuffer(x, dtype=torch.int64) for x in (rank, index, start, nbytes))
        lo, hi = aligned_middles(bases[i] + a, n, _direct_io.ALIGN)
        zero = torch.zeros_like(n)
        heads = torch.stack((i, a, zero, lo), 1)[lo > 0]
        tails = torch.stack((i, a + hi, zero, n - hi), 1)[hi < n]
        rows = torch.cat((heads, tails))
        owner = torch.cat((r[lo > 0], r[hi < n]))
        for q in torch.unique(owner).tolist():
            out[q] = rows[owner == q]
    for q, pieces in enumerate(many):
        if pieces:
            extra = _rows(edge_segments(plan_messages(pieces, chunk, bases), bases,
                                        _direct_io.ALIGN))
            out[q] = torch.cat((out[q], extra))
    return [t[_canonical(t)] for t in out]


def plan_on_dst(mine: list[Segment], tables: list[torch.Tensor], layout: Any,
                dst_rank: int) -> EdgePlan:
    """dst's :class:`EdgePlan` (``mine``: its own fragments, in the order of
    ``tables[dst_rank]``), with every other rank's tables to deliver; ``tables``: every
    rank's fragment table, canonical; ``layout``: the files (a sink's ``file_of``,
    ``bases``, ``sizes``)."""
    dests = _owners.plan_owners(tables, layout.file_of, layout.bases, layout.sizes, dst_rank,
                                _direct_io.ALIGN)
    receipts = _owners.plan_receipts(tables, dests)
    plan = EdgePlan(mine, tables[dst_rank], dests[dst_rank], receipts[dst_rank])
    for r, rows in enumerate(tables):
        if r != dst_rank and len(rows):
            plan.tables[r] = (dests[r], receipts[r])
    return plan


def deliver(plan: EdgePlan | None, ctx: _agree.GroupContext, dst_rank: int, layout: Any,
            nbytes: torch.Tensor, what: str) -> None:
    """dst sends each rank with fragments its tables; that rank checks them (ValueError
    naming the bad row) and keeps them. Two messages: the receipt count with the
    destinations (whose number the rank knows), then the receipts. Run in an agreed round."""
    me = ctx.rank
    if plan is None or (me != dst_rank and not plan.fragments):
        return  # (dst sends nothing to a rank without fragments)

    def body(_worker: Any) -> None:
        link = ctx.device
        if me == dst_rank:
            works, keep = [], []
            for r, (dests, receipts) in plan.tables.items():
                head = torch.cat((torch.tensor([len(receipts)]), dests)).to(link)
                keep.append(head)
                works.append(dist.isend(head, ctx.ranks[r], group=ctx.group))
                if len(receipts):
                    body_t = receipts.reshape(-1).to(link)
                    keep.append(body_t)
                    works.append(dist.isend(body_t, ctx.ranks[r], group=ctx.group))
            for w in works:
                w.wait()
            return
        head = torch.empty(1 + len(plan.fragments), dtype=torch.int64, device=link)
        dist.irecv(head, ctx.ranks[dst_rank], group=ctx.group).wait()
        head = head.cpu()
        count = int(head[0])
        # A receipt is a fragment of a block this rank owns and keeps a fragment of; a
        # block holds at most four (two runs' ends, each split once by a message cut): a
        # count beyond that is malformed (never allocated).
        if not 0 <= count <= 4 * len(plan.fragments):
            raise ValueError(f"{what}: dst announced {count} fragments to receive for "
                             f"{len(plan.fragments)} of this rank's own (at most four each)")
        receipts = torch.empty((count, 4), dtype=torch.int64, device=link)
        if count:
            dist.irecv(receipts, ctx.ranks[dst_rank], group=ctx.group).wait()
        receipts = receipts.cpu()
        try:
            _owners.check_tables(head[1:], receipts, plan.rows, me, ctx.size, nbytes,
                                 layout.file_of, layout.bases, _direct_io.ALIGN)
        except ValueError as exc:
            raise ValueError(f"{what}: the table of shared blocks from dst (rank "
                             f"{ctx.ranks[dst_rank]}) is malformed: {exc}") from None
        plan.dests, plan.receipts = head[1:], receipts

    _watch.run_watched(body, ctx.ranks, f"{what} (shared blocks)")


def prepare_round(plan: EdgePlan | None, sink: Any, entries: list[Entry],
                  state: dict[str, torch.Tensor], ctx: _agree.GroupContext, dst_rank: int,
                  cap: int, what: str) -> None:
    """The step of the preparing round for shared blocks, on every rank: dst tells each
    rank who writes the blocks its runs share (:func:`deliver`); each checks what it got
    and allocates the exchange's buffers (:func:`prepare`)."""
    nbytes = torch.tensor([e.nbytes for e in entries], dtype=torch.int64)
    deliver(plan, ctx, dst_rank, sink, nbytes, what)
    if plan is not None and plan.dests is not None:
        prepare(plan, state, ctx.rank, ctx.device, cap)


def prepare(plan: EdgePlan, state: dict[str, torch.Tensor], me: int, link: torch.device,
            cap: int) -> None:
    """Plans this rank's messages (out per owner, in per sender, its own kept) and
    allocates every buffer the exchange needs: one message per peer each way."""
    assert plan.dests is not None and plan.receipts is not None
    by_dest: dict[int, list[Segment]] = {}
    for seg, to in zip(plan.fragments, plan.dests.tolist()):
        by_dest.setdefault(to, []).append(seg)
    plan.kept = pack(by_dest.pop(me, []), cap)
    plan.outgoing = {r: pack(segs, cap) for r, segs in sorted(by_dest.items())}
    receipts = plan.receipts
    for r in torch.unique(receipts[:, _owners.R_SOURCE]).tolist() if len(receipts) else []:
        mine = receipts[receipts[:, _owners.R_SOURCE] == r]
        n = mine[:, _owners.R_NBYTES]
        starts = pack_bounds(n.tolist(), cap)
        tables = []
        for a, b in zip(starts, [*starts[1:], len(mine)]):
            at = torch.cumsum(n[a:b], 0) - n[a:b]
            tables.append(torch.stack((mine[a:b, _owners.R_ENTRY], mine[a:b, _owners.R_OFFSET],
                                       at, n[a:b]), 1))
        plan.incoming[r] = tables
    for r, ms in plan.outgoing.items():
        plan.send_bufs[r] = torch.empty(max(map(_message_nbytes, ms)), dtype=torch.uint8,
                                        device=link)
    for r, ts in plan.incoming.items():
        plan.recv_bufs[r] = torch.empty(max(map(_table_nbytes, ts)), dtype=torch.uint8,
                                        device=link)
    biggest = max([len(b) for b in [*plan.send_bufs.values(), *plan.recv_bufs.values()]]
                  + [_message_nbytes(m) for m in plan.kept] + [0])
    if link.type == "cuda" and biggest:
        plan.host = torch.empty(biggest, dtype=torch.uint8)
    stager = _Stager(state, max(cap, biggest), link, None)
    stager.reserve([m for ms in plan.outgoing.values() for m in ms] + plan.kept)
    plan.stager = stager


def _table_nbytes(rows: torch.Tensor) -> int:
    """The bytes of the message a row table describes."""
    return int(rows[:, ROW_NBYTES].sum())


def exchange(plan: EdgePlan, sink: Any, ctx: _agree.GroupContext, what: str) -> None:
    """Sends this rank's fragments to their owners and writes the blocks it owns (its
    kept fragments and those it receives, through ``sink.write_edges``), in rounds (module
    docstring). A write or read that fails is raised once every round is done (the
    messages keep their sizes: no peer waits); a peer that fails is named. ``sink`` None
    (this rank failed already): it only sends and receives, so that no peer waits."""
    stager = plan.stager
    assert stager is not None
    failures: list[BaseException] = []

    def to_host(data: torch.Tensor) -> torch.Tensor:
        if data.device.type == "cpu":
            return data
        assert plan.host is not None
        host = plan.host[: data.numel()]
        host.copy_(data)
        return host

    def write(data: torch.Tensor, rows: torch.Tensor) -> None:
        if failures or sink is None:
            return
        try:
            sink.write_edges(to_host(data), rows)
        except BaseException as exc:  # noqa: BLE001 - raised once the rounds are done
            failures.append(exc)

    def body(_worker: Any) -> None:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        for message in plan.kept:
            data, _keep = stager.stage(message, 0)
            write(data, _rows(message))
        rounds = max([len(v) for v in plan.outgoing.values()]
                     + [len(v) for v in plan.incoming.values()] + [0])
        for k in range(rounds):
            ops, landed = [], []
            for r, ms in plan.outgoing.items():
                if k < len(ms):
                    data, _keep = stager.stage(ms[k], 0)
                    buf = plan.send_bufs[r][: data.numel()]
                    buf.copy_(data)
                    ops.append((dist.isend, buf, ctx.ranks[r]))
            for r, ts in plan.incoming.items():
                if k < len(ts):
                    buf = plan.recv_bufs[r][: _table_nbytes(ts[k])]
                    ops.append((dist.irecv, buf, ctx.ranks[r]))
                    landed.append((buf, ts[k]))
            done = False
            try:
                for work in _post(ops, ctx):
                    work.wait()
                done = True
            finally:
                if not done:  # a peer failed: the transport may still use these buffers
                    _ABANDONED.append(plan)
            for buf, rows in landed:
                write(buf, rows)
        if stager.failure is not None:
            failures.insert(0, stager.failure)
        if failures:
            raise _watch.LocalFailure(failures[0])

    _watch.run_watched(body, ctx.ranks, f"{what} (shared blocks)")


def _post(ops: list[tuple[Any, torch.Tensor, int]], ctx: _agree.GroupContext) -> list[Any]:
    """Posts a round's sends and receives, all before any wait: one NCCL group on a GPU
    link (a pair that sends both ways in one round would block each other otherwise); on
    gloo each op as it is (it has no groups, and posted ops progress on their own)."""
    if ctx.device.type == "cuda":
        return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group=ctx.group)
                                       for op, t, peer in ops])
    return [op(t, peer, group=ctx.group) for op, t, peer in ops]
