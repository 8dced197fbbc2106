"""A DCP checkpoint's saved chunks as the export's holdings: each chunk cut into blocks of
whole rows of at most ``SAVED_BLOCK_BYTES`` (contiguous in its file), each block read by one
rank, the ranks taking consecutive spans of the checkpoint's bytes. The plan above
(:mod:`plan.pieces`) then makes pieces of them as it does of in-memory shards; the transport
reads each from its file (:class:`files.saved.SavedSource`). Pure: shapes and offsets only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distributed_ext.export.plan.blocks import Block, _tiles_exactly
from distributed_ext.export.plan.entries import Signature
from distributed_ext.export.plan.holdings import Holding
from distributed_ext.export.plan.safetensors import SAFETENSORS_DTYPES, _dtype_name

# The most saved bytes one block (so one piece, read at once) holds: what bounds a rank's
# memory, whatever the size of a saved chunk.
SAVED_BLOCK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Chunk:
    """A saved chunk: its box in the tensor, and its item in a file (``start``, ``length``:
    the raw row-major bytes where ``raw``, else a ``torch.save`` zip to locate them in)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    start: int
    length: int
    raw: bool


@dataclass
class SavedTensor:
    """A key of the checkpoint: its dtype, global shape and saved chunks."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk]

    def chunk_holding(self, lo: list[int], hi: list[int], first: int = 0) -> tuple[int, Chunk]:
        """The chunk whose box holds the box ``lo .. hi`` (and its index), looked for from
        chunk ``first`` on (a reader's last: consecutive boxes mostly share a chunk)."""
        n = len(self.chunks)
        for i in (j % n for j in range(first, first + n)):
            c = self.chunks[i]
            if all(o <= a and b <= o + k for a, b, o, k in zip(lo, hi, c.offsets, c.sizes)):
                return i, c
        raise ValueError(f"no saved chunk of {self.key!r} holds the box {lo}..{hi}")


def check_against_model(saved: dict[str, SavedTensor], wanted: dict[str, torch.Tensor],
                        prefix: str) -> None:
    """ValueError naming the first key the model needs that the checkpoint lacks (with the
    keys it has under ``prefix``), whose shape differs from the model's, whose dtype is of
    another kind (a float saved as an int), that safetensors cannot store, or whose chunks
    do not tile it exactly."""
    missing = [k for k in wanted if k not in saved]
    if missing:
        have = sorted(saved)[:5]
        raise ValueError(
            f"the checkpoint has no key {prefix + missing[0]!r} ({len(missing)} of the model's "
            f"{len(wanted)} keys missing under prefix={prefix!r}; it has "
            f"{[prefix + k for k in have]}{' ...' if len(saved) > 5 else ''}); pass the prefix "
            "its model's keys are saved under (e.g. prefix='model.' for torchtitan's "
            "{'model': ...}) and the config of the model that was saved")
    for key, tensor in wanted.items():
        t = saved[key]
        if tuple(tensor.shape) != t.shape:
            raise ValueError(f"the checkpoint's {prefix + key!r} has shape {list(t.shape)}, "
                             f"but the config's model has {list(tensor.shape)}; pass the config "
                             "of the model that was saved")
        if tensor.dtype.is_floating_point != t.dtype.is_floating_point:
            raise ValueError(f"the checkpoint's {prefix + key!r} is {t.dtype}, but the config's "
                             f"model holds {tensor.dtype} there; pass the config of the model "
                             "that was saved")
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"the checkpoint's {prefix + key!r} is {t.dtype}, which "
                             "safetensors cannot store; pass dtype= to cast it")
        boxes = [Block(c.offsets, c.sizes) for c in t.chunks]
        if any(len(c.sizes) != len(t.shape) for c in t.chunks) or not _tiles_exactly(
                boxes, t.shape):
            listing = "; ".join(f"offsets {list(c.offsets)} sizes {list(c.sizes)}"
                                for c in t.chunks[:6])
            raise ValueError(f"the checkpoint's {prefix + key!r}: its saved chunks do not cover "
                             f"its {list(t.shape)} elements exactly ({listing}"
                             f"{'; ...' if len(t.chunks) > 6 else ''}); save it again")


def saved_blocks(chunk: Chunk, itemsize: int, cap: int = SAVED_BLOCK_BYTES) -> list[Block]:
    """A chunk cut into blocks each contiguous in it and of at most ``cap`` bytes (or one
    element's row where a single one is larger), in its row-major order: runs of indices of
    the outermost dim whose rest fits, the dims before it one index at a time. ``local`` is
    each block's offset (the source reads global coordinates)."""
    sizes = chunk.sizes
    if not sizes or math.prod(sizes) * itemsize <= cap:
        return [Block(chunk.offsets, sizes, chunk.offsets)]
    # The outermost dim d whose trailing rows fit: cut it, and take each index before it.
    d = next((d for d in range(len(sizes)) if math.prod(sizes[d + 1:]) * itemsize <= cap),
             len(sizes) - 1)
    step = max(1, cap // max(1, math.prod(sizes[d + 1:]) * itemsize))
    out = []
    for outer in _indices(sizes[:d]):
        for a in range(0, sizes[d], step):
            n = min(step, sizes[d] - a)
            offset = tuple(o + i for o, i in zip(chunk.offsets, (*outer, a, *[0] * (
                len(sizes) - d - 1))))
            shape = (*[1] * d, n, *sizes[d + 1:])
            out.append(Block(offset, shape, offset))
    return out


def _indices(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in dims:
        out = [(*i, j) for i in out for j in range(n)]
    return out


def saved_holdings(saved: dict[str, SavedTensor], keys: list[str],
                   dtypes: dict[str, torch.dtype], world: int,
                   cap: int = SAVED_BLOCK_BYTES) -> dict[str, Holding]:
    """The holdings of ``keys`` (in the order they are written) over ``world`` ranks: each
    chunk's blocks (:func:`saved_blocks`) in key order, rank ``r`` reading the blocks whose
    middle byte falls in the ``r``-th ``1/world`` of the checkpoint's bytes (so each rank
    reads and writes long consecutive spans). ``dtypes``: each key's output dtype."""
    blocks: dict[str, list[Block]] = {}
    for key in keys:
        t = saved[key]
        blocks[key] = [b for c in sorted(t.chunks, key=lambda c: c.offsets)
                       for b in saved_blocks(c, t.dtype.itemsize, cap)]
    total = sum(b.numel * saved[k].dtype.itemsize for k in keys for b in blocks[k]) or 1
    at = 0
    out = {}
    for key in keys:
        itemsize = saved[key].dtype.itemsize
        held = []
        for b in blocks[key]:
            n = b.numel * itemsize
            held.append((min(world - 1, (at + n // 2) * world // total), b))
            at += n
        held.sort(key=lambda rb: rb[0])
        sig = Signature(_dtype_name(dtypes[key]), saved[key].shape)
        out[key] = Holding(key, sig, held)
    return out
