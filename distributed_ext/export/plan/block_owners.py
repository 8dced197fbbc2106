"""Who writes each shared block of the files (``writers="all"``): pure planning.

Every rank writes the whole aligned blocks inside its own runs; a block that several runs
cover in part (where one rank's run ends and another's begins; with a ``SHORT_RUN`` under
a block, several short runs) is shared, and its bytes -- the *fragments* of
:func:`~plan.messages.edge_table`, under a block each -- must be written
by one rank. The owner of a shared block is the rank that holds most of its bytes (ties:
dst, then the ranks by turns, block by block), so that the fewest bytes move; a block that
also holds bytes dst writes anyway -- the file's header, or short runs (under ``SHORT_RUN``: small tensors,
the partial blocks at a TP tensor's ends; :mod:`plan.tp_regions`), which dst assembles into regions
-- is dst's. The others send the owner their fragments there.

No rank sees every fragment: each knows its own. The blocks are dealt out to the ranks
(:func:`coordinators`), every fragment is sent to its block's rank, which plans the owners
of the blocks it was dealt (:func:`plan_dealt`) and tells each rank where its fragments go
and what it receives (:mod:`transport.shared_blocks`). Tables, not objects: a few tensor operations for any
number of fragments.
"""

from __future__ import annotations

from typing import Any

import torch

# A fragment table is a row table of :mod:`plan.messages` (one row per fragment, columns
# ``ROW_ENTRY``, ``ROW_OFFSET``, ``ROW_AT`` (unused here), ``ROW_NBYTES``).
from distributed_ext.export.plan.messages import ROW_ENTRY, ROW_NBYTES, ROW_OFFSET

# Runs shorter than this are not written where they are held: the rows of a
# ``Shard(1)``/TP layout (replicated or not) go to their region's owner (:mod:`plan.tp_regions`),
# other short runs (small tensors) to dst, which assemble them into whole regions:
# below it, a rank's runs interleave with the others' in the file, so it writes a few
# blocks per syscall, and most of its bytes become fragments, each a row to plan, send and
# write on its own: below 64 KiB, writing short runs where they are held was slower than
# dst's writing them (docs/measurements.md). The planning and the exchange take any
# threshold down to 512 bytes (tested); across nodes, where the link costs more than the
# syscalls, a lower one would move fewer bytes.
SHORT_RUN = 64 * 2**10


def fragments_per_block(align: int) -> int:
    """The most fragments one block can have: runs of at least ``SHORT_RUN`` bytes, at
    most ``align // SHORT_RUN`` inside it and two across its ends, each cut once at most by
    a message boundary (a writer's messages are whole blocks apart)."""
    return 2 * (align // SHORT_RUN + 2)


# Columns of a receipt table: the rank that sends the fragment, then the fragment's entry
# index, its offset in the written tensor and its bytes.
R_SOURCE, R_ENTRY, R_OFFSET, R_NBYTES = range(4)


def order_key(entry: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The canonical order of fragments, by (entry, offset): the order in which a rank
    sends them and its owners list them, computed alike at both ends."""
    return entry * 2**40 + offset


def block_keys(entry: torch.Tensor, offset: torch.Tensor, file_of: torch.Tensor,
               bases: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(file number, block index)`` of the bytes at ``offset`` of each ``entry``."""
    return file_of[entry], torch.div(bases[entry] + offset, align, rounding_mode="floor")


def _blocks_per_file(sizes: list[int], align: int) -> int:
    """The span of block indices a file can have: a block's dense key across the files is
    ``file number * this + block index`` (one int64 with no collision)."""
    return max(sizes) // align + 1


def coordinators(rows: torch.Tensor, file_of: torch.Tensor, bases: torch.Tensor,
                 sizes: list[int], world: int, align: int) -> torch.Tensor:
    """The rank that plans the owner of each fragment's block (``rows``: a fragment table):
    the blocks of the files dealt out in turn, so that every fragment of a block meets at
    one rank and each rank plans ~1/world of them."""
    fid, block = block_keys(rows[:, ROW_ENTRY], rows[:, ROW_OFFSET], file_of, bases, align)
    return (fid * _blocks_per_file(sizes, align) + block) % world


def dealt_bound(sizes: list[int], world: int, align: int) -> int:
    """The most fragments a rank can be dealt: :func:`fragments_per_block` per block dealt
    to it."""
    return fragments_per_block(align) * (len(sizes) * _blocks_per_file(sizes, align) // world
                                          + 1)


def check_counts(table: torch.Tensor, bound: Any, what_for: str, what: str,
                 ranks: list[int]) -> None:
    """Checks a W x W table of counts every rank sent (``table[r, c]``: from rank r, for
    rank c): none negative, each column's sum within ``bound`` (an int, or one per rank).
    Every rank checks the same table, so all raise alike (ValueError naming the rank)."""
    world = len(ranks)
    limit = torch.as_tensor(bound, dtype=torch.int64).expand(world)
    total = table.sum(0)
    bad = (table < 0).any(0) | (total > limit)
    if bool(bad.any()):
        c = int(bad.nonzero()[0, 0])
        raise ValueError(f"{what}: the ranks announced {table[:, c].tolist()} {what_for} rank "
                         f"{ranks[c]} of the shared blocks, at most {int(limit[c])} in all "
                         "can be (a malformed count)")


def plan_dealt(received: list[torch.Tensor], me: int, file_of: torch.Tensor,
               bases: torch.Tensor, sizes: list[int], nbytes: torch.Tensor, dst_rank: int,
               align: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, str] | None]:
    """The owners of the blocks dealt to rank ``me``, from the fragments every rank sent
    it there (``received``: per group rank, rows of entry, offset, nbytes, in its send
    order). Each rank's rows are checked first (entry, bounds, one block, dealt here); a
    malformed one's fragments all get destination -1 (refused there) and the first fault
    (that rank, what is wrong) is returned, for this rank to raise once every rank has its
    answer.

    Returns:
        Per rank, the destination of each fragment it sent; per rank, the receipts it gets
        (:func:`plan_receipts`); the fault, or None.
    """
    world = len(received)
    fault = None
    tables = []
    for r, got in enumerate(received):
        rows = torch.zeros((len(got), 4), dtype=torch.int64)
        rows[:, [ROW_ENTRY, ROW_OFFSET, ROW_NBYTES]] = got
        why = _check_fragments(rows, me, world, file_of, bases, sizes, nbytes, align)
        if why is not None:
            fault = fault or (r, why)
            rows = rows[:0]
        tables.append(rows)
    dests = plan_owners(tables, file_of, bases, sizes, dst_rank, align)
    receipts = plan_receipts(tables, dests)
    dests = [d if len(d) == len(got) else torch.full((len(got),), -1, dtype=torch.int64)
             for d, got in zip(dests, received)]
    return dests, receipts, fault


def _check_fragments(rows: torch.Tensor, me: int, world: int, file_of: torch.Tensor,
                     bases: torch.Tensor, sizes: list[int], nbytes: torch.Tensor,
                     align: int) -> str | None:
    """What is wrong with the first bad row of a fragment table from the wire, or None."""
    if not len(rows):
        return None
    bad = _not_fragments(rows[:, ROW_ENTRY], rows[:, ROW_OFFSET], rows[:, ROW_NBYTES],
                         nbytes, bases, align)
    if not bool(bad.any()):
        bad = coordinators(rows, file_of, bases, sizes, world, align) != me
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    return (f"row {i} (entry, offset, nbytes) {rows[i, [ROW_ENTRY, ROW_OFFSET, ROW_NBYTES]].tolist()} "
            "is not a fragment under one block of an entry, dealt to this rank")


def _not_fragments(entry: torch.Tensor, offset: torch.Tensor, n: torch.Tensor,
                   nbytes: torch.Tensor, bases: torch.Tensor, align: int,
                   also: torch.Tensor | None = None) -> torch.Tensor:
    """Per row from the wire, whether ``(entry, offset, n)`` is not a fragment -- bytes of
    an entry of the plan, under one block: its entry, sizes and offset first (with the
    rows ``also`` marks), and only if none is bad, indexing by entry, its bounds and
    block."""
    bad = (entry < 0) | (entry >= len(nbytes)) | (n <= 0) | (n >= align) | (offset < 0)
    if also is not None:
        bad |= also
    if bool(bad.any()):
        return bad
    start = bases[entry] + offset
    return (offset + n > nbytes[entry]) | (torch.div(start, align, rounding_mode="floor")
                                           != torch.div(start + n - 1, align,
                                                        rounding_mode="floor"))


def plan_owners(fragments: list[torch.Tensor], file_of: torch.Tensor, bases: torch.Tensor,
                sizes: list[int], dst_rank: int, align: int) -> list[torch.Tensor]:
    """Each fragment's destination: the owner of its block.

    Args:
        fragments: Per group rank, its fragment table (rows as above), in its send order.
        file_of: Per entry index, its file's number.
        bases: Per entry index, the file offset of its data.
        sizes: Per file number, its size in bytes.
        dst_rank: dst's group rank.
        align: The block size (``ALIGN``).

    Returns:
        Per rank, an int64 vector: the group rank each of its fragments goes to (itself
        where it owns the block).
    """
    world = len(fragments)
    counts = [len(t) for t in fragments]
    if not sum(counts):
        return [torch.empty(0, dtype=torch.int64) for _ in fragments]
    rows = torch.cat(fragments)
    rank = torch.repeat_interleave(torch.arange(world), torch.tensor(counts))
    fid, block = block_keys(rows[:, ROW_ENTRY], rows[:, ROW_OFFSET], file_of, bases, align)
    n = rows[:, ROW_NBYTES]
    # Dense block ids (a block's key would not fit with the rank in one int64 at 10k files).
    key = fid * _blocks_per_file(sizes, align) + block
    blocks, which = torch.unique(key, return_inverse=True)
    total = torch.zeros(len(blocks), dtype=torch.int64).index_add_(0, which, n)
    # What the runs' fragments leave of a block (inside its file) is header or short runs:
    # dst's.
    first = torch.zeros(len(blocks), dtype=torch.int64).scatter_(0, which, torch.arange(len(key)))
    size_of = torch.tensor(sizes, dtype=torch.int64)[fid[first]]
    number = block[first]  # each block's number in its file
    start = number * align
    rest = torch.clamp(size_of - start, max=align) - total
    # Bytes per (block, rank); the owner: most bytes, then dst, then the ranks by turns (the
    # first at or after the block's number, mod the world: a layout whose blocks tie the
    # same ranks every time -- aligned TP rows -- spreads them over the tied ranks).
    pairs, pair_of = torch.unique(which * world + rank, return_inverse=True)
    held = torch.zeros(len(pairs), dtype=torch.int64).index_add_(0, pair_of, n)
    pair_block, pair_rank = pairs // world, pairs % world
    turn = torch.remainder(pair_rank - number[pair_block], world)
    tiebreak = torch.where(pair_rank == dst_rank, 0, turn + 1)
    score = held * (world + 2) + (world + 1 - tiebreak)
    best = torch.zeros(len(blocks), dtype=torch.int64).scatter_reduce_(
        0, pair_block, score, "amax", include_self=False)
    winner = score == best[pair_block]
    owner = torch.empty(len(blocks), dtype=torch.int64)
    owner[pair_block[winner]] = pair_rank[winner]
    owner[rest > 0] = dst_rank
    return list(torch.split(owner[which], counts))


def plan_receipts(fragments: list[torch.Tensor], dests: list[torch.Tensor]
                  ) -> list[torch.Tensor]:
    """Per group rank, the fragments it receives (a receipt table): grouped by sender in
    rank order, each sender's in its send order. One stable sort of every moving fragment,
    not a pass over them per rank."""
    world = len(fragments)
    empty = torch.empty((0, 4), dtype=torch.int64)
    counts = [len(t) for t in fragments]
    if not sum(counts):
        return [empty] * world
    rows = torch.cat(fragments)
    src = torch.repeat_interleave(torch.arange(world), torch.tensor(counts))
    to = torch.cat(dests)
    moving = to != src
    rows, src, to = rows[moving], src[moving], to[moving]
    order = torch.sort(to * world + src, stable=True).indices
    table = torch.cat((src[order, None], rows[order][:, [ROW_ENTRY, ROW_OFFSET, ROW_NBYTES]]), 1)
    return list(torch.split(table, torch.bincount(to, minlength=world).tolist()))


def check_tables(dests: torch.Tensor, receipts: torch.Tensor, rows: torch.Tensor, me: int,
                 world: int, nbytes: torch.Tensor, file_of: torch.Tensor, bases: torch.Tensor,
                 align: int, any_block: bool = False) -> None:
    """Checks what the rank that planned some blocks sent this rank about its fragments
    there (``rows``) before any is used: every destination a group rank; every receipt
    from another rank, inside one block of an entry of the plan, grouped by sender in rank
    order and in each sender's order, in a block that this rank owns: one where it keeps a
    fragment of its own (``any_block``, dst's: any block, as it owns those holding header
    or short-run bytes too). ValueError naming the first bad row."""
    if len(dests) != len(rows):
        raise ValueError(f"{len(dests)} destinations for {len(rows)} fragments")
    bad = (dests < 0) | (dests >= world)
    if bool(bad.any()):
        raise ValueError(f"destination {int(dests[bad][0])} of fragment "
                         f"{int(bad.nonzero()[0, 0])} is not a group rank (0..{world - 1})")
    if not len(receipts):
        return
    if receipts.dim() != 2 or receipts.shape[1] != 4:
        raise ValueError(f"receipts of shape {tuple(receipts.shape)}, not (n, 4)")
    src, entry = receipts[:, R_SOURCE], receipts[:, R_ENTRY]
    offset, n = receipts[:, R_OFFSET], receipts[:, R_NBYTES]
    bad = _not_fragments(entry, offset, n, nbytes, bases, align,
                         also=(src < 0) | (src >= world) | (src == me))
    if not bool(bad.any()):
        # Grouped by sender in rank order, each sender's in its send order (canonical:
        # entry, offset), as both ends cut them into messages.
        key = order_key(entry, offset)
        bad[1:] |= (src[1:] < src[:-1]) | ((src[1:] == src[:-1]) & (key[1:] <= key[:-1]))
    if not bool(bad.any()) and not any_block:
        # The blocks this rank owns: those of its own fragments it keeps (dense keys).
        kept = rows[dests == me]
        fid, block = block_keys(kept[:, ROW_ENTRY], kept[:, ROW_OFFSET], file_of, bases, align)
        rfid, rblock = block_keys(entry, offset, file_of, bases, align)
        scale = int(torch.cat((block, rblock)).max()) + 1
        owned = torch.unique(fid * scale + block)
        keys = rfid * scale + rblock
        found = torch.searchsorted(owned, keys).clamp(max=max(len(owned) - 1, 0))
        bad = owned[found] != keys if len(owned) else torch.ones(len(keys), dtype=torch.bool)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"receipt {i} {receipts[i].tolist()} (source, entry, offset, "
                         "nbytes) is not a fragment of a block this rank owns")
