"""The run's resources: memory and disk checked before any rank starts, the run's own
directory, the warm-up of the machine's memory, and what a rank used (peak RSS, bytes
written and sent); the filesystem and load a figure is captioned with."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from distributed_ext import _direct_io
from distributed_ext.bench.sizes import format_size

# -- memory and disk -------------------------------------------------------------------------


def estimate_peak_bytes(size: int, world: int, baseline: bool, workload: str = "bytes") -> int:
    """Host memory one machine needs for a local run of ``workload``.

    bytes/state-dict: payloads, dst's outputs, the baseline: gather_object holds, on dst,
    each rank's pickle as received, its unpickled copy and staging (measured: 7 GiB for 1 GiB
    at world 2); senders hold a pickle and a tensor copy. export (``size`` = the model's
    bytes): every rank builds the whole model before sharding it; torch's route then holds
    the full state on dst and ``save_pretrained`` a copy of it.
    """
    per_rank_runtime = 400 * 2**20  # torch + gloo per process
    if workload == "export":
        return world * size + (2 * size if baseline else 0) + world * per_rank_runtime
    ours = world * size + world * size
    base = (3 * world + 1) * size + (world - 1) * 3 * size if baseline else 0
    return max(ours, base) + world * per_rank_runtime


def estimate_disk_bytes(size: int, workload: str, baseline: bool) -> int:
    """Disk one export run needs at once in the bench directory: a checkpoint (DCP's
    consolidation: its shards and the consolidated file) plus the warm-up file."""
    if workload != "export":
        return 0
    return (2 if baseline else 1) * size + 64 * 2**20


def bench_dir() -> str:
    """Where the export workload writes (``DEXT_BENCH_DIR``, else the system's temp dir)."""
    import tempfile

    return os.environ.get("DEXT_BENCH_DIR") or tempfile.gettempdir()


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(size: int, world: int, baseline: bool, workload: str = "bytes") -> None:
    """SystemExit with the numbers if a run of ``workload`` would not fit the machine's
    available memory, or (export) the bench directory's free disk."""
    need = estimate_peak_bytes(size, world, baseline, workload)
    have = available_bytes()
    hint = "pass a smaller --size" + ("" if not baseline else " or --no-baseline")
    if have is not None and need > have:
        raise SystemExit(
            f"distributed-ext-bench: --workload {workload} --size {format_size(size)} at "
            f"--world {world} needs about {format_size(need)} of host memory ("
            f"{'with' if baseline else 'without'} the torch baselines), but only "
            f"{format_size(have)} is available; {hint}"
        )
    disk = estimate_disk_bytes(size, workload, baseline)
    if disk:
        import shutil

        where = bench_dir()
        free = shutil.disk_usage(where).free
        if disk > free:
            raise SystemExit(
                f"distributed-ext-bench: --workload export --size {format_size(size)} writes "
                f"up to {format_size(disk)} at once to {where}, which has {format_size(free)} "
                f"free; {hint}, or set DEXT_BENCH_DIR to a larger filesystem"
            )


class PeakRSS:
    """This process's peak RSS during the block, less its RSS at the start (``added``).

    Read from the kernel's own high-water mark (``VmHWM``, reset to the current RSS on entry
    through ``/proc/self/clear_refs``): nothing runs during the block. Sampling
    ``/proc/self/statm`` from a thread every few ms instead slowed a timed export by up to
    2x (each read takes the process's memory-map lock, which the writers' page faults
    need); it is the fallback where the reset is refused (kernels before 4.0, no /proc)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start = self._rss()
        self.peak = self.start

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _high_water() -> int | None:
        try:
            with open("/proc/self/status") as f:
                line = next((x for x in f if x.startswith("VmHWM:")), None)
        except OSError:
            return None
        return int(line.split()[1]) * 1024 if line else None

    @staticmethod
    def _reset_high_water() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "reset the peak resident set size" (proc(5))
        except OSError:
            return False
        return PeakRSS._high_water() is not None

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRSS:
        if not self._reset_high_water():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        self.start = self.peak = self._rss()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, self._high_water() or 0)
        self.peak = max(self.peak, self._rss())

    @property
    def added(self) -> int:
        return self.peak - self.start


class RankIO:
    """What this rank wrote and sent during the block: ``sent``, the bytes it passed to
    ``torch.distributed.isend`` (every send of an export); ``written``, the bytes of its
    write calls (``wchar`` of /proc/self/io, which counts a socket's writes too) less
    ``sent``: the bytes it wrote to files, and those it copied into mapped files (a RAM
    filesystem: :func:`distributed_ext._direct_io.mapped_bytes`), which no write call
    counts."""

    def __enter__(self) -> RankIO:
        import torch.distributed as dist

        self.sent = 0
        self._real = dist.isend

        def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.sent += tensor.numel() * tensor.element_size()
            return self._real(tensor, *args, **kwargs)

        dist.isend = counting
        self._start = self._wchar()
        self._mapped = _direct_io.mapped_bytes()
        return self

    @staticmethod
    def _wchar() -> int:
        try:
            with open("/proc/self/io") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        except (OSError, StopIteration, ValueError):  # no /proc here: unknown, shown as 0
            return 0

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.isend = self._real
        self.written = max(0, self._wchar() - self._start - self.sent) + \
            _direct_io.mapped_bytes() - self._mapped


def fsync_tree(path: str) -> float:
    """Seconds to ``fsync`` every file under ``path``, then its directories: what a route
    that writes through the page cache without ``fsync`` (``save_pretrained``, ModelOpt's
    export) leaves for the disk after it returns, where ours returns once its bytes are
    durable. 0.0 for a path that is not there."""
    import time

    from distributed_ext.export.files.publish import _fsync_path

    start = time.perf_counter()
    dirs = []
    for root, _subdirs, files in os.walk(path):
        dirs.append(root)
        for name in files:
            _fsync_path(os.path.join(root, name))
    for root in reversed(dirs):
        _fsync_path(root, directory=True)
    return time.perf_counter() - start


def _filesystem(path: str) -> str:
    """The filesystem type of ``path`` and its mount point, for a figure's caption."""
    from distributed_ext import _direct_io

    kind, mount = _direct_io.filesystem_of(path)
    return f"{kind} at {mount or '?'}"


def _load_text(load: tuple[float, ...]) -> str:
    return "load average (1/5/15 min) before the run: " + " ".join(f"{x:.2f}" for x in load)


def touch_machine_memory(nbytes: int) -> None:
    """Writes ``nbytes`` of memory once in this process, then frees it, before any rank starts.

    On a fresh VM the first use of guest memory is slow (the host maps it in): without this,
    whichever method runs first would pay it in its "first call", a cost of the machine, not
    of the method. The ranks' own first-touch costs are untouched (they are new processes).
    ``nbytes`` is the run's own estimate, already checked to fit (never more than is free).
    """
    import torch

    have = available_bytes()
    n = min(nbytes, have) if have else nbytes
    if n > 0:
        torch.empty(n, dtype=torch.uint8).fill_(0)


@contextlib.contextmanager
def _run_directory(needed: bool) -> Any:
    """A directory of this run in the bench directory (export's checkpoints, the warm-up
    file), removed on any exit -- an error, Ctrl-C, SIGTERM (turned into SystemExit here)."""
    import shutil
    import signal
    import tempfile

    if not needed:
        yield None
        return
    path = tempfile.mkdtemp(prefix="dext-bench-", dir=bench_dir())
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
