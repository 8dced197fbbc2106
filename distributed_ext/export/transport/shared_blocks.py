"""The shared blocks of the files (``writers="all"``): each written by its owner.

After every rank has written the whole blocks inside its own runs, what is left are their
*fragments*, the bytes of blocks several runs share (:func:`plan.messages.edge_table`).
Each rank knows only its own. In the preparing round (:func:`resolve_owners`) the blocks
are dealt out to the ranks, each fragment's row (entry, offset, bytes) goes to its block's
rank, which decides the owner of each block it was dealt -- the holder of most of its
bytes (:mod:`plan.block_owners`) -- and tells each rank where each of its fragments goes and which
fragments it receives: two ``all_gather``s of counts and two ``all_to_all_single`` of
tables, each rank planning ~1/W of the blocks, none the whole world's. Then
(:func:`exchange`) every rank sends its fragments to their owners and writes the blocks it
owns: its own fragments there and those it receives. Every block of a file has one writer.

The exchange runs in rounds: in round ``k`` each rank posts its ``k``-th message to each
owner it sends to and its ``k``-th receive from each rank that sends to it, then waits for
them all. Every rank knows, for each pair it is part of, how many messages travel (both
ends compute them from the same tables), so no wait depends on a later round: it never
deadlocks, whatever the pattern, and holds one message (up to ``cap``: :func:`round_cap`,
4 MiB) per peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext import _agree, _direct_io, _watch
from distributed_ext.export.plan import block_owners as _owners
from distributed_ext.export.plan.messages import (
    ROW_ENTRY,
    ROW_NBYTES,
    ROW_OFFSET,
    Segment,
    _message_nbytes,
    _rows,
    pack,
    pack_bounds,
)
from distributed_ext.export.plan.tp_regions import ZonePlan
from distributed_ext.export.plan.types import Entry
from distributed_ext.export.transport.stager import _Stager
from distributed_ext.export.transport.stop import StopSignal

# The most bytes of one message of the exchange. Its rounds go in step (every rank waits for
# each round's messages of its peers), so a round's cost is paid per message: 4 MiB
# was faster than 1 MiB for FSDP x TP, 8 MiB no faster than 4 (docs/measurements.md).
ROUND_BYTES = 4 * 2**20


def round_cap(chunk: int) -> int:
    """The most bytes of one exchange message at ``chunk_bytes`` ``chunk``."""
    return min(chunk, ROUND_BYTES)


# The destination of every fragment in the answer of a rank whose planning failed (no rank).
_FAILED = -1

# Plans whose buffers a transport may still use after a peer failed: never freed.
_ABANDONED: list[Any] = []


@dataclass
class EdgePlan:
    """One rank's fragments and, once known, their destinations and its receipts."""

    fragments: list[Segment]  # this rank's, in canonical order (:func:`_canonical`)
    rows: torch.Tensor  # their fragment table (:mod:`plan.block_owners`)
    order: torch.Tensor  # the rows grouped by the rank their block is dealt to
    dealt: torch.Tensor  # how many go to each rank
    dests: torch.Tensor | None = None  # the owner of each (resolve_owners)
    receipts: torch.Tensor | None = None  # what this rank receives (a receipt table)
    zones: ZonePlan | None = None  # the TP rows' regions it writes, sends, receives
    # Made by prepare(): messages out per owner, in per sender (a row table of fragments
    # or, zones, the sender's segments, as it cut them), own ones kept.
    outgoing: dict[int, list[list[Segment]]] = field(default_factory=dict)
    incoming: dict[int, list[torch.Tensor | list[Segment]]] = field(default_factory=dict)
    kept: list[list[Segment]] = field(default_factory=list)
    send_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    recv_bufs: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # two per sender
    host: torch.Tensor | None = None  # NCCL: received or kept bytes on their way to a file
    stager: _Stager | None = None


def _canonical(rows: torch.Tensor) -> torch.Tensor:
    """The order of a fragment table's rows by (entry, offset): the order in which a rank
    sends its fragments to an owner and the owner lists what it receives from that rank,
    computed alike at both ends (:func:`plan.block_owners.order_key`)."""
    return torch.sort(_owners.order_key(rows[:, ROW_ENTRY], rows[:, ROW_OFFSET]),
                      stable=True).indices


def plan_edges(fragments: list[Segment], layout: Any, world: int,
               rows: torch.Tensor | None = None) -> EdgePlan:
    """A rank's :class:`EdgePlan` of its ``fragments`` (``rows``: their fragment table, as
    :func:`plan.messages.edge_table` gives it, if known), with the ranks their blocks are dealt
    to (:func:`plan.block_owners.coordinators`): made in the round before the owners are resolved,
    so that whatever can fail here is agreed before any rank enters those collectives."""
    rows = fragment_table(fragments, rows)
    to = _owners.coordinators(rows, layout.file_of, layout.bases, layout.sizes, world,
                              _direct_io.ALIGN)
    return EdgePlan(fragments, rows, torch.sort(to, stable=True).indices,
                    torch.bincount(to, minlength=world))


def fragment_table(fragments: list[Segment], rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The fragment table of ``fragments`` (one row each: each lies inside one run; given
    as ``rows``, or computed), in canonical order (:func:`_canonical`); ``fragments`` is
    put in the same order, in place."""
    if rows is None:
        rows = _rows(fragments)
    assert len(rows) == len(fragments), "a fragment spans runs"
    order = _canonical(rows)
    fragments[:] = [fragments[i] for i in order.tolist()]
    return rows[order]


def resolve_owners(plan: EdgePlan, ctx: _agree.GroupContext, dst_rank: int, layout: Any,
                   nbytes: torch.Tensor, what: str) -> None:
    """Every rank, in an agreed round: sets ``plan.dests`` (the owner of each of its
    fragments) and ``plan.receipts`` (what it receives), planned by the ranks the blocks
    are dealt to (:func:`plan.block_owners.coordinators`). Four collectives: an ``all_gather`` of how
    many rows each rank deals to each, an ``all_to_all_single`` of the rows, an
    ``all_gather`` of how many receipts each gives each, an ``all_to_all_single`` of each
    rank's destinations and receipts. Every rank sees every count, so all check them alike
    before anything is allocated (bad counts: the same ValueError on every rank, before the
    next collective -- none is left waiting); every row is checked before use (ValueError
    naming the rank that sent it), and a rank that finds a malformed one still answers
    (destinations -1, refused where they arrive), so that every rank leaves the
    collectives and the failure is agreed afterwards. Holds, per rank, its own rows plus
    those dealt to it (~3 x 8 bytes each), its answers and two W x W count tables."""
    me, world, link = ctx.rank, ctx.size, ctx.device
    sizes, file_of, bases = layout.sizes, layout.file_of, layout.bases
    rows, order, sent = plan.rows, plan.order, plan.dealt  # (canonical within each rank's)
    faults: list[str] = []

    def all_to_all(data: torch.Tensor, out_counts: list[int], in_counts: list[int]
                   ) -> torch.Tensor:
        got = torch.empty(sum(in_counts), dtype=torch.int64, device=link)
        dist.all_to_all_single(got, data.to(link), in_counts, out_counts, group=ctx.group)
        return got.cpu()

    def all_counts(mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine`` (W counts), as rows of a W x W table."""
        got = [torch.empty(world, dtype=torch.int64, device=link) for _ in range(world)]
        dist.all_gather(got, mine.to(link), group=ctx.group)
        return torch.stack(got).cpu()

    def body(_worker: Any) -> None:
        if link.type == "cuda":
            torch.cuda.set_device(link)
        dealt = all_counts(sent)  # [r, c]: rows rank r deals to rank c
        _owners.check_counts(dealt, _owners.dealt_bound(sizes, world, _direct_io.ALIGN),
                             "fragments dealt to", what, ctx.ranks)
        counts = dealt[:, me]
        # Rows out: (entry, offset, nbytes), grouped by the rank each is dealt to.
        out = rows[order][:, [ROW_ENTRY, ROW_OFFSET, ROW_NBYTES]].reshape(-1)
        got = all_to_all(out, (sent * 3).tolist(), (counts * 3).tolist())
        received = list(torch.split(got.reshape(-1, 3), counts.tolist()))
        try:
            dests, receipts, fault = _owners.plan_dealt(
                received, me, file_of, bases, sizes, nbytes, dst_rank, _direct_io.ALIGN)
        except Exception as exc:  # noqa: BLE001 - raised once every rank has its answer
            # This rank still answers (every destination -1, no receipt), so that no peer
            # waits on it in the collectives below; it raises after them.
            dests = [torch.full((n,), _FAILED, dtype=torch.int64) for n in counts.tolist()]
            receipts = [torch.empty((0, 4), dtype=torch.int64)] * world
            fault, failed = None, exc
        else:
            failed = None
        if fault is not None:
            faults.append(f"rank {ctx.ranks[fault[0]]} sent a malformed fragment: {fault[1]}")
        given = all_counts(torch.tensor([len(t) for t in receipts], dtype=torch.int64))
        # A rank receives only fragments of blocks it owns: a block's worth at most per
        # fragment of its own there, and dst, which owns the blocks that hold header or
        # short-run bytes, a block's worth per block of the files besides.
        per_block = _owners.fragments_per_block(_direct_io.ALIGN)
        bound = per_block * dealt.sum(1)
        bound[dst_rank] += per_block * sum(-(-size // _direct_io.ALIGN) for size in sizes)
        _owners.check_counts(given, bound, "fragments to receive at", what, ctx.ranks)
        taken = given[:, me]
        # One message per rank: the destinations of the rows it sent, then its receipts.
        out = torch.cat([torch.cat((d, t.reshape(-1))) for d, t in zip(dests, receipts)])
        got = all_to_all(out, (counts + given[me] * 4).tolist(), (sent + taken * 4).tolist())
        mine_dests = torch.empty(len(rows), dtype=torch.int64)
        parts = []
        pos = first = 0
        for r, (n, m) in enumerate(zip(sent.tolist(), taken.tolist())):
            d, t = got[pos : pos + n], got[pos + n : pos + n + 4 * m].reshape(-1, 4)
            pos += n + 4 * m
            mine = order[first : first + n]  # the fragments this rank dealt to rank r
            first += n
            # Checked per rank that planned them, so that the error names it.
            if n and not len(t) and bool((d == _FAILED).all()):  # (its answer after a failure)
                faults.append(f"rank {ctx.ranks[r]} failed to plan the owners of the shared "
                              "blocks dealt to it (it raises its own error)")
            else:
                try:
                    _owners.check_tables(d, t, rows[mine], me, world, nbytes, file_of, bases,
                                         _direct_io.ALIGN, any_block=me == dst_rank)
                except ValueError as exc:
                    faults.append(f"the owners of shared blocks planned by rank "
                                  f"{ctx.ranks[r]} are malformed: {exc}")
            mine_dests[mine] = d
            parts.append(t)
        # Grouped by sender in rank order, each sender's in its send order (canonical).
        taken_rows = torch.cat(parts)
        taken_rows = taken_rows[torch.sort(_owners.order_key(
            taken_rows[:, _owners.R_ENTRY], taken_rows[:, _owners.R_OFFSET]),
            stable=True).indices]
        plan.receipts = taken_rows[torch.sort(taken_rows[:, _owners.R_SOURCE],
                                              stable=True).indices]
        plan.dests = mine_dests
        if failed is not None:
            raise _watch.LocalFailure(failed)  # (its own: no peer to look for)

    _watch.run_watched(body, ctx.ranks, f"{what} (shared blocks)")
    if faults:
        raise ValueError(f"{what}: {faults[0]}")


def prepare_round(plan: EdgePlan, sink: Any, entries: list[Entry],
                  state: dict[str, torch.Tensor], ctx: _agree.GroupContext, dst_rank: int,
                  cap: int, what: str, resolve: bool = True) -> None:
    """The step of the preparing round for shared blocks, on every rank: the owners of
    the blocks runs share (:func:`resolve_owners`; ``resolve`` False, where no rank has
    a fragment: none), then the exchange's buffers (:func:`prepare`)."""
    if resolve:
        nbytes = torch.tensor([e.nbytes for e in entries], dtype=torch.int64)
        resolve_owners(plan, ctx, dst_rank, sink, nbytes, what)
    else:
        plan.dests = torch.empty(0, dtype=torch.int64)
        plan.receipts = torch.empty((0, 4), dtype=torch.int64)
    prepare(plan, state, ctx.rank, ctx.device, cap)


def prepare(plan: EdgePlan, state: dict[str, torch.Tensor], me: int, link: torch.device,
            cap: int) -> None:
    """Plans this rank's messages (out per owner, in per sender, its own kept) and
    allocates every buffer the exchange needs: one message per peer each way."""
    assert plan.dests is not None and plan.receipts is not None
    zones = plan.zones
    if not plan.fragments and not len(plan.receipts) and not zones:
        return  # (nothing to send or write: no exchange)
    by_dest: dict[int, list[Segment]] = {}
    for seg, to in zip(plan.fragments, plan.dests.tolist()):
        by_dest.setdefault(to, []).append(seg)
    plan.kept = pack(by_dest.pop(me, []), cap)
    plan.outgoing = {r: pack(segs, cap) for r, segs in sorted(by_dest.items())}
    # Receipts come grouped by sender in rank order (resolve_owners sorts them so).
    receipts = plan.receipts
    counts = torch.bincount(receipts[:, _owners.R_SOURCE]).tolist() if len(receipts) else []
    for r, mine in enumerate(torch.split(receipts, counts)):
        if not len(mine):
            continue
        n = mine[:, _owners.R_NBYTES]
        starts = pack_bounds(n.tolist(), cap)
        tables = []
        for a, b in zip(starts, [*starts[1:], len(mine)]):
            at = torch.cumsum(n[a:b], 0) - n[a:b]
            tables.append(torch.stack((mine[a:b, _owners.R_ENTRY], mine[a:b, _owners.R_OFFSET],
                                       at, n[a:b]), 1))
        plan.incoming[r] = tables
    if zones:
        # After the fragments, in each pair's list: both ends cut the same segments.
        plan.kept += pack(zones.kept, cap)
        for r, segs in zones.outgoing.items():
            plan.outgoing.setdefault(r, []).extend(pack(segs, cap))
        for r, segs in zones.incoming.items():
            plan.incoming.setdefault(r, []).extend(pack(segs, cap))
        plan.outgoing = dict(sorted(plan.outgoing.items()))
    for r, ms in plan.outgoing.items():
        plan.send_bufs[r] = torch.empty(max(map(_message_nbytes, ms)), dtype=torch.uint8,
                                        device=link)
    for r, ts in plan.incoming.items():
        most = max(map(_table_nbytes, ts))
        plan.recv_bufs[r] = [torch.empty(most, dtype=torch.uint8, device=link)
                             for _ in range(min(2, len(ts)))]
    biggest = max([len(b) for b in [*plan.send_bufs.values(),
                                    *(bufs[0] for bufs in plan.recv_bufs.values())]]
                  + [_message_nbytes(m) for m in plan.kept] + [0])
    if link.type == "cuda" and biggest:
        plan.host = torch.empty(biggest, dtype=torch.uint8)
    stager = _Stager(state, max(cap, biggest), link, None, slot_bytes=cap)
    stager.reserve([m for ms in plan.outgoing.values() for m in ms] + plan.kept)
    plan.stager = stager


def _table_nbytes(rows: torch.Tensor | list[Segment]) -> int:
    """The bytes of an incoming message (its row table, or its sender's segments)."""
    if isinstance(rows, list):
        return _message_nbytes(rows)
    return int(rows[:, ROW_NBYTES].sum())


def _table(rows: torch.Tensor | list[Segment]) -> torch.Tensor:
    """The row table of an incoming message (computed here for a zone's segments, from
    the plan: where they go is never read from the wire)."""
    return _rows(rows) if isinstance(rows, list) else rows


def exchange(plan: EdgePlan, sink: Any, ctx: _agree.GroupContext, what: str,
             stop: StopSignal | None = None) -> None:
    """Sends this rank's fragments to their owners and writes the blocks it owns (its
    kept fragments and those it receives, through ``sink.write_edges``), in rounds (module
    docstring). A write or read that fails is raised once every round is done (the
    messages keep their sizes: no peer waits); a peer that fails is named. ``sink`` None
    (this rank failed already): it only sends and receives, so that no peer waits; so too,
    from then on, once ``stop`` says some rank failed."""
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
        if failures or sink is None or (stop is not None and stop.seen()):
            return
        try:
            sink.write_edges(to_host(data), rows)
        except BaseException as exc:  # noqa: BLE001 - raised once the rounds are done
            failures.append(exc)
            if stop is not None:
                stop.post()

    def body(_worker: Any) -> None:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        rounds = max([len(v) for v in plan.outgoing.values()]
                     + [len(v) for v in plan.incoming.values()] + [len(plan.kept)])
        landed: list[tuple[torch.Tensor, Any]] = []  # the last round's, still to write
        for k in range(rounds):
            ops, arriving = [], []
            for r, ms in plan.outgoing.items():
                if k < len(ms):
                    data, keep = stager.stage(ms[k], 0)
                    if keep is None:  # (packed in the stager's slot, reused below: copied)
                        buf = plan.send_bufs[r][: data.numel()]
                        buf.copy_(data)
                        data = buf
                    ops.append((dist.isend, data, ctx.ranks[r]))
            for r, ts in plan.incoming.items():
                if k < len(ts):
                    bufs = plan.recv_bufs[r]
                    buf = bufs[k % len(bufs)][: _table_nbytes(ts[k])]
                    ops.append((dist.irecv, buf, ctx.ranks[r]))
                    arriving.append((buf, ts[k]))
            done = False
            try:
                posted = _post(ops, ctx)
                # This rank's own fragments, a message a round while the others' travel: all
                # of them reach an owner in file order together, so that the regions they
                # fill complete as they go (written first, dst's would be spilled, 4 KiB a
                # write, before the others' bytes of the same regions arrived).
                if k < len(plan.kept):
                    data, _keep = stager.stage(plan.kept[k], 0)  # (sends were copied out)
                    write(data, _rows(plan.kept[k]))
                # The last round's messages, written while this one's travel (into the
                # other of each sender's two buffers).
                for buf, rows in landed:
                    write(buf, _table(rows))
                for work in posted:
                    work.wait()
                done = True
            finally:
                if not done:  # a peer failed: the transport may still use these buffers
                    _ABANDONED.append(plan)
            landed = arriving
        for buf, rows in landed:
            write(buf, _table(rows))
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
