"""Pinned host staging: the one owner of page-locked memory, with one policy.

Every path that moves bytes between host and GPU (the NCCL gather pipeline, encoding a
GPU-resident state) stages through here, because pinning is slow (~0.5 s per GiB on the H200
machine) and pinned memory is scarce.

Policy: the pool caches ONE pinned buffer, the largest asked for so far. :func:`acquire`
leases it when it is free and large enough; otherwise it pins a new buffer for that lease.
When a lease ends, the pool keeps the larger of its cached buffer and the returned one and
frees the other, so the cache never exceeds the largest single request; :func:`release_staging`
frees the cache (a buffer still leased is freed when its lease ends). Leases are not shared:
two concurrent users never get the same memory.

Lifetime rule: a lease's tensor (and every view of it) may be used only until
:meth:`Lease.release`; whoever holds the lease keeps it until the last copy that reads or
writes the buffer has completed.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Lease", "acquire", "cached_bytes", "release_staging"]

_lock = threading.Lock()
_cached: torch.Tensor | None = None  # free (not leased) when not None


class Lease:
    """A pinned uint8 buffer of at least ``nbytes``, held until :meth:`release`."""

    def __init__(self, buffer: torch.Tensor, nbytes: int) -> None:
        self._buffer: torch.Tensor | None = buffer
        self.tensor = buffer[:nbytes]

    def release(self) -> None:
        """Returns the buffer to the pool (idempotent). Views of it must no longer be used."""
        global _cached
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        with _lock:
            if _cached is None or _cached.numel() < buffer.numel():
                _cached = buffer  # keep the larger; the smaller is freed with its last ref

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(nbytes: int) -> Lease:
    """Leases a pinned buffer of at least ``nbytes`` (the cached one if free and large enough)."""
    global _cached
    with _lock:
        if _cached is not None and _cached.numel() >= nbytes:
            buffer, _cached = _cached, None
            return Lease(buffer, nbytes)
        if _cached is not None:
            _cached = None  # too small: free it before pinning a larger one
    return Lease(_pin(max(nbytes, 1)), nbytes)


def _pin(nbytes: int) -> torch.Tensor:
    """A new page-locked uint8 buffer (the one place memory is pinned)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def release_staging() -> None:
    """Frees the cached pinned buffer (leased buffers are freed when their leases end)."""
    global _cached
    with _lock:
        _cached = None


def cached_bytes() -> int:
    """Bytes held by the cache right now (0 when empty); for tests and reports."""
    with _lock:
        return 0 if _cached is None else _cached.numel()
