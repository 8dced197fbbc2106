"""The plan, the one contract between the modules of the export: for each tensor to write,
which rank sends which block of it and from which in-memory tensor. Computed alike on every
rank from the metadata round; checks raised here are raised by every rank alike."""

from __future__ import annotations

import math

from distributed_ext.export.plan import block_owners
from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan.blocks import (
    Block,
    Runs,
    _intersect,
    _is_whole,
    _local_view,
    _overlap,
    _piece_runs,
    _tiles_exactly,
    whole_view,
)
from distributed_ext.export.plan.holdings import Holding
from distributed_ext.export.plan.safetensors import _DTYPE_BY_NAME
from distributed_ext.export.plan.types import Entry, Piece, Transform

# writers="all": a replicated block is split between its holders in row ranges of at least
# this many bytes each (so that each is one long run, written where it is held).
SPREAD_MIN = 2**20


def plan_entries(holdings: dict[str, Holding], written: list[_keys.Written] | None,
                 dst_rank: int, ranks: list[int], keep: int | None = None,
                 spread: bool = False) -> list[Entry]:
    """The export plan (the same on every rank): for each written tensor, which rank sends
    which block of it and from where; ValueError if a written tensor cannot be streamed or
    its blocks do not cover it. ``written`` None: every in-memory tensor as it is.

    A block several ranks hold (a replica) is sent once: by dst when it holds one, so that it
    never crosses the link, else by the holder that has the fewest bytes to send so far, so
    that replicas (an expert shard's ``edp`` copies, HSDP's replicated shards) spread the
    sending over their holders.

    ``keep``: make only this group rank's pieces (a sender needs no other's); every check
    and every choice is still made for all of them, so the kept pieces are the same.

    ``spread`` (every rank writes its own bytes: ``writers="all"``): a whole replicated block
    (an HSDP shard, a plain tensor several ranks hold) of at least two ``SPREAD_MIN`` is
    split by rows between its least-loaded holders, each writing its range from its own
    copy, so that the writing is spread over the holders and nothing crosses the link; the
    loads are then bytes written, dst's included.
    """
    load = _Load(len(ranks))  # bytes each rank sends (spread: writes) so far
    entries = []
    # A whole in-memory tensor's distinct blocks and their owners: computed once per list of
    # blocks, which every key of one DTensor signature shares.
    distinct: dict[int, list] = {}
    if written is None:  # a state dict: every tensor written whole, under its own key
        for key, holding in holdings.items():
            entry = Entry(key, _DTYPE_BY_NAME[holding.sig.dtype], holding.sig.shape,
                          index=len(entries))
            _add_whole(entry, key, holding, distinct, dst_rank, load, keep, share=True,
                       spread=spread)
            entries.append(entry)
        return entries
    for w in written:
        if w.unstreamable is not None:
            raise ValueError(
                f"{w.key!r}: transformers writes it through {w.unstreamable}, which cannot be "
                "streamed from the shards as blocks; call gather_full_state(model, "
                "hub_keys=False) and then save_pretrained on rank 0 with that state")
        if w.transform is not None:
            entries.append(_computed_entry(w, holdings, distinct, dst_rank, load, keep,
                                           len(entries)))
            continue
        entries.append(_plan_written(w, holdings, distinct, dst_rank, load, keep, spread,
                                     len(entries)))
    return entries


def _add_whole(entry: Entry, source: str, holding: Holding,
               distinct: dict[int, list], dst_rank: int, load: _Load,
               keep: int | None = None, share: bool = False, spread: bool = False) -> int:
    """Adds the pieces of a written tensor that is in-memory tensor ``source`` as it is (one
    per distinct block, or per holder's row range with ``spread``; ``keep``: only that
    rank's); returns the elements they cover (all of them: the blocks were checked to tile
    the tensor). ``share``: the entry has no other pieces, so it may take its signature's
    one list of pieces (no object per entry)."""
    got = _distinct_blocks(entry.key, holding, distinct)
    groups_list, fixed, covered = got[0], got[1], got[2]
    itemsize = entry.dtype.itemsize
    if fixed is not None:
        # No replica (FSDP2): every key of the signature has the same senders, blocks,
        # runs and bytes per sender; computed at its first key, then only counted.
        shared = got[3].get((itemsize, keep, spread))
        if shared is None:
            runs = [_piece_runs(wb, entry.shape, itemsize) for _s, wb in fixed]
            # Every holder's piece is kept where a rank may receive or send to any of them.
            zoned = spread and _zoned(runs)
            pieces = [Piece(sender, wb, wb.numel * itemsize, local=whole_view(wb), _runs=wb_runs)
                      for (sender, wb), wb_runs in zip(fixed, runs)
                      if keep is None or sender == keep or zoned]
            sends = [(sender, wb.numel * itemsize) for sender, wb in fixed
                     if (spread or sender != dst_rank) and wb.numel]
            shared = got[3][(itemsize, keep, spread)] = (pieces, sends, zoned)
        pieces, sends, zoned = shared
        load.add_each(sends)
        if share:
            entry.pieces, entry.source, entry.zoned = pieces, source, zoned
        else:  # (a part of a written tensor: never zoned)
            entry.pieces.extend(Piece(p.rank, p.block, p.nbytes, source, p.local, _runs=p._runs)
                                for p in pieces if keep is None or p.rank == keep)
        return covered
    # Replicated TP rows (HSDP x TP): each block from one of its holders, as below, and the
    # regions written by the sender of most of their bytes (every sender's piece kept).
    zoned = spread and share and _zoned([_piece_runs(wb, entry.shape, itemsize)
                                         for wb, _owners in groups_list])
    entry.zoned = zoned
    for wb, owners in groups_list:
        nbytes = wb.numel * itemsize
        ways = min(len(owners), nbytes // SPREAD_MIN, wb.shape[0] if wb.shape else 1)
        if spread and ways > 1 and _long_rows(wb, entry.shape, itemsize):
            _add_spread(entry, source, wb, owners, ways, load, keep)
            continue
        sender = _choose_sender(owners, dst_rank, load, zoned)
        if spread or sender != dst_rank:
            load.add(sender, nbytes)
        if keep is None or sender == keep or zoned:
            entry.pieces.append(Piece(sender, wb, nbytes, source, whole_view(wb)))
    return covered


def _plan_written(w: _keys.Written, holdings: dict[str, Holding], distinct: dict[int, list],
                  dst_rank: int, load: _Load, keep: int | None, spread: bool, index: int
                  ) -> Entry:
    """One written tensor's pieces: each part's blocks from their holders (a whole in-memory
    tensor's by :func:`_add_whole`)."""
    entry = Entry(w.key, w.dtype, w.shape, index=index)
    itemsize = w.dtype.itemsize
    covered = 0
    for part in w.parts:
        holding = holdings[part.source]
        _distinct_blocks(part.source, holding, distinct)  # they tile it exactly
        if _is_whole(part, holding.sig.shape):
            covered += _add_whole(entry, part.source, holding, distinct, dst_rank, load,
                                  keep, share=len(w.parts) == 1, spread=spread)
            continue
        blocks: dict[Block, list[tuple[int, Block, list[int], list[int]]]] = {}
        for r, held in holding.blocks:
            meet = _overlap(part, held)
            if meet is not None:
                blocks.setdefault(_intersect(part, *meet), []).append((r, held, *meet))
        for wb, owners in blocks.items():
            sender = _choose_sender([o[0] for o in owners], dst_rank, load)
            _r, held, lo, hi = next(o for o in owners if o[0] == sender)
            if sender != dst_rank:
                load.add(sender, wb.numel * itemsize)
            covered += wb.numel
            if keep is None or sender == keep:
                local, perm = _local_view(part, held, lo, hi)
                entry.pieces.append(Piece(sender, wb, wb.numel * itemsize, part.source,
                                          local, perm))
    _check_covered(entry, covered)
    return entry


def _split_pair_message(key: str, t: Transform, rank: int, start: int, count: int,
                        total: int) -> str:
    """Why a shard boundary that splits rows packed together is refused, and what a user of
    FSDP2 (``fsdp2_wrap``: ``ceil(rows / world)`` rows a rank) can do instead."""
    even = [n for n in range(1, 17) if -(-total // n) % t.step == 0]
    fsdp = (f" FSDP2 (fsdp2_wrap) gives each rank ceil({total} / world) rows: at world "
            f"{', '.join(map(str, even[:6]))} every boundary falls between pairs;") if even else ""
    return (f"{key!r}: {t.what} packs {t.step} rows of its weight together, but group rank "
            f"{rank} holds its rows {start}..{start + count - 1} ({count} rows), so a shard "
            f"boundary splits a packed pair.{fsdp} shard it so that each rank's rows start and "
            f"end on a multiple of {t.step}, or export with "
            "modelopt.torch.export.export_hf_checkpoint (which gathers the model on one rank)")


def _computed_entry(w: _keys.Written, holdings: dict[str, Holding], distinct: dict[int, list],
                    dst_rank: int, load: _Load, keep: int | None, index: int) -> Entry:
    """A written tensor computed row block by row block (``w.transform``) from the tensor
    transformers would write in its place (``w.parts``, of the transform's source dtype and
    shape): each block of that tensor, as the plan would send it, becomes the block of the
    computed tensor it makes, on the rank that holds it. ValueError (on every rank alike:
    every block is checked, ``keep`` or not) where a block does not hold whole rows, or a
    shard boundary splits ``step`` rows."""
    t: Transform = w.transform
    plain = _keys.Written(w.key, t.source_dtype, t.source_shape, w.parts)
    source = _plan_written(plain, holdings, distinct, dst_rank, load, None, False, index)
    entry = Entry(w.key, w.dtype, w.shape, index=index, transform=t)
    itemsize = w.dtype.itemsize
    shape = t.source_shape
    for p in source.pieces:
        b = p.block
        if b.numel == 0:
            continue
        if b.shape[1:] != shape[1:]:
            raise ValueError(
                f"{w.key!r}: {t.what} is computed from whole rows of its weight "
                f"{list(shape)}, but group rank {p.rank} holds its block at {list(b.offset)} "
                f"of shape {list(b.shape)} (a shard boundary splits its rows); shard the "
                "weight by rows (Shard(0), as FSDP2 does) to export it quantized")
        if b.offset[0] % t.step or b.shape[0] % t.step:
            raise ValueError(_split_pair_message(w.key, t, p.rank, b.offset[0], b.shape[0],
                                                 shape[0]))
        if keep is not None and p.rank != keep:
            continue
        rows = b.shape[0] // t.step * t.out_rows
        block = Block((b.offset[0] // t.step * t.out_rows, *(0,) * (len(w.shape) - 1)),
                      (rows, *w.shape[1:]))
        entry.pieces.append(Piece(p.rank, block, block.numel * itemsize,
                                  p.source or source.source, p.local, p.perm, src=b))
    return entry


def _zoned(runs: list[Runs]) -> bool:
    """Whether the blocks of a tensor (no replica) are rows of a ``Shard(1)``/TP layout:
    more than one holder, each block many runs, each under ``SHORT_RUN`` -- interleaved
    with the others' in the file (:mod:`plan.tp_regions`)."""
    return len(runs) > 1 and all(r.counts and r.run < block_owners.SHORT_RUN for r in runs)


def _long_rows(wb: Block, shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a block's runs are long enough to be written where they are held (a row
    range of a column block, e.g. of a replicated TP shard, would be short runs: those are
    written by region instead, :mod:`plan.tp_regions`)."""
    return _piece_runs(wb, shape, itemsize).run >= block_owners.SHORT_RUN


def _add_spread(entry: Entry, source: str, wb: Block, owners: list[int], ways: int,
                load: _Load, keep: int | None) -> None:
    """A replicated block split by rows between its ``ways`` least-loaded holders (in rank
    order), each piece read from that holder's own copy (``local``: its rows of the block,
    where the block lies in the holder's shard)."""
    itemsize = entry.dtype.itemsize
    current = load.current()
    chosen = sorted(sorted(owners, key=lambda r: (current[r], r))[:ways])
    rows, extra = divmod(wb.shape[0], ways)
    row_bytes = wb.numel // wb.shape[0] * itemsize
    start = 0
    for i, sender in enumerate(chosen):
        n = rows + (i < extra)
        load.add(sender, n * row_bytes)
        if keep is None or sender == keep:
            block = Block((wb.offset[0] + start, *wb.offset[1:]), (n, *wb.shape[1:]))
            if wb.local is None:
                local: tuple[slice, ...] = (slice(start, start + n),)
            else:
                at = wb.local
                local = (slice(at[0] + start, at[0] + start + n),
                         *(slice(a, a + m) for a, m in zip(at[1:], wb.shape[1:])))
            entry.pieces.append(Piece(sender, block, n * row_bytes, source, local))
        start += n


def _distinct_blocks(key: str, holding: Holding, distinct: dict[int, list]) -> list:
    """A holding's distinct non-empty blocks and their owners (replicas grouped), computed
    once per list of blocks (every key of a signature shares one); ValueError naming ``key``
    unless they tile the tensor exactly -- every element in exactly one distinct block."""
    got = distinct.get(id(holding.blocks))
    if got is None:
        groups: dict[Block, list[int]] = {}
        for r, held in holding.blocks:
            if held.numel:
                groups.setdefault(held, []).append(r)
        # No replica among the blocks (FSDP2): each block's sender is its one owner, fixed
        # for every key of the signature, and what each rank sends is a constant per key.
        fixed = None
        if all(len(owners) == 1 for owners in groups.values()):
            fixed = [(owners[0], wb) for wb, owners in groups.items()]
        covered = sum(wb.numel for wb in groups)
        exact = _tiles_exactly(list(groups), holding.sig.shape)
        # [blocks and owners, fixed senders, elements covered, the fixed blocks' pieces and
        # what each sender sends, by (itemsize, kept rank) (made at the first key), the list
        # itself (kept with its id, so that the id is not reused), whether they tile it]
        got = distinct[id(holding.blocks)] = [list(groups.items()), fixed, covered, {},
                                              holding.blocks, exact]
    if not got[5]:
        listing = "; ".join(f"rank(s) {owners}: offset {b.offset} shape {b.shape}"
                            for b, owners in got[0][:8])
        raise ValueError(f"state[{key!r}]: the ranks' blocks of its {holding.sig.shape} "
                         f"elements overlap or leave gaps ({listing}{'; ...' if len(got[0]) > 8 else ''}); "
                         "every element must be held by exactly one block (or by identical "
                         "replicas of it)")
    return got


def check_keys(entries: list[Entry]) -> None:
    """ValueError naming the first key a safetensors reader would reject: ``__metadata__``
    (the header's own), or a string that is not valid UTF-8 (a lone surrogate)."""
    for e in entries:
        if e.key == "__metadata__":
            raise ValueError("state['__metadata__']: safetensors reserves this key for the "
                             "file's metadata; rename the tensor")
        try:
            e.key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"state[{e.key!r}]: the key is not valid UTF-8 ({exc.reason} at "
                             f"{exc.start}), which safetensors readers reject; rename the "
                             "tensor") from None


def _check_covered(entry: Entry, covered: int) -> None:
    if covered != math.prod(entry.shape):
        raise ValueError(f"state[{entry.key!r}]: the ranks' blocks cover {covered} of "
                         f"{math.prod(entry.shape)} elements (overlapping or missing shards)")


class _Load:
    """Bytes each rank sends so far, read only to choose among a replica's holders. What a
    fixed signature's key adds (the same per key) is counted per signature and summed in
    only when a choice reads the loads: a sender's plan stays O(keys), not O(keys x world)
    (100k keys at world 1024 would otherwise be 100M additions)."""

    def __init__(self, world: int) -> None:
        self._bytes = [0] * world
        self._pending: dict[int, list] = {}  # id(sends) -> [sends, keys that added them]

    def add(self, rank: int, nbytes: int) -> None:
        self._bytes[rank] += nbytes

    def add_each(self, sends: list[tuple[int, int]]) -> None:
        """Adds one key's ``(rank, bytes)`` sends (one list object per signature)."""
        got = self._pending.get(id(sends))
        if got is None:
            self._pending[id(sends)] = [sends, 1]
        else:
            got[1] += 1

    def current(self) -> list[int]:
        for sends, count in self._pending.values():
            for rank, nbytes in sends:
                self._bytes[rank] += nbytes * count
        self._pending.clear()
        return self._bytes


def _choose_sender(owners: list[int], dst_rank: int, load: _Load, zoned: bool = False
                   ) -> int:
    """Who sends a block: its one owner; dst if it holds a replica (it never crosses the
    link; but not for a ``zoned`` tensor's block: its regions' writers are its senders,
    not dst); else the replica holder with the fewest bytes to send (or write) so far."""
    if len(owners) == 1:
        return owners[0]
    if dst_rank in owners and not zoned:
        return dst_rank
    bytes_sent = load.current()
    return min(owners, key=lambda r: (bytes_sent[r], r))
