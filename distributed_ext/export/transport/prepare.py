"""The data round's preparation: each rank's messages planned and every buffer they need
allocated up front (in the round that agrees the ranks are ready, not mid-stream). With
every rank writing, also the runs each writes itself, the fragments of the blocks runs share
(:mod:`transport.shared_blocks`) and the TP rows' zones (:mod:`plan.tp_regions`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distributed_ext import _agree, _direct_io
from distributed_ext.export.files.regions import REGION_BYTES
from distributed_ext.export.plan import block_owners as _owners
from distributed_ext.export.plan import tp_regions as _zones
from distributed_ext.export.plan.messages import Segment, edge_table, plan_messages, plan_streams
from distributed_ext.export.plan.types import Entry
from distributed_ext.export.transport import shared_blocks as _edges
from distributed_ext.export.transport.stager import _needs_pinned, _PinnedSlots, _Stager
from distributed_ext.export.transport.stop import StopSignal


@dataclass
class _Prepared:
    """What one rank allocated for the transfer, before it starts (:func:`_prepare_transfer`)."""

    messages: list[list[Segment]]  # this rank's own pieces, as messages
    stager: _Stager
    pinned: _PinnedSlots | None
    gpu_shards: bool
    # dst only: each sender's messages still to receive, and its free receive buffers
    plans: dict[int, collections.deque] = field(default_factory=dict)
    free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # writers="all": the pieces this rank writes itself (their middles): dst's beside
    # ``messages`` while it receives, a sender's after its transfer (stager: start_local())
    local_messages: list[list[Segment]] = field(default_factory=list)
    local_pinned: _PinnedSlots | None = None
    own_chunk: int = 0  # the size those are cut in (whole blocks)
    # writers="all": the fragments of shared blocks, and who writes them (:mod:`transport.shared_blocks`)
    edges: _edges.EdgePlan | None = None
    # writers="all": the flag that stops this rank's own writes once a rank failed
    stop: StopSignal | None = None

    def release(self) -> None:
        """Returns the transfer's pinned slots (never while a transport may read them)."""
        if self.pinned is not None:
            self.pinned.release()
            self.pinned = None

    def start_local(self, state: dict[str, torch.Tensor]) -> _Stager:
        """The host stager of the pieces this rank writes itself (``writers="all"``), made
        once the transfer is over: its pinned slot (for GPU bytes) is leased only then, when
        the transfer's slots are back in the pool, so the two never add up (at most three
        chunks pinned, the cached buffer reused). A failure here is this rank's, agreed in
        the transfer round: no peer waits on these writes."""
        if _needs_pinned(state, self.local_messages):
            # Copied on this thread's stream: whatever other streams still compute into the
            # shards lands first (as in _transfer).
            torch.cuda.synchronize()
            self.local_pinned = _PinnedSlots(1, self.own_chunk)
        stager = _Stager(state, self.own_chunk, torch.device("cpu"), self.local_pinned)
        stager.reserve(self.local_messages)
        return stager

    def release_local(self) -> None:
        """Returns the local writes' pinned slot (no transport ever reads it)."""
        if self.local_pinned is not None:
            self.local_pinned.release()
            self.local_pinned = None


def _short(e: Entry, p: Any) -> bool:
    """Whether a piece's runs are short (under :data:`plan.block_owners.SHORT_RUN`: small tensors, the
    rows of a ``Shard(1)``/TP layout): with ``writers="all"`` such pieces still go to dst,
    which assembles them into whole regions -- one write each -- rather than every rank
    writing its own few blocks between the others' (measured: the numbers at SHORT_RUN)."""
    return p.runs(e).run < _owners.SHORT_RUN


def _sort_pieces(entries: list[Entry], me: int, to_dst: list[tuple[Entry, Any]],
                 written: list[tuple[Entry, Any]]) -> None:
    """dst's pieces with every rank writing: short ones (any rank's, which it receives) to
    ``to_dst``, its own long ones to ``written``; the others' long ones it never sees.
    Entries that share one list of pieces (every key of an FSDP2 signature) are sorted
    once: the walk is per entry, not per piece (at world 1024, 1000x fewer steps)."""
    kinds: dict[tuple, tuple[list, list]] = {}
    for e in entries:
        if e.zoned:  # (:mod:`plan.tp_regions`)
            continue
        key = (id(e.pieces), e.shape, e.dtype.itemsize)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = ([], [])  # (short, own long)
            for p in e.pieces:
                if _short(e, p):
                    kind[0].append(p)
                elif p.rank == me:
                    kind[1].append(p)
        to_dst.extend((e, p) for p in kind[0])
        written.extend((e, p) for p in kind[1])


def _prepare_transfer(state: dict[str, torch.Tensor], entries: list[Entry],
                      ctx: _agree.GroupContext | None, dst_rank: int,
                      chunk: int, local: bool = False,
                      layout: Callable[[], Any] | None = None, mapped: bool = False
                      ) -> _Prepared:
    """Plans this rank's messages and allocates every buffer the transfer needs (raising
    here, in the round that agrees the ranks are ready, rather than mid-stream): dst two
    receive chunks per sender and its own pieces' slots, a sender its staging slots.
    ``ctx`` None: one process, no link.

    ``local`` (``writers="all"``): every rank, dst included, writes the whole aligned
    blocks of the runs it holds itself (:attr:`_Prepared.local_messages`: a sender's
    through :meth:`_Prepared.start_local` after its transfer; dst's beside its own short
    pieces while it receives: faster than writing them after, docs/measurements.md); what travels to dst is
    the pieces of short runs
    (:func:`_short`), which it assembles into regions. The bytes of blocks that runs share
    (their fragments: :func:`edge_table`) go to each block's owner, the holder of most of
    its bytes (:attr:`_Prepared.edges`: each rank's own table; the owners are planned in
    the next round, :mod:`transport.shared_blocks`), so that each block of the files has exactly one writer.
    ``layout()``: the files (a sink: each entry's file and offset). ``mapped`` (with
    ``local``; the files on a RAM filesystem, :func:`~files.writers.resolve_writers`):
    every rank writes every piece it holds, whole, through a shared mapping of the files
    (:meth:`~files.sinks.FileSink.write_middles`): nothing travels to dst, no block has an
    owner, no region an assembler."""
    me = 0 if ctx is None else ctx.rank
    link = torch.device("cpu") if ctx is None else ctx.device
    on_device = link.type == "cuda"  # NCCL: what crosses the link is device memory
    world = 1 if ctx is None else ctx.size
    # Every rank's messages on dst (it receives them all); a sender's own only.
    pairs = ((e, p) for e in entries for p in e.pieces)
    local_messages: list[list[Segment]] = []
    edge_plan = None
    own_chunk = chunk
    if not local:
        if me == dst_rank:
            streams = plan_streams(pairs, chunk, world)
        else:
            streams = [[] for _ in range(world)]
            streams[me] = plan_messages(((e, p) for e, p in pairs if p.rank == me), chunk)
    else:
        assert layout is not None, "writers='all' needs the files' layout"
        # The pieces a rank writes itself never cross the link: cut in whole blocks (a
        # chunk_bytes under 4 KiB or not a multiple of it would share a block between two
        # of its messages at every cut), so only a run's two ends are fragments.
        own_chunk = -(-chunk // _direct_io.ALIGN) * _direct_io.ALIGN
        # Every rank opens the files (joins dst's stage), whatever it holds: it may plan
        # the owners of others' shared blocks (:func:`transport.shared_blocks.resolve_owners`).
        files = layout()
        files.mapped = mapped
        if mapped:  # every piece by its holder: nothing to dst, no edges, no zones
            local_messages = plan_messages(((e, p) for e, p in pairs if p.rank == me),
                                           own_chunk, files.bases)
            streams = [[] for _ in range(world)]
        else:
            to_dst: list[tuple[Entry, Any]] = []  # short pieces, dst's own included
            written: list[tuple[Entry, Any]] = []  # this rank's long ones, written here
            if me == dst_rank:
                _sort_pieces(entries, me, to_dst, written)
            else:
                for e, p in pairs:
                    if p.rank == me and not e.zoned:
                        (to_dst if _short(e, p) else written).append((e, p))
            local_messages = plan_messages(written, own_chunk, files.bases)
            fragments, rows = edge_table(local_messages, files.bases, _direct_io.ALIGN)
            edge_plan = _edges.plan_edges(fragments, files, world, rows)
            # The rows of TP layouts: each region by the holder of most of its bytes.
            edge_plan.zones = _zones.plan_zones(entries, files.bases, me, dst_rank,
                                                _direct_io.ALIGN, REGION_BYTES)
            if me == dst_rank:  # each sender's stream: its short pieces
                streams = plan_streams(to_dst, chunk, world)
            else:
                streams = [[] for _ in range(world)]
                streams[me] = plan_messages(to_dst, chunk)
    messages = streams[me]
    # dst writes its own pieces' middles beside its short ones, while it receives.
    gpu_shards = _needs_pinned(state, messages + (local_messages if me == dst_rank else []))
    pinned = None
    prepared = None
    try:
        if me != dst_rank:
            if gpu_shards and not on_device:
                pinned = _PinnedSlots(3, chunk)
            stager = _Stager(state, chunk, link, pinned)
            stager.reserve(messages)
            prepared = _Prepared(messages, stager, pinned, gpu_shards)
            prepared.local_messages = local_messages  # written here: start_local()
            prepared.own_chunk = own_chunk
            prepared.edges = edge_plan
            return prepared
        # Pinned slots: 0 for the own-pieces thread (GPU shards), 1 for received device chunks.
        if gpu_shards or on_device:
            pinned = _PinnedSlots(2, max(chunk, own_chunk))
        stager = _Stager(state, chunk, torch.device("cpu"), pinned)
        stager.reserve(messages + local_messages)
        prepared = _Prepared(messages, stager, pinned, gpu_shards)
        prepared.local_messages, prepared.edges = local_messages, edge_plan
        for r, planned in enumerate(streams):
            if r == me or not planned:
                continue
            prepared.plans[r] = collections.deque(planned)
            if on_device:
                prepared.free[r] = list(torch.empty((2, chunk), dtype=torch.uint8, device=link))
            else:
                # (huge pages: what dst writes direct from them goes in few segments)
                prepared.free[r] = [_direct_io.huge_empty(chunk + 2 * _direct_io.ALIGN)
                                    for _ in range(2)]
        return prepared
    except BaseException:
        if pinned is not None:
            pinned.release()
        raise
