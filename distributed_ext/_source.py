"""ByteSource: an ordered list of borrowed byte segments read as one stream.

The transport moves a ByteSource chunk by chunk. A chunk that lies inside one segment is sent
as a view of it (zero copy); a chunk that straddles segments is packed into a staging buffer
by the compiled core (one call, GIL released). Lifetime rule: the segments are views of the
caller's objects (bytes, tensors); the caller keeps those alive and unmodified until the
transfer that reads them has completed.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence

import torch

from distributed_ext import _native


def byte_tensor(view: memoryview | bytearray) -> torch.Tensor:
    """A uint8 CPU tensor viewing ``view``'s memory (no copy); the view must outlive it."""
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Read-only buffers (bytes) are only ever read through this tensor (sent).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class ByteSource:
    """Flat uint8 CPU tensors, in order, read as one stream of ``nbytes`` bytes."""

    def __init__(self, segments: Sequence[torch.Tensor]) -> None:
        self.segments = [s for s in segments if s.numel()]
        self.starts: list[int] = []
        pos = 0
        for s in self.segments:
            if s.device.type != "cpu" or s.dtype != torch.uint8 or s.dim() != 1:
                raise ValueError("ByteSource: segments must be flat uint8 CPU tensors")
            self.starts.append(pos)
            pos += s.numel()
        self.nbytes = pos

    def view(self, start: int, n: int) -> torch.Tensor | None:
        """``[start, start + n)`` as a view if it lies inside one segment, else None."""
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        i = bisect.bisect_right(self.starts, start) - 1
        seg, base = self.segments[i], self.starts[i]
        if start + n <= base + seg.numel():
            return seg[start - base : start - base + n]
        return None

    def to_bytearray(self) -> bytearray:
        """All the bytes in one new bytearray (one native pack, GIL released)."""
        out = _native.empty_bytearray(self.nbytes)
        if self.nbytes:
            self.pack(0, torch.frombuffer(out, dtype=torch.uint8))
        return out

    def pack(self, start: int, dst: torch.Tensor) -> None:
        """Copies ``[start, start + dst.numel())`` into ``dst`` (native, GIL released)."""
        end = start + dst.numel()
        if end > self.nbytes or start < 0:
            raise ValueError(f"ByteSource.pack: [{start}, {end}) outside {self.nbytes} bytes")
        rows = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.segments) and self.starts[i] < end:
            seg, base = self.segments[i], self.starts[i]
            lo, hi = max(base, start), min(base + seg.numel(), end)
            if lo < hi:
                rows.append((seg.data_ptr() + (lo - base), lo - start, hi - lo))
            i += 1
        _native.pack_segments(dst, rows)
