"""Boxes of tensors and where their bytes lie: a block's contiguous runs in the full tensor
(held as arithmetic), whether blocks tile a tensor exactly, and where a part of a written
tensor meets a held block. Pure functions of shapes, unit-tested in one process."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from distributed_ext.export.plan import keys as _keys


@dataclass(frozen=True, slots=True)
class Block:
    """A block of a tensor: ``offset`` and ``shape`` per dim. ``local``: where a holder's
    local shard holds more than this block (a ``_StridedShard`` shard is several), the
    block's offset in it; None where the block is the whole local shard. Not compared: the
    replicas of a block are one block, each holder's at the same place in its shard."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local: tuple[int, ...] | None = field(default=None, compare=False)
    numel: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))


def _piece_runs(b: Block, shape: tuple[int, ...], itemsize: int) -> Runs:
    """A block's runs in a tensor of ``shape`` (shared between pieces: immutable)."""
    if b.shape[1:] == shape[1:] and b.shape:
        # Whole rows (a Shard(0) block, a whole tensor): one run, nothing to search.
        row = b.numel // b.shape[0] * itemsize if b.shape[0] else 0
        return Runs(b.offset[0] * row, b.numel * itemsize)
    return _cached_runs(b, shape, itemsize)


def _tiles_exactly(blocks: list[Block], shape: tuple[int, ...]) -> bool:
    """Whether distinct boxes tile a tensor of ``shape``: each inside it, pairwise disjoint,
    their volumes summing to its volume. The layouts torch's placements make are grids (per
    dim, intervals that partition the dim; every combination a block): checked in
    O(blocks); anything else pairwise."""
    if sum(b.numel for b in blocks) != math.prod(shape):
        return False
    if math.prod(shape) == 0 and shape:
        return True  # no elements (a dim of size 0): nothing to tile, every block empty
    if not shape:
        return len(blocks) == 1
    for b in blocks:
        if any(o < 0 or o + n > d for o, n, d in zip(b.offset, b.shape, shape)):
            return False
    per_dim = [sorted({(b.offset[d], b.offset[d] + b.shape[d]) for b in blocks})
               for d in range(len(shape))]
    partitions = all(
        iv[0][0] == 0 and iv[-1][1] == shape[d]
        and all(a[1] == b[0] for a, b in zip(iv, iv[1:])) for d, iv in enumerate(per_dim))
    if partitions and math.prod(len(iv) for iv in per_dim) == len(blocks):
        return True  # distinct blocks, each a grid cell, as many as cells: the grid itself
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            if all(ao < bo + bn and bo < ao + an
                   for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape)):
                return False
    return True


def _is_whole(part: _keys.Part, src_shape: tuple[int, ...]) -> bool:
    """Whether a part is its in-memory tensor as it is (the written tensor is that tensor)."""
    nd = len(src_shape)
    return (part.shape == src_shape and part.src_dims == tuple(range(nd))
            and not any(part.at) and not any(part.src_start))


def _overlap(part: _keys.Part, held: Block) -> tuple[list[int], list[int]] | None:
    """Where a part's box and a holder's block of its in-memory tensor meet: the first and
    one-past-last index per in-memory dim, or None if they do not."""
    lo, hi = [], []
    for d in range(len(held.shape)):
        a = max(part.src_start[d], held.offset[d])
        b = min(part.src_stop(d), held.offset[d] + held.shape[d])
        if a >= b:
            return None
        lo.append(a)
        hi.append(b)
    return lo, hi


def _intersect(part: _keys.Part, lo: list[int], hi: list[int]) -> Block:
    """The block of the written tensor that an overlap (:func:`_overlap`) supplies."""
    offset, shape = [], []
    for j, d in enumerate(part.src_dims):
        if d < 0:
            offset.append(part.at[j])
            shape.append(1)
        else:
            offset.append(part.at[j] + lo[d] - part.src_start[d])
            shape.append(hi[d] - lo[d])
    return Block(tuple(offset), tuple(shape))


def whole_view(block: Block) -> tuple[slice, ...] | None:
    """Slices of a holder's local shard that give ``block`` (None: all of it)."""
    if block.local is None:
        return None
    return tuple(slice(s, s + n) for s, n in zip(block.local, block.shape))


def _local_view(part: _keys.Part, held: Block, lo: list[int], hi: list[int]
                ) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """Slices of the holder's local block (an overlap in its coordinates) and the dim order
    that give a piece's bytes."""
    at = held.local or (0,) * len(held.offset)
    local = tuple(slice(a - o + s, b - o + s) for a, b, o, s in zip(lo, hi, held.offset, at))
    order = [d for d in part.src_dims if d >= 0]
    perm = order + [d for d in range(len(held.shape)) if d not in order]
    return local, tuple(perm)


@dataclass(frozen=True, slots=True)
class Runs:
    """The contiguous runs a block occupies in its full tensor, in the block's own row-major
    order (the order its local bytes have), held as arithmetic, not as a list: run ``i``
    (mixed radix over ``counts``) starts at byte ``base + sum(i_d * strides[d])`` and is
    ``run`` bytes long. A Shard(1) block of an expert-TP tensor has hundreds of thousands of
    runs; this is a few integers whatever their number."""

    base: int
    run: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    def __len__(self) -> int:
        return math.prod(self.counts)

    def start_of(self, i: int) -> int:
        """Where run ``i`` starts in the full tensor (bytes)."""
        offset = self.base
        for count, stride in zip(reversed(self.counts), reversed(self.strides)):
            i, k = divmod(i, count)
            offset += k * stride
        return offset

    def pieces(self, start: int, n: int, at: int = 0) -> list[tuple[int, int, int]]:
        """``(offset in the full tensor, offset in the message, nbytes)`` of the bytes
        ``[start, start + n)`` of the block, which sit at ``at`` of a message."""
        if not self.counts:
            return [(self.base + start, at, n)]
        out = []
        i, skip = divmod(start, self.run)
        while n > 0:
            m = min(self.run - skip, n)
            out.append((self.start_of(i) + skip, at, m))
            at += m
            n -= m
            skip = 0
            i += 1
        return out

    def table(self, start: int, n: int, at: int = 0) -> torch.Tensor:
        """:meth:`pieces` as an int64 table, one row ``(offset in the full tensor, offset
        in the message, nbytes)`` per run, computed with a few tensor operations however
        many runs the bytes span (a TP block's rows: thousands per message)."""
        if not self.counts:
            return torch.tensor([[self.base + start, at, n]], dtype=torch.int64)
        end = start + n
        i = torch.arange(start // self.run, (end - 1) // self.run + 1, dtype=torch.int64)
        first = i * self.run  # where each run starts in the block's bytes
        lo, hi = first.clamp(min=start), (first + self.run).clamp(max=end)
        offset = torch.full_like(i, self.base) + (lo - first)
        rest = i
        for count, stride in zip(reversed(self.counts), reversed(self.strides)):
            offset += (rest % count) * stride
            rest = rest // count
        return torch.stack((offset, lo - start + at, hi - lo), 1)


def block_runs(block: Block, shape: tuple[int, ...], itemsize: int) -> Runs:
    """The runs of ``block`` in a tensor of ``shape`` (see :class:`Runs`)."""
    ndim = len(shape)
    if ndim == 0:
        return Runs(0, itemsize)
    # Dims after j are whole: one run spans block.shape[j] * prod(shape[j+1:]) elements.
    j = ndim - 1
    while j > 0 and block.shape[j] == shape[j] and block.offset[j] == 0:
        j -= 1
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(ndim)]
    base = sum(block.offset[d] * strides[d] for d in range(j + 1))
    run = block.shape[j] * strides[j]
    # Outer dims of one index (a dim of size 1) add nothing: dropped, so a Shard(0) block
    # or a whole tensor is one run with no arithmetic.
    outer = [(block.shape[d], strides[d]) for d in range(j) if block.shape[d] != 1]
    return Runs(base, run, tuple(c for c, _s in outer), tuple(s for _c, s in outer))


# Blocks of one signature share their runs (a few integers each).
_cached_runs = functools.lru_cache(maxsize=4096)(block_runs)
