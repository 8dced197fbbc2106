"""The typed Python face of the compiled core ``distributed_ext._C``.

The native API is narrow on purpose (safetensors-style): buffers are uint8 tensors, and
everything else is raw pointers and lengths. Lifetime rule for every pointer handed across:
the caller keeps the object that owns it alive (and, for a source, unmodified) until the call
returns -- or, for :func:`copy_async`, until the stream has passed the copy.

There is no pure-Python fallback: if the module does not load, importing ``distributed_ext``
fails with what the module was built for next to what is installed.
"""

from __future__ import annotations

import array
import errno
import importlib.machinery
import itertools
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch


def _read_build_stamp(path: str) -> str:
    """The build stamp compiled into the .so at ``path``, read as bytes (no loading)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        return f"unreadable ({exc})"
    match = re.search(rb"DEXT_BUILD_STAMP\{([^}]{0,200})\}", blob)
    return match.group(1).decode("ascii", "replace") if match else "no build stamp found"


def _installed() -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"torch={torch.__version__};cuda={torch.version.cuda or ''};python={py}"


def _find_module_file() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = os.path.join(here, "_C" + suffix)
        if os.path.exists(candidate):
            return candidate
    for name in sorted(os.listdir(here)):
        if name.startswith("_C.") and name.endswith(".so"):
            return os.path.join(here, name)
    return None


def _load() -> Any:
    try:
        from distributed_ext import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        path = _find_module_file()
        built = _read_build_stamp(path) if path else "not built (no _C module in the package)"
        raise ImportError(
            "distributed_ext: the compiled core distributed_ext._C did not load.\n"
            f"  built for:  {built}\n"
            f"  installed:  {_installed()}\n"
            f"  cause:      {exc}\n"
            "  fix: rebuild against the installed torch: "
            "pip install --no-build-isolation --no-deps -e ."
        ) from exc
    info = _C.build_info()
    if info["torch"] != torch.__version__:
        raise ImportError(
            "distributed_ext: the compiled core was built for another torch.\n"
            f"  built for:  torch={info['torch']};cuda={info['cuda']};python={info['python']}\n"
            f"  installed:  {_installed()}\n"
            "  fix: rebuild: pip install --no-build-isolation --no-deps -e ."
        )
    return _C


_C = _load()


def build_info() -> dict[str, Any]:
    """What the compiled core was built for: torch, CUDA ('' for a CPU build), Python, ABI."""
    return dict(_C.build_info())


def built_with_cuda() -> bool:
    """Whether the compiled core has its CUDA half (csrc/cuda)."""
    return bool(_C.built_with_cuda())


# Segment rows ``(pointer, offset, nbytes)``: a list of triples, or an int64 (k, 3) table.
Segments = Sequence[tuple[int, int, int]] | torch.Tensor


def _table(rows: Segments) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):  # already a table: (k, 3) int64
        if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 3:
            raise ValueError(f"a segment table must be an int64 tensor of shape (k, 3), got "
                             f"{rows.dtype} {tuple(rows.shape)}")
        return rows.contiguous()
    if len(rows) == 0:
        return torch.empty((0, 3), dtype=torch.int64)
    # Through an int64 array: half the cost of torch.tensor(rows) on a list of tuples (the
    # exporter builds one table per message of up to ~1000 small pieces). The tensor keeps
    # the array alive.
    flat = array.array("q", itertools.chain.from_iterable(rows))
    if len(flat) != 3 * len(rows):
        raise ValueError(f"segment rows must be (pointer, offset, nbytes) triples, got "
                         f"{len(flat)} values for {len(rows)} rows")
    return torch.frombuffer(flat, dtype=torch.int64).reshape(-1, 3)


def pack_segments(dst: torch.Tensor, segments: Segments) -> None:
    """Copies each ``(src_ptr, dst_offset, nbytes)`` source into ``dst`` (a CPU uint8 tensor).

    The GIL is released during the copy. Offsets and lengths are checked against ``dst``;
    the source pointers are borrowed: the caller keeps their owners alive until this returns.
    """
    _C.pack_segments(dst, _table(segments))


def unpack_segments(src: torch.Tensor, segments: Segments) -> None:
    """Copies ``src[src_offset : src_offset + nbytes]`` to each ``(dst_ptr, src_offset, nbytes)``.

    The inverse of :func:`pack_segments`; the same checks and lifetime rule apply.
    """
    _C.unpack_segments(src, _table(segments))


def pread_into(fd: int, dst: torch.Tensor, offset: int) -> int:
    """Reads ``dst``'s bytes (a contiguous CPU tensor) from byte ``offset`` of ``fd``, GIL
    released, retrying short reads; returns the bytes read (fewer only where the file ends
    first). Raises OSError (with the errno) on a failed read."""
    got = _C.pread_into(fd, dst, int(offset))
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got


def pwrite_segments(fd: int, segments: Segments) -> None:
    """Writes each ``(src_ptr, file_offset, nbytes)`` to ``fd`` with pwrite, GIL released.

    Raises OSError (with the errno) on the first failed write. The source pointers are
    borrowed: the caller keeps their owners alive, and ``fd`` open, until this returns.
    """
    if len(segments) == 0:
        return
    err = _C.pwrite_segments(fd, _table(segments))
    if err:
        raise OSError(err, os.strerror(err))


def map_write_segments(fd: int, segments: Segments, file_size: int) -> None:
    """Copies each ``(src_ptr, file_offset, nbytes)`` into the file ``fd`` (open read-write)
    through one shared mapping of the span they touch, GIL released: on a RAM filesystem,
    the file's pages themselves, so several processes fill one file at once (``pwrite``
    takes the file's lock for each call) and a short run costs a copy, not a syscall.

    Raises ValueError where a row lies outside ``[0, file_size)``, OSError (with the errno)
    where the file cannot be mapped or is shorter than the rows reach. The source pointers
    are borrowed: the caller keeps their owners alive, and ``fd`` open, until this returns.
    The mapping is gone when it returns; the process's memory grows by the pages touched
    only while it runs.
    """
    if len(segments) == 0:
        return
    err = _C.map_write_segments(fd, _table(segments), int(file_size))
    if err:
        raise OSError(err, os.strerror(err))


def exchange_paths(a: str, b: str) -> bool:
    """Swaps two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``), GIL released.

    Returns True once swapped; False where the kernel or the filesystem cannot swap (ENOSYS,
    EINVAL, ENOTSUP: the caller falls back). Raises OSError for any other failure.
    """
    err = int(_C.exchange_paths(os.fsdecode(a), os.fsdecode(b)))
    if err == 0:
        return True
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def copy_bytes(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """Copies ``nbytes`` between two non-overlapping host buffers, GIL released, threads used."""
    _C.copy_bytes(dst_ptr, src_ptr, nbytes)


def map_through_table(src: torch.Tensor, table: torch.Tensor,
                      into: torch.Tensor | None = None) -> torch.Tensor:
    """``table[bits of x]`` for each element ``x`` of ``src`` (a contiguous CPU tensor of a
    2-byte dtype): an elementwise function tabulated over all 65536 values (``table``: uint8,
    65536 of them). Returns uint8 of ``src``'s shape, or ``into`` (a contiguous 1-byte CPU
    tensor of ``src``'s numel) filled; GIL released, threads used."""
    return _C.map_through_table(src, table, into)


def fp8_divide(src: torch.Tensor, scale: float, bf16_quotient: bool, table: torch.Tensor,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 (E4M3) bytes of ``src`` (a contiguous bfloat16 CPU tensor) divided by the float32
    ``scale``, as torch computes ``(src / scale).to(torch.float8_e4m3fn)``: the quotient
    rounded to bfloat16 first where ``bf16_quotient`` (a 0-dim scale tensor's result
    dtype), else kept in float32; an infinite or NaN element's byte is ``table``'s (as
    :func:`map_through_table`). Arithmetic where the table is a lookup: 1.2-1.6x its rate
    (benchmarks/bench_fp8_rows.py); the caller checks it against ModelOpt's bytes first.
    Returns uint8 of ``src``'s shape, or ``into`` filled; GIL released, threads used."""
    return _C.fp8_divide(src, float(scale), bool(bf16_quotient), table, into)


def nvfp4_rows(src: torch.Tensor, scale_2: float, block: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of the rows of ``src`` (contiguous CPU ``[rows, cols]``, bfloat16, float16 or
    float32, ``cols`` a multiple of the even ``block``) under the global scale ``scale_2``:
    the packed codes (uint8 ``[rows, cols / 2]``, even column in the low nibble), each
    block's E4M3 scale (uint8 ``[rows, cols / block]``). ModelOpt's arithmetic
    (csrc/quantize.h); GIL released, threads used."""
    return _C.nvfp4_rows(src, float(scale_2), int(block))


def nvfp4_scales(src: torch.Tensor, scale_2: float, block: int) -> torch.Tensor:
    """The block scales of :func:`nvfp4_rows` alone (uint8 ``[rows, cols / block]``, the same
    bytes), without computing the codes; GIL released, threads used."""
    return _C.nvfp4_scales(src, float(scale_2), int(block))


def empty_bytearray(nbytes: int, prefault: bool = False, huge_pages: bool = True) -> bytearray:
    """A bytearray of ``nbytes`` whose contents are uninitialized; fill every byte before use.

    With ``prefault``, its pages are faulted in now by several threads (the GIL released), so
    that a receive writing into it later does not stall on page faults. With ``huge_pages``
    (from 4 MiB) the kernel is advised to back it with transparent huge pages.

    Raises MemoryError if it cannot be allocated.
    """
    try:
        return _C.empty_bytearray(nbytes, prefault, huge_pages)
    except MemoryError:
        raise MemoryError(f"cannot allocate a bytearray of {nbytes} bytes") from None


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` in a private mapping of its own, 2 MiB-aligned and
    advised to transparent huge pages before anything touches it (csrc/huge_pages.h); it
    is unmapped with the tensor's storage. Only what is touched takes memory, in 2 MiB
    pages where the kernel grants them (4 KiB ones where it does not).

    Raises ValueError for a negative ``nbytes``, RuntimeError where the mapping fails.
    """
    return _C.huge_buffer(int(nbytes))


def write_queue(bounce_bytes: int) -> Any:
    """A native writer thread for direct writes (``_C.WriteQueue``: submit, wait, close):
    each job is written in order with no GIL between jobs; a job whose source is not
    block-aligned goes through the queue's own ``bounce_bytes`` buffer. Use it through
    :class:`distributed_ext._direct_io.WriteQueue`, which names the files and raises."""
    return _C.WriteQueue(int(bounce_bytes))


def copy_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    """Enqueues a host<->device copy on the CUDA stream handle ``stream`` (CUDA build only).

    Lifetime: both buffers stay alive, and the source unmodified, until the stream has passed
    the copy (record an event on ``stream`` and wait on it before reusing either).
    """
    _C.copy_async(dst_ptr, src_ptr, nbytes, stream)


def device_pack_pieces(table: torch.Tensor, stream: int) -> None:
    """Launches one kernel copying each row ``(src_ptr, dst_ptr, nbytes)`` of ``table``.

    ``table`` is a contiguous int64 CUDA tensor of shape [n, 3] of device addresses. Lifetime:
    the table and every buffer it names stay alive (sources unmodified) until ``stream`` has
    passed the kernel. CUDA build only.
    """
    if table.dtype != torch.int64 or table.dim() != 2 or table.size(1) != 3:
        raise ValueError("device_pack_pieces: table must be int64 of shape [n, 3]")
    if not table.is_contiguous() or table.device.type != "cuda":
        raise ValueError("device_pack_pieces: table must be a contiguous CUDA tensor")
    _C.device_pack_pieces(table.data_ptr(), table.size(0), stream)


def start_heartbeat(store: Any, client: Any, key: str, interval_ms: int) -> None:
    """Beats ``client.add(key, 1)`` every ``interval_ms`` from a native thread (no GIL).

    ``store`` is the process group's ``torch.distributed.Store``; ``client`` a clone of it
    (``store.clone()``: its own connection, which no other thread's blocking call can hold
    up). Lifetime: the thread holds a weak reference to ``store`` and owns ``client``; it
    ends by itself once ``store`` is destroyed (its process group destroyed), and stops
    beating after three failed beats in a row (the store's host is gone). The same store and
    key again is a no-op; another store replaces the running beat.
    """
    _C.start_heartbeat(store, client, key, interval_ms)


def heartbeat_running(store: Any, key: str) -> bool:
    """Whether the heartbeat already runs for ``store`` and ``key`` (then starting it again
    is a no-op, and no client need be made for it)."""
    return bool(_C.heartbeat_running(store, key))


def stop_heartbeat() -> None:
    """Stops the heartbeat thread, waiting at most for the store call it is in."""
    _C.stop_heartbeat()


def set_heartbeat_note(key: str, note: str) -> None:
    """Hands the running heartbeat ``note`` to post under ``key`` with its next beat (at
    most one interval later, only the newest); a mutex here, never a store call. A no-op
    when no heartbeat runs."""
    _C.set_heartbeat_note(key, note)


def heartbeat_count() -> int:
    """Beats the current heartbeat has sent (0 when none runs)."""
    return int(_C.heartbeat_count())


def heartbeat_failed() -> bool:
    """Whether the current heartbeat stopped after repeated failed beats."""
    return bool(_C.heartbeat_failed())


def int4_rows(src: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """INT4 AWQ of the rows of ``src`` (contiguous CPU ``[rows, cols]``, bfloat16, float16 or
    float32; ``rows`` even, ``cols`` a multiple of ``block``) under per-group scales
    (contiguous float32 ``[rows, cols / block]``): round-half-even of ``x / scale`` clamped
    to [-8, 7], rows ``2i`` and ``2i + 1`` packed into row ``i`` (uint8 ``[rows / 2, cols]``,
    row ``2i`` in the low nibble). ModelOpt's arithmetic (csrc/quantize.h); GIL released,
    threads used."""
    return _C.int4_rows(src, scale, int(block))
