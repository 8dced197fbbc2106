"""A file written at arbitrary offsets that bypasses the page cache where it can (O_DIRECT).

Why: an export writes GBs that nobody reads back soon. Through the page cache every byte
first takes a fresh page of kernel memory (on a VM whose free memory went back to the host,
each such page is faulted in from the host: seconds for a GB on the first call), and
``fsync`` then waits for all of it to reach the disk. Written with ``O_DIRECT`` the bytes go
from the caller's buffer to the disk, durable when the call returns, and no memory is taken.

``O_DIRECT`` needs the file offset, the length and the memory address aligned to the
device's block (``ALIGN`` covers 512- and 4096-byte devices). A write is split in three: the
unaligned head and tail (less than ``ALIGN`` each) go through the page cache; the aligned
middle goes direct, from the caller's memory when it happens to be aligned alike (the
transport places its receive buffers so that it is), else through an aligned bounce buffer.
Both descriptors write disjoint whole blocks: a block is written direct only when one write
covers it whole, and every byte of the file is written once, so no block is ever both in the
page cache and written around it. Where ``O_DIRECT`` is pointless (tmpfs, ramfs: the page
cache is the storage) or refused (some FUSE or network
filesystems), every write goes through the page cache. A direct write the kernel refuses
with EFAULT -- memory it can read but will not pin for the device (a ``[vvar]`` page does
that; one queued write of an export once did, on this project's VM) -- is written again
through the page cache, that write alone, with a RuntimeWarning naming the file; memory
that cannot be read fails there too.

Thread safety: writes may come from several threads at once (``os.pwrite`` takes offsets);
each thread gets its own bounce buffer, in two halves: one is written (by a helper thread of
that thread's) while the next piece is copied into the other, so the copy costs no time of
the disk's. A writer that stages in Python queues its direct writes to a native thread
instead (:class:`WriteQueue`): the next write then never waits for the GIL.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import os
import threading
import warnings

import torch

__all__ = ["ALIGN", "DirectFile", "WriteQueue", "aligned_empty", "filesystem_of",
           "huge_empty", "on_ram_filesystem", "place"]

ALIGN = 4096
# Bounce buffer per writing thread; a direct write of unaligned memory goes in its halves.
# 16 MiB (8 MiB writes): faster than 8 MiB, as fast as 32 (docs/measurements.md).
BOUNCE_BYTES = 16 * 2**20


# Bytes this process copied into mapped files (write calls do not count them: /proc's wchar
# misses them), for the benchmarks' "written" figures.
_MAPPED_BYTES = [0]
_MAPPED_LOCK = threading.Lock()


def mapped_bytes() -> int:
    """Bytes this process has copied into files through :meth:`DirectFile.write_mapped`."""
    return _MAPPED_BYTES[0]


def place(raw: torch.Tensor, nbytes: int, shift: int = 0) -> torch.Tensor:
    """The ``nbytes`` of ``raw`` (uint8, at least ``nbytes + ALIGN`` long) that start at an
    address of ``shift`` (mod ``ALIGN``): written direct to a file offset with that shift,
    they need no bounce copy."""
    start = (shift - raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]


def aligned_empty(nbytes: int, shift: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose address is ``shift`` (mod ``ALIGN``).

    It views a slightly larger allocation, which it keeps alive.
    """
    return place(torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8), nbytes, shift)


# A transparent huge page (x86-64, arm64 with 4 KiB pages).
HUGE_PAGE = 2 * 2**20


def huge_empty(nbytes: int, shift: int = 0) -> torch.Tensor:
    """:func:`aligned_empty` in memory of its own, advised to transparent huge pages before
    anything touches it (:func:`distributed_ext._native.huge_buffer`: a private anonymous
    mapping, 2 MiB-aligned; unmapped with the last view of it). Only what is touched takes
    memory, in 2 MiB pages where the kernel grants them (4 KiB ones where it does not:
    nothing else changes).

    Why: the device gets a direct write's source as one segment per physically contiguous
    range, so from torch's 4 KiB pages a write is hundreds of segments; from huge pages the
    same writes took about 0.6x the time (docs/measurements.md).
    """
    from distributed_ext import _native

    span = nbytes + 2 * ALIGN
    return place(_native.huge_buffer(span), nbytes, shift)


def on_ram_filesystem(path: str) -> bool:
    """Whether ``path`` is on tmpfs/ramfs (from /proc/mounts: the longest mount point above
    it). There the page cache is the storage: ``O_DIRECT`` (which recent kernels accept on
    tmpfs) would only add copies, so it is not used. Cached per directory."""
    return _ram_filesystem_dir(os.path.dirname(os.path.abspath(path)))


@functools.lru_cache(maxsize=64)
def _ram_filesystem_dir(path: str) -> bool:
    return filesystem_of(path)[0] in ("tmpfs", "ramfs")


def filesystem_of(path: str) -> tuple[str, str]:
    """``(type, mount point)`` of the filesystem ``path`` is on, from /proc/mounts (the
    longest mount point above it; of equal ones the last mounted); ``("unknown", "")``
    where it cannot be read."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (path == fields[1] or path.startswith(
                        fields[1].rstrip("/") + "/")) and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        return "unknown", ""
    return kind, best


def _memoryview(t: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous uint8 CPU tensor's bytes (no copy).

    Lifetime: valid while ``t`` is alive and unresized; the caller holds ``t`` meanwhile.
    """
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


# Per writing thread, whatever file it writes: one bounce buffer and one writer thread (freed
# with the thread; the main thread keeps its 8 MiB between calls).
_LOCAL = threading.local()


def _bounce() -> tuple[torch.Tensor, concurrent.futures.ThreadPoolExecutor]:
    """The calling thread's bounce buffer and its writer thread, which writes one half of
    it while the caller fills the other (made on first use)."""
    if getattr(_LOCAL, "buf", None) is None:
        _LOCAL.buf = huge_empty(BOUNCE_BYTES)  # (what it writes goes in few segments)
        _LOCAL.writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="distributed_ext write")
    return _LOCAL.buf, _LOCAL.writer


def _pwrite_fully(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote nothing at offset {offset + done}")
        done += n


def _warn_efault(path: str) -> None:
    """Says (RuntimeWarning) that a direct write to ``path`` was refused with EFAULT and
    went through the page cache: the bytes are right, but the cause is worth knowing (seen
    once on this project's VM, not explained)."""
    warnings.warn(f"{path}: the kernel refused a direct (O_DIRECT) write with EFAULT (memory "
                  "it would not pin for the device); it was written through the page cache "
                  "instead, and its bytes are in place", RuntimeWarning, stacklevel=3)


class WriteQueue:
    """Direct writes done in order by a native thread (:func:`_native.write_queue`), so that
    the next one starts as the last returns, with no Python between them.

    Why: a direct write issued from Python takes the GIL back when it returns before the
    next can start. Beside a thread busy in Python (the export's staging), each write waits
    for it, and the writes took several times as long beside a thread running Python
    (docs/measurements.md).

    Lifetime rule: the bytes of a write are borrowed until :meth:`wait` covering its ticket
    (or :meth:`close`) returns; the caller leaves them unmodified until then, and the queue
    holds a reference to each write's tensor meanwhile (so a caller that drops its own early
    cannot free memory a write still reads). A file's descriptors are duplicated per write,
    so the file may be closed meanwhile. Used by one thread at a time.
    """

    def __init__(self, bounce_bytes: int = BOUNCE_BYTES) -> None:
        from distributed_ext import _native

        self._queue = _native.write_queue(bounce_bytes)
        # (ticket, file, bytes) of each write not yet covered by a wait
        self._jobs: collections.deque[tuple[int, str, torch.Tensor]] = collections.deque()
        self.last = 0  # the ticket of the last write submitted (0: none yet)
        self._retried = 0  # writes refused direct with EFAULT, said so (_warn_efault)

    def submit(self, file: DirectFile, offset: int, data: torch.Tensor) -> int:
        """Queues the direct write of ``data`` (contiguous uint8 CPU, whole blocks) at
        ``offset`` (a block boundary) of ``file``; returns its ticket."""
        assert file.direct_fd is not None
        self.last = self._queue.submit(file.direct_fd, file.fd, data.data_ptr(), data.numel(),
                                       offset)
        self._jobs.append((self.last, file.path, data))
        with file._lock:
            file.direct_bytes += data.numel()
        return self.last

    def wait(self, ticket: int | None = None) -> None:
        """Returns once every write up to ``ticket`` (default: all) is done; raises OSError,
        naming the file, for the first that failed (no later write then writes anything)."""
        ticket = self.last if ticket is None else ticket
        err, bad = self._queue.wait(ticket)
        retried, last_retried = self._queue.efault_retries()
        if retried > self._retried:
            self._retried = retried
            path = next((p for t, p, _d in self._jobs if t == last_retried), "?")
            _warn_efault(path)
        while self._jobs and self._jobs[0][0] <= ticket and self._jobs[0][0] != bad:
            self._jobs.popleft()
        if err:
            path = self._jobs[0][1] if self._jobs and self._jobs[0][0] == bad else "?"
            raise OSError(err, os.strerror(err), path)

    def close(self) -> None:
        """Waits for every write, then stops the thread (idempotent; failures are raised by
        :meth:`wait`, not here)."""
        self._queue.close()
        self._jobs.clear()


class DirectFile:
    """A new file of a known ``size``, written at offsets, direct where the filesystem allows.

    Args:
        path: Created exclusively (``O_EXCL``), mode 0o666 less the umask.
        size: The file's final size; set up front, so that every write lands inside it.
        create: False: the file exists already, made (and sized) by another writer; it is
            opened for writing as it is (several processes then write disjoint bytes of it).
    """

    def __init__(self, path: str, size: int, create: bool = True) -> None:
        self.path = path
        self.size = size
        self.map_fd = -1  # read-write, for write_mapped (opened on its first call)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL if create else os.O_WRONLY
        self.fd = os.open(path, flags, 0o666)
        self.direct_fd: int | None = None
        self.direct_fd_usable = True
        self.direct_bytes = 0  # written direct (for tests and figures)
        self.direct_capable = False
        self._lock = threading.Lock()
        try:
            if create:
                os.ftruncate(self.fd, size)
            elif os.fstat(self.fd).st_size != size:
                raise ValueError(f"{path} holds {os.fstat(self.fd).st_size} bytes, not the "
                                 f"{size} its writers agreed on")
            flag = getattr(os, "O_DIRECT", 0)
            if flag and not on_ram_filesystem(path):
                with contextlib.suppress(OSError):  # EINVAL where refused: page cache only
                    self.direct_fd = os.open(path, os.O_WRONLY | flag)
            self.direct_capable = self.direct_fd is not None  # the filesystem takes O_DIRECT
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, data: torch.Tensor, queue: WriteQueue | None = None) -> None:
        """Writes the bytes of ``data`` (contiguous uint8, CPU) at ``offset``. With ``queue``,
        the aligned middle that goes direct is queued there (the caller keeps ``data`` alive
        until the queue is waited for: :class:`WriteQueue`); the rest is written now."""
        n = data.numel()
        if n == 0:
            return
        lo = -offset % ALIGN  # first aligned byte, relative to data
        hi = n - (offset + n) % ALIGN  # end of the last whole block, relative to data
        if self.direct_fd is None or not self.direct_fd_usable or hi - lo < ALIGN:
            _pwrite_fully(self.fd, _memoryview(data), offset)
            return
        if lo:
            _pwrite_fully(self.fd, _memoryview(data[:lo]), offset)
        if hi < n:
            _pwrite_fully(self.fd, _memoryview(data[hi:]), offset + hi)
        if queue is not None:
            queue.submit(self, offset + lo, data[lo:hi])
            return
        self._write_direct(offset + lo, data[lo:hi])

    def write_segments(self, segments: list[tuple[int, int, int]] | torch.Tensor) -> None:
        """Writes many small ``(src_ptr, offset, nbytes)`` runs (triples or an int64 table)
        through the page cache in one native call
        (:func:`distributed_ext._native.pwrite_segments`): runs this small never cover a
        whole block direct, so the one-writer-per-block rule holds.

        Lifetime: the source pointers are borrowed until this returns.
        """
        from distributed_ext import _native

        _native.pwrite_segments(self.fd, segments)

    def write_mapped(self, segments: list[tuple[int, int, int]] | torch.Tensor) -> None:
        """Copies ``(src_ptr, offset, nbytes)`` runs into the file through a shared mapping
        of the span they touch (:func:`distributed_ext._native.map_write_segments`), for a
        RAM filesystem, where that mapping is the file's storage: processes filling
        disjoint bytes of one file (pages included) do not take turns on its lock, and a
        short run costs a copy, not a syscall. Durable as page-cache writes are
        (:meth:`sync`). Lifetime: the source pointers are borrowed until this returns."""
        from distributed_ext import _native

        if self.map_fd < 0:
            self.map_fd = os.open(self.path, os.O_RDWR)
        table = _native._table(segments)  # (made once: written, then counted)
        _native.map_write_segments(self.map_fd, table, self.size)
        with _MAPPED_LOCK:
            _MAPPED_BYTES[0] += int(table[:, 2].sum())

    def _write_direct(self, offset: int, data: torch.Tensor) -> None:
        assert self.direct_fd is not None
        try:
            if data.data_ptr() % ALIGN == 0:
                _pwrite_fully(self.direct_fd, _memoryview(data), offset)
            else:
                self._write_bounced(offset, data)
        except OSError as exc:
            if exc.errno == errno.EFAULT:
                # Memory the kernel will not pin for a direct write, though it can be read:
                # this write through the page cache (the file stays direct).
                _pwrite_fully(self.fd, _memoryview(data), offset)
                _warn_efault(self.path)
                return
            if exc.errno != errno.EINVAL:
                raise
            # This filesystem wants another alignment: the page cache from now on (rewriting
            # a block already written direct is harmless; fsync covers what it now holds).
            self.direct_fd_usable = False
            _pwrite_fully(self.fd, _memoryview(data), offset)
            return
        with self._lock:
            self.direct_bytes += data.numel()

    def _write_bounced(self, offset: int, data: torch.Tensor) -> None:
        """Writes unaligned memory direct through this thread's bounce buffer: each half
        is written by the thread's writer while the next piece is copied into the other."""
        assert self.direct_fd is not None
        bounce, writer = _bounce()
        half = BOUNCE_BYTES // 2
        halves = (bounce[:half], bounce[half:])
        pending: collections.deque = collections.deque()
        try:
            for i, s in enumerate(range(0, data.numel(), half)):
                if len(pending) == 2:
                    pending.popleft().result()  # that half is free again
                piece = data[s : s + half]
                staged = halves[i % 2][: piece.numel()]
                staged.copy_(piece)
                pending.append(writer.submit(_pwrite_fully, self.direct_fd,
                                             _memoryview(staged), offset + s))
            while pending:
                pending.popleft().result()
        finally:
            # A failed write: the others still read the halves; they end before we return.
            for future in pending:
                with contextlib.suppress(BaseException):
                    future.result()

    def sync(self) -> None:
        """Makes every byte durable (the page-cache part and the metadata; direct writes
        already are, but the device's cache is flushed too)."""
        os.fsync(self.fd)

    @property
    def is_open(self) -> bool:
        return self.fd >= 0

    def reopen(self) -> None:
        """Opens the file again after :meth:`close` (a writer that keeps many files bounds
        how many are open at once); a no-op while it is open."""
        if self.fd >= 0:
            return
        self.fd = os.open(self.path, os.O_WRONLY)
        flag = getattr(os, "O_DIRECT", 0)
        # Only where the first open took it (not on a RAM filesystem, which accepts it too)
        if flag and self.direct_capable and self.direct_fd_usable:
            with contextlib.suppress(OSError):
                self.direct_fd = os.open(self.path, os.O_WRONLY | flag)

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd, self.map_fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.direct_fd = None
        self.fd = self.map_fd = -1
