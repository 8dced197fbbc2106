"""Short runs gathered into aligned regions of a file, each written whole -- direct where
the filesystem takes it -- once complete: a ``Shard(1)``/TP layout's rows, small tensors,
the bytes of shared blocks. A writer's :class:`~files.sinks.FileSink` holds one."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distributed_ext import _direct_io, _native

# Short runs (under sinks.SMALL_RUN) are gathered into aligned regions of the file and each
# region written direct once whole; at most ASSEMBLY_BYTES of regions are held at once (the
# oldest then goes through the page cache).
REGION_BYTES = 2**20
ASSEMBLY_BYTES = 64 * 2**20


@dataclass
class _Region:
    """An aligned region of a shard file being assembled from short runs."""

    buf: torch.Tensor  # REGION_BYTES, aligned
    size: int  # the file's bytes in this region
    filled: int = 0
    # tables of rows (src_ptr, offset in it, nbytes) copied in; only the offsets and sizes
    # are used later (the sources are gone by then)
    ranges: list[torch.Tensor] = field(default_factory=list)


class Regions:
    """The regions one writer is assembling (at most ``ASSEMBLY_BYTES``, least recently
    filled spilled first), from two threads at once (dst's own pieces, received ones).

    ``heads``: per file, its header's bytes, which complete the first regions (dst's; a
    joined writer's is empty: the header is not its to write); ``opened(file)``: a context
    in which ``file`` is open; ``written``: the files written to are added to it."""

    def __init__(self, heads: dict[Any, bytes],
                 opened: Callable[[Any], contextlib.AbstractContextManager[None]],
                 written: set) -> None:
        self.heads, self.opened, self.written = heads, opened, written
        self._held: collections.OrderedDict[tuple[Any, int], _Region] = \
            collections.OrderedDict()  # (file, region index) -> being assembled, LRU last
        self._spilled: set[tuple[Any, int]] = set()  # regions gone to the page cache
        self._spare: list[torch.Tensor] = []  # region buffers to reuse
        self._region_lock = threading.Lock()

    def assemble(self, file: _direct_io.DirectFile, src: torch.Tensor, offset: torch.Tensor,
                 n: torch.Tensor) -> None:
        """Copies short runs (``src`` pointers, file ``offset``, ``n`` bytes: int64 vectors)
        into their regions (one native pass per region); a region complete is written
        whole, direct where the filesystem takes it (through the page cache elsewhere, one
        write instead of a syscall per run). Regions over ``ASSEMBLY_BYTES`` are spilled,
        oldest first, through the page cache (a region shared with long runs, which go
        direct by themselves, completes only at the end)."""
        index = torch.div(offset, REGION_BYTES, rounding_mode="floor")
        within = offset - index * REGION_BYTES
        over = within + n - REGION_BYTES
        cross = over > 0
        if bool(cross.any()):  # a run over a region's end: its tail starts the next one
            tail = over[cross]  # (runs are under SMALL_RUN <= REGION_BYTES: one boundary)
            head = n - over.clamp(min=0)
            src = torch.cat((src, src[cross] + head[cross]))
            index = torch.cat((index, index[cross] + 1))
            within = torch.cat((within, torch.zeros_like(tail)))
            n = torch.cat((head, tail))
        table = torch.stack((src, within, n), 1)
        if len(index) > 1 and not bool((index[1:] >= index[:-1]).all()):
            order = torch.argsort(index, stable=True)
            index, table = index[order], table[order]
        regions, counts = torch.unique_consecutive(index, return_counts=True)
        ends = counts.cumsum(0)
        totals = table[:, 2].cumsum(0)[ends - 1]
        totals[1:] -= totals[:-1].clone()
        self.written.add(file)
        through_cache: list[torch.Tensor] = []
        complete: list[tuple[int, _Region]] = []
        with self._region_lock:
            begin = 0
            for index_i, end, nbytes in zip(regions.tolist(), ends.tolist(), totals.tolist()):
                rows, begin = table[begin:end], end
                key = (file, index_i)
                if key in self._spilled:
                    spilled = rows.clone()
                    spilled[:, 1] += index_i * REGION_BYTES
                    through_cache.append(spilled)
                    continue
                region = self._held.get(key)
                if region is None:
                    region = self._held[key] = self._new_region(file, index_i)
                else:
                    self._held.move_to_end(key)
                _native.pack_segments(region.buf, rows)  # the sources: held by the caller
                region.filled += nbytes
                region.ranges.append(rows)  # (their pointers are not kept valid: unused)
                if region.filled >= region.size:
                    del self._held[key]
                    complete.append((index_i, region))
            evicted = []
            while len(self._held) * REGION_BYTES > ASSEMBLY_BYTES:
                key, region = self._held.popitem(last=False)
                self._spilled.add(key)
                evicted.append((key, region))
        if through_cache:
            with self.opened(file):
                file.write_segments(torch.cat(through_cache))
        for index_i, region in complete:
            with self.opened(file):
                file.write(index_i * REGION_BYTES, region.buf[: region.size])
            self._release_region(region)
        for (other, index_i), region in evicted:
            self._spill(other, index_i, region)

    def _new_region(self, file: _direct_io.DirectFile, index: int) -> _Region:
        buf = self._spare.pop() if self._spare else _direct_io.aligned_empty(REGION_BYTES)
        start = index * REGION_BYTES
        region = _Region(buf, min(REGION_BYTES, file.size - start))
        head = self.heads.get(file, b"")
        if start < len(head):  # the header's bytes (already in the file) complete it too
            part = head[start : start + REGION_BYTES]
            buf[: len(part)].copy_(torch.frombuffer(bytearray(part), dtype=torch.uint8))
            region.filled = len(part)
            region.ranges.append(torch.tensor([[0, 0, len(part)]], dtype=torch.int64))
        return region

    def _release_region(self, region: _Region) -> None:
        with self._region_lock:
            if len(self._spare) < ASSEMBLY_BYTES // REGION_BYTES:  # the most held at once
                self._spare.append(region.buf)

    def _spill(self, file: _direct_io.DirectFile, index: int, region: _Region) -> None:
        """Writes what a region holds through the page cache (it will not be written direct)."""
        ranges = torch.cat(region.ranges)
        within, n = ranges[:, 1], ranges[:, 2]
        # Adjacent ranges written as one (a TP zone's rows: one write, not one per row).
        order = torch.argsort(within)
        within, n = within[order], n[order]
        new = torch.ones(len(within), dtype=torch.bool)
        new[1:] = within[1:] != within[:-1] + n[:-1]
        group = torch.cumsum(new, 0) - 1
        within = within[new]
        n = torch.zeros(len(within), dtype=torch.int64).index_add_(0, group, n)
        table = torch.stack((within + region.buf.data_ptr(), within + index * REGION_BYTES, n), 1)
        with self.opened(file):
            file.write_segments(table)
        self._release_region(region)

    def flush(self) -> None:
        """Writes every region still being assembled (each shares bytes with long runs)."""
        with self._region_lock:
            left, self._held = list(self._held.items()), collections.OrderedDict()
        for (file, index), region in left:
            self._spill(file, index, region)
