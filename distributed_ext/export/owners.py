"""Who writes each shared block of the files (``writers="all"``): pure planning, on dst.

Every rank writes the whole aligned blocks inside its own long runs; a block that several
runs cover in part (where one rank's run ends and another's begins) is shared, and its bytes
-- the *fragments* of :func:`~distributed_ext.export.messages.edge_segments`, under a block
each -- must be written by one rank. The owner of a shared block is the rank that holds
most of its bytes (ties: dst, then the lowest rank), so that the fewest bytes move; a block
that also holds bytes dst writes anyway -- the file's header, or short runs (small tensors,
``Shard(1)`` rows), which dst assembles into regions -- is dst's. The others send the owner
their fragments there.

dst plans every rank's pieces, so it alone sees every fragment: it computes the owners here
and tells each rank what to send where and what it receives (:mod:`.edges`). Tables, not
objects: a few tensor operations for any number of fragments.
"""

from __future__ import annotations

import torch

# A fragment table is a row table of :mod:`.messages` (one row per fragment, columns
# ``ROW_ENTRY``, ``ROW_OFFSET``, ``ROW_AT`` (unused here), ``ROW_NBYTES``).
from distributed_ext.export.messages import ROW_ENTRY, ROW_NBYTES, ROW_OFFSET

# Columns of a receipt table: the rank that sends the fragment, then the fragment's entry
# index, its offset in the written tensor and its bytes.
R_SOURCE, R_ENTRY, R_OFFSET, R_NBYTES = range(4)


def block_keys(entry: torch.Tensor, offset: torch.Tensor, file_of: torch.Tensor,
               bases: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(file number, block index)`` of the bytes at ``offset`` of each ``entry``."""
    return file_of[entry], torch.div(bases[entry] + offset, align, rounding_mode="floor")


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
    key = fid * (max(sizes) // align + 1) + block
    blocks, which = torch.unique(key, return_inverse=True)
    total = torch.zeros(len(blocks), dtype=torch.int64).index_add_(0, which, n)
    # What the runs' fragments leave of a block (inside its file) is header or short runs:
    # dst's.
    first = torch.zeros(len(blocks), dtype=torch.int64).scatter_(0, which, torch.arange(len(key)))
    size_of = torch.tensor(sizes, dtype=torch.int64)[fid[first]]
    start = block[first] * align
    rest = torch.clamp(size_of - start, max=align) - total
    # Bytes per (block, rank); the owner: most bytes, then dst, then the lowest rank.
    pairs, pair_of = torch.unique(which * world + rank, return_inverse=True)
    held = torch.zeros(len(pairs), dtype=torch.int64).index_add_(0, pair_of, n)
    pair_block, pair_rank = pairs // world, pairs % world
    tiebreak = torch.where(pair_rank == dst_rank, 0, pair_rank + 1)
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
                 align: int) -> None:
    """Checks what dst sent this rank about its fragments (``rows``) before any is used:
    every destination a group rank; every receipt from another rank, inside one block of
    an entry of the plan that this rank owns (one where it keeps a fragment of its own).
    ValueError naming the first bad row."""
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
    bad = (src < 0) | (src >= world) | (src == me) | (entry < 0) | (entry >= len(nbytes))
    bad |= (n <= 0) | (n >= align) | (offset < 0)
    if not bool(bad.any()):
        bad = offset + n > nbytes[entry]
        start = bases[entry] + offset
        bad |= torch.div(start, align, rounding_mode="floor") != \
            torch.div(start + n - 1, align, rounding_mode="floor")
    if not bool(bad.any()):
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
