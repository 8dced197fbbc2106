"""distributed-ext-bench: gather multi-GB shards, ours against torch's baseline, in one command.

Without a launcher it spawns ``--world`` local ranks on gloo (CPU), FRESH RANKS FOR EVERY
METHOD, so that each method's first call is what a job that exports once pays; under torchrun
it joins the launch (``distributed_run``: NCCL on GPUs, gloo on a CPU-only node), where the
methods share the launch's ranks. Rank 0 is dst; it shows progress while data moves and a
table at the end: per method, the first call, the warm median and spread (min-max) of
``--repeat`` more calls, GB/s and dst's peak RSS, and the ratios to the baselines.

GB/s, everywhere: bytes dst receives from the other ranks, per second of dst's wall time from
a barrier to the call's return.

Workloads (``--size`` per rank):
  bytes        gather_bytes vs raw gloo send/recv into fresh tensors (the transport's
               ceiling) vs dist.gather_object, and the first-touch floor of dst's outputs
  state-dict   gather_state_dicts of an LLM-shaped state (4096x4096 bf16 matrices and small
               tensors) vs torch.save + dist.gather_object + torch.load(weights_only=True)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from distributed_ext._spawn import run_local
from distributed_ext._timing import Timing, time_calls

WORKLOADS = ("bytes", "state-dict", "export")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB (binary), KB, MB, GB, TB (decimal)"
# Below this a figure measures the call's fixed cost, not a transfer (and the workloads'
# shapes -- 4096-wide matrices, a Llama model -- cannot be made that small).
MIN_SIZE = 2**20


def parse_size(text: str) -> int:
    """A per-rank size: :func:`parse_bytes`, at least ``MIN_SIZE``."""
    nbytes = parse_bytes(text, minimum=0)
    if nbytes < MIN_SIZE:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is {nbytes} bytes; the benchmark needs at least 1 MiB per rank "
            "(a number without a unit is bytes: --size 1 is one byte; write 1GiB)")
    return nbytes


def parse_bytes(text: str, minimum: int = 1) -> int:
    """'1GiB', '512MiB', '1.5GB', '4096' -> bytes (at least ``minimum``); argparse-friendly
    errors otherwise (naming the units)."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected a positive number with an optional unit ({_UNIT_NAMES}"
            "), e.g. 512MiB, 1GiB, 1.5GB or 1048576 (bytes)"
        )
    nbytes = int(value * _UNITS[unit])
    if nbytes < minimum:
        raise argparse.ArgumentTypeError(f"size {text!r} is under {minimum} byte(s)")
    return nbytes


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="distributed-ext-bench",
        description="Gather multi-GB shards to one rank: distributed_ext against torch's "
        "baseline. Local ranks on gloo without a launcher; the launch's ranks under torchrun.",
    )
    ap.add_argument("--world", type=int, default=2,
                    help="local ranks to spawn without a launcher (default 2)")
    ap.add_argument("--size", type=parse_size, nargs="+", default=[parse_size("256MiB")],
                    help="bytes per rank, with units: 256MiB (default), 1GiB, ...; several "
                    "sizes run one after the other (e.g. --size 256MiB 64MiB)")
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all",
                    help="all = bytes and state-dict; export (an FSDP2 model to one Hugging "
                    "Face checkpoint, --size = the model's parameter bytes) runs when named")
    ap.add_argument("--repeat", type=int, default=5,
                    help="warm calls after the first, per method (default 5)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch baselines")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines (they are drawn only when stderr is a terminal)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the machine warm-up before the first rank starts (it writes the "
                    "memory the run will use once, and for export a file of the model's size "
                    "to the bench directory, removed at once: so that the VM's or the page "
                    "cache's first use is not billed to whichever method runs first)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw first-call and warm GB/s (matplotlib)")
    ap.add_argument("--from-json", metavar="PATH",
                    help="run nothing: print (and --plot) the figures of a saved --json")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds before local ranks are stopped (default 3600)")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world must be at least 2 (rank 0 gathers from the others), got "
                 f"{args.world}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        ap.error(f"--timeout must be a positive, finite number of seconds, got "
                 f"{args.timeout:g}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install 'distributed_ext[plot]' (or "
                     "pip install matplotlib)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        # Checked before the run: a figure file that cannot be written loses the whole run.
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            ap.error(f"{flag} {path}: the directory {folder!r} does not exist or is not "
                     "writable; create it first or pass another path")
    if args.from_json:
        if not os.path.isfile(args.from_json):
            ap.error(f"--from-json {args.from_json}: no such file (write one with --json PATH)")
        return args
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.no_baseline and not args.from_json:
        try:
            import numpy  # noqa: F401
        except ImportError:
            ap.error("the torch baseline (dist.gather_object) needs numpy: pip install "
                     "'distributed_ext[bench]' (or numpy), or pass --no-baseline")
    if args.workload == "export":
        missing = [m for m in ("transformers", "safetensors") if not _importable(m)]
        if missing:
            ap.error(f"--workload export needs {' and '.join(missing)}: pip install "
                     "'distributed_ext[export]'")
    args.workloads = ["bytes", "state-dict"] if args.workload == "all" else [args.workload]
    args.sizes = list(args.size)
    return args


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


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
    """Samples this process's RSS every few ms in a thread; ``peak`` minus ``start``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.start = self._rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def added(self) -> int:
        return self.peak - self.start


class RankIO:
    """What this rank wrote and sent during the block: ``sent``, the bytes it passed to
    ``torch.distributed.isend`` (every send of an export); ``written``, the bytes of its
    write calls (``wchar`` of /proc/self/io, which counts a socket's writes too) less
    ``sent``: the bytes it wrote to files."""

    def __enter__(self) -> RankIO:
        import torch.distributed as dist

        self.sent = 0
        self._real = dist.isend

        def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.sent += tensor.numel() * tensor.element_size()
            return self._real(tensor, *args, **kwargs)

        dist.isend = counting
        self._start = self._wchar()
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
        self.written = max(0, self._wchar() - self._start - self.sent)


# -- progress --------------------------------------------------------------------------------


class ProgressBar:
    """``[#####.....] 1.20/2.00 GB  0.85 GB/s`` on stderr: bytes dst received from the others
    (decimal units, like the rate); drawn only when stderr is a terminal.

    Redrawn whenever progress moves by 2% or 32 MiB (whichever is smaller) and at the end.
    """

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.start = time.perf_counter()
        self.drawn = -1

    def __call__(self, done: int, total: int) -> None:
        step = min(total * 0.02, 32 * 2**20)
        if not self.enabled or (self.drawn >= 0 and done - self.drawn < step and done < total):
            return
        self.drawn = done
        now = time.perf_counter()
        frac = done / total if total else 1.0
        rate = done / max(now - self.start, 1e-9) / 1e9
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {self.label:<34} [{bar:<30}] {done / 1e9:6.2f}/"
                         f"{total / 1e9:.2f} GB {rate:6.2f} GB/s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


class Running:
    """``  bytes (torch gather_object) 2/4   running 1.3 s`` on stderr while a call without
    progress of its own (a baseline, raw gloo, the floor) runs: drawn when it starts, then
    redrawn from a thread every 0.2 s."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        while True:  # drawn at once (raw gloo and the floor take under 0.2 s), then redrawn
            sys.stderr.write(f"\r  {self.label:<34} running {time.perf_counter() - start:6.1f} s")
            sys.stderr.flush()
            if self._stop.wait(0.2):
                return

    def __enter__(self) -> Running:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


# -- workloads -------------------------------------------------------------------------------


def make_state(nbytes: int, seed: int = 0) -> dict:
    """An LLM-shaped state of about ``nbytes``: 4096x4096 bf16 matrices (or smaller ones for a
    small size) plus up to 200 small norm/bias tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state: dict = {}
    small = min(200, max(1, nbytes // 2**16))
    for i in range(small):
        state[f"model.layers.{i // 2}.norm{i % 2}.weight"] = torch.randn(1024, generator=g)
    remaining = max(0, nbytes - small * 4096)
    side, i = 4096, 0
    while remaining >= 2 * side:  # whole 4096-wide matrices, then one of the rows left
        rows = min(side, remaining // (2 * side))
        w = torch.empty(rows, side, dtype=torch.bfloat16)
        w.view(torch.int16).random_(generator=g)
        state[f"model.layers.{i}.mlp.up_proj.weight"] = w
        remaining -= w.numel() * 2
        i += 1
    return state



# Methods per workload, ours first; the baseline the ratios are taken against is marked.
METHODS = {
    "bytes": ["distributed_ext", "raw gloo send/recv", "torch gather_object", "first-touch floor"],
    "state-dict": ["distributed_ext", "torch save+gather_object+load"],
    "export": ["distributed_ext", "distributed_ext writers=dst",
               "torch get_model_state_dict+save_pretrained",
               "torch dcp HuggingFaceStorageWriter", "disk write+fsync", "disk O_DIRECT write",
               "disk O_DIRECT write, every rank its share"],
}
# Ours by default (writers="auto": every rank writes its own bytes where all see the
# directory, as local ranks do), and with the single writer.
_ONE_WRITER = "distributed_ext writers=dst"
# The disk's own rates: through the page cache (+ fsync), and direct (what ours does).
_DISK_METHODS = ("disk write+fsync", "disk O_DIRECT write")
# ... and with every rank writing its share of one file at once (what writers="all" can
# reach on this filesystem: one host's ranks share its disk, and a file's writes may be
# serialized by the kernel -- tmpfs takes the file's lock for each write).
_PARALLEL_DISK = "disk O_DIRECT write, every rank its share"
BASELINE = {"bytes": "torch gather_object", "state-dict": "torch save+gather_object+load",
            "export": "torch get_model_state_dict+save_pretrained"}
_TORCH_METHODS = {"torch gather_object", "torch save+gather_object+load",
                  "torch get_model_state_dict+save_pretrained",
                  "torch dcp HuggingFaceStorageWriter"}


def resolve_methods(workload: str, baseline: bool, backend: str = "gloo") -> list[str]:
    """The methods a run measures: ours, and unless ``--no-baseline`` the others."""
    methods = METHODS[workload]
    if not baseline:
        methods = [m for m in methods if m not in _TORCH_METHODS]
    if backend != "gloo":  # raw send/recv of host tensors and the host floor are gloo figures
        methods = [m for m in methods
                   if m in ("distributed_ext", _ONE_WRITER, *_DISK_METHODS, _PARALLEL_DISK,
                            *_TORCH_METHODS)]
    return methods


@dataclass
class Result:
    """One method's figures; every call's seconds are kept (``first`` and ``warm``)."""

    workload: str
    method: str
    world: int
    size: int  # bytes per rank
    received: int  # bytes dst receives from the other ranks per call (the GB/s numerator)
    first: float
    warm: list[float] = field(default_factory=list)
    dst_peak_rss: list[int] = field(default_factory=list)  # per call, first included
    fresh_ranks: bool = True
    # export: per rank, its peak RSS growth over the calls and the bytes it wrote to files
    # and sent in the first call ({"rank", "peak_rss", "written", "sent"})
    per_rank: list[dict] = field(default_factory=list)

    def timing(self) -> Timing:
        return Timing(self.first, list(self.warm))

    @property
    def gbps_first(self) -> float:
        return self.received / self.first / 1e9 if self.first > 0 else 0.0

    @property
    def gbps_warm(self) -> float:
        median = self.timing().median
        return self.received / median / 1e9 if median > 0 else 0.0


def _call(workload: str, method: str, data: Any, rank: int, world: int, dst: int,
          bar: ProgressBar | None, chunk_bytes: int | None = None) -> bool:
    """One measured call of ``method`` on this rank; True if dst's result is right."""
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    if workload == "export":
        return _export_call(method, data, rank, dst)
    if method == "distributed_ext":
        if workload == "bytes":
            kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
            out = dx.gather_bytes(data, dst, progress=bar, **kw)
            return out is None or (len(out) == world and len(out[rank]) == len(data))
        got = [len(s) for s in dx.gather_state_dicts(data, dst, progress=bar,
                                                      chunk_bytes=chunk_bytes)]
        return rank != dst or got == [len(data)] * world
    if method == "raw gloo send/recv":
        if rank == dst:
            outs = [torch.empty(len(data), dtype=torch.uint8) for _ in range(world - 1)]
            works = [dist.irecv(o, src=r) for o, r in zip(outs, [r for r in range(world)
                                                                   if r != dst])]
            for w in works:
                w.wait()
        else:
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=dst)
        return True
    if method == "first-touch floor":
        from distributed_ext.gather import allocate_outputs

        if rank == dst:  # allocate dst's outputs fresh, as gather_bytes does, and write
            # every page once
            outs = allocate_outputs([len(data)] * world, rank)
            for o in outs:
                torch.frombuffer(o, dtype=torch.uint8).fill_(1)
        return True
    holder = [None] * world if rank == dst else None
    if workload == "bytes":
        dist.gather_object(bytes(data), holder, dst=dst)
        return holder is None or len(holder[rank]) == len(data)
    bio = io.BytesIO()
    torch.save(data, bio)
    dist.gather_object(bio.getvalue(), holder, dst=dst)
    del bio
    got = [len(torch.load(io.BytesIO(b), weights_only=True)) for b in holder or []]
    return rank != dst or got == [len(data)] * world


def _llama_config(nbytes: int) -> Any:
    """A Llama config of about ``nbytes`` of fp32 parameters (hidden 1024, intermediate
    2816, vocab 32000, untied; a quarter of each below 512 MiB)."""
    from transformers import LlamaConfig

    h, i, v = (1024, 2816, 32000) if nbytes >= 512 * 2**20 else (256, 704, 8000)
    per_layer = 4 * (2 * h * h + 2 * h * h // 4 + 3 * h * i)  # q,o + k,v (4 kv heads) + mlp
    layers = max(1, round((nbytes - 4 * 2 * v * h) / per_layer))
    return LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=i,
                       num_hidden_layers=layers, num_attention_heads=h // 64,
                       num_key_value_heads=h // 256, tie_word_embeddings=False)


def build_export_model(nbytes: int, device: str = "cpu") -> Any:
    """An FSDP2-wrapped Llama-shaped model of about ``nbytes`` of fp32 parameters, from a
    config (:func:`_llama_config`), built alike on every rank, its shards on ``device``
    ("cuda": GPU-resident)."""
    import torch
    from transformers import LlamaForCausalLM

    import distributed_ext as dx

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(nbytes)).to(device)
    dx.fsdp2_wrap(model)
    return model


def _export_call(method: str, model: Any, rank: int, dst: int) -> bool:
    """One export into a fresh directory next to the system's temp dir, removed afterwards."""
    import shutil

    import torch.distributed as dist

    import distributed_ext as dx

    # The run's own directory (made and removed, on any exit, by the process that started
    # the ranks), else the bench directory.
    base = os.environ.get("DEXT_BENCH_RUN_DIR") or bench_dir()
    out = os.path.join(base, f"dext-export-{os.getpid() if rank == dst else 'x'}")
    # Every rank must name the same directory for DCP: dst's choice is broadcast.
    out = dx.broadcast(out, src=dst) if dist.is_initialized() else out
    try:
        if method == "distributed_ext":
            dx.export_hf_checkpoint(model, out, dst=dst)
        elif method == _ONE_WRITER:
            dx.export_hf_checkpoint(model, out, dst=dst, writers="dst")
        elif method == "torch get_model_state_dict+save_pretrained":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
            if rank == dst:
                model.save_pretrained(out, state_dict=sd)
            del sd
            dist.barrier()
        elif method == "torch dcp HuggingFaceStorageWriter":
            import torch.distributed.checkpoint as dcp

            writer = dcp.HuggingFaceStorageWriter(out, save_distributed=True,
                                                  enable_consolidation=True)
            dcp.save(model.state_dict(), storage_writer=writer)
            dist.barrier()
        elif method == _PARALLEL_DISK:
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            path = dx.broadcast(os.path.join(base, f"dext-disk-{os.getpid()}"), src=dst)
            _write_shares(path, nbytes, rank, dist.get_world_size(), dst)
        else:  # the disk's own sequential write rate for the same bytes, dst only
            if rank == dst:
                # A DTensor's numel is the full tensor's: the checkpoint's size.
                nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
                path = os.path.join(base, f"dext-disk-{os.getpid()}")
                if method == "disk write+fsync":
                    _write_sequential(path, nbytes)
                else:
                    _write_direct(path, nbytes)
            dist.barrier()
        return True
    finally:
        if rank == dst:
            shutil.rmtree(out, ignore_errors=True)


def _write_sequential(path: str, nbytes: int) -> None:
    block = bytearray(16 * 2**20)
    try:
        with open(path, "wb") as f:
            for start in range(0, nbytes, len(block)):
                f.write(memoryview(block)[: min(len(block), nbytes - start)])
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _write_direct(path: str, nbytes: int) -> None:
    """``nbytes`` written as ours writes a checkpoint: O_DIRECT where the disk takes it."""
    from distributed_ext import _direct_io

    file = _direct_io.DirectFile(path, nbytes)
    try:
        _fill_range(file, 0, nbytes)
    finally:
        file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _fill_range(file: Any, start: int, end: int) -> None:
    """Bytes ``[start, end)`` of a ``DirectFile`` written in 16 MiB pieces, then fsynced."""
    from distributed_ext import _direct_io

    block = _direct_io.aligned_empty(16 * 2**20).fill_(1)
    for at in range(start, end, block.numel()):
        file.write(at, block[: min(block.numel(), end - at)])
    file.sync()


def _write_shares(path: str, nbytes: int, rank: int, world: int, dst: int) -> None:
    """Every rank writes its 1/world of one ``nbytes`` file (dst makes it), as
    ``writers="all"`` does: direct where the disk takes it, then fsync; dst removes it."""
    import torch.distributed as dist

    from distributed_ext import _direct_io

    if rank == dst:
        _direct_io.DirectFile(path, nbytes).close()
    dist.barrier()
    share = -(-nbytes // world // _direct_io.ALIGN) * _direct_io.ALIGN
    file = _direct_io.DirectFile(path, nbytes, create=False)
    try:
        _fill_range(file, min(nbytes, rank * share), min(nbytes, (rank + 1) * share))
    finally:
        file.close()
        dist.barrier()
        if rank == dst:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _payload(size: int, rank: int) -> bytearray:
    import torch

    data = bytearray(size)
    torch.frombuffer(data, dtype=torch.uint8).random_(
        0, 256, generator=torch.Generator().manual_seed(rank))
    return data


def measure(workload: str, method: str, size: int, repeat: int, show_progress: bool,
            fresh_ranks: bool = True, chunk_bytes: int | None = None,
            device: str = "cpu") -> dict | None:
    """Runs on every rank (collective): the first call, then ``repeat`` warm ones.

    ``device``: where the export workload's shards live ("cuda": GPU-resident).

    Returns dst's figures as a dict (a :class:`Result`'s fields); None on the other ranks.
    """
    import torch.distributed as dist

    rank, world, dst = dist.get_rank(), dist.get_world_size(), 0
    if workload == "export":
        # transformers' own "Writing model shards" bars would interleave with ours.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        data: Any = build_export_model(size, device)
        # A DTensor's numel is the full tensor's: this is the checkpoint's size, on every rank.
        checkpoint = sum(p.numel() * p.element_size() for p in data.parameters())
        moved = checkpoint // world  # a rank's share, for the table's size/rank column
    elif workload == "bytes":
        data = _payload(size, rank)
        moved = len(data)
    else:
        data = make_state(size, seed=rank)
        moved = sum(t.numel() * t.element_size() for t in data.values())
    show = show_progress and rank == dst
    peaks: list[int] = []
    checks: list[bool] = []
    rss: list[PeakRSS] = []

    moved_io: list[RankIO] = []

    def call(i: int) -> bool:
        label = f"{workload} ({method}) {'first' if i == 0 else f'{i}/{repeat}'}"
        with PeakRSS() as sampler, RankIO() as counted:
            rss.append(sampler)
            moved_io.append(counted)
            if method == "distributed_ext":
                ok = _call(workload, method, data, rank, world, dst, ProgressBar(label, show),
                           chunk_bytes)
            else:
                with Running(label, show):
                    ok = _call(workload, method, data, rank, world, dst, None)
        return ok

    def after(i: int, ok: bool) -> None:
        checks.append(ok)
        peaks.append(rss[-1].added)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    if not all(checks):
        raise RuntimeError(f"{workload} ({method}): a wrong result on rank {rank}")
    per_rank: list[dict] = []
    if workload == "export":  # every rank's own figures, to dst (as JSON: nothing unpickled)
        import distributed_ext as dx

        mine = {"rank": rank, "peak_rss": max(peaks), "written": moved_io[0].written,
                "sent": moved_io[0].sent}
        got = dx.gather_bytes(json.dumps(mine).encode(), dst)
        per_rank = [] if got is None else [json.loads(bytes(b)) for b in got]
    if rank != dst:
        return None
    # GB/s numerator: what dst receives from the others (the whole checkpoint for export).
    received = checkpoint if workload == "export" else (world - 1) * moved
    return asdict(Result(workload, method, world, moved, received, timing.first, timing.warm,
                         peaks, fresh_ranks, per_rank))


# -- reporting -------------------------------------------------------------------------------


def _ratio(base: float, ours: float) -> str:
    if base <= 0 or ours <= 0:
        return "-"
    r = base / ours
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


def format_table(results: list[Result]) -> str:
    """The table: first call and warm figures side by side, ratios against each workload's
    baseline (ours only)."""
    head = ("| workload | world | size/rank | method | first call s | warm median s | warm "
            "min-max s | GB/s first / warm* | vs baseline first / warm | dst peak RSS |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r.timing()
        base = next((b for b in results if b.workload == r.workload and b.size == r.size
                     and b.world == r.world and b.method == BASELINE[r.workload]), None)
        if r.method == "distributed_ext" and base is not None:
            bt = base.timing()
            vs = f"{_ratio(bt.first, t.first)} / {_ratio(bt.median, t.median)}"
        else:
            vs = "1.0x" if base is r else "-"
        lines.append(
            f"| {r.workload} | {r.world} | {format_size(r.size)} | {r.method} | {t.first:.3f} | "
            f"{t.median:.3f} | {t.low:.3f}-{t.high:.3f} | {r.gbps_first:.2f} / "
            f"{r.gbps_warm:.2f} | {vs} | +{format_size(max(r.dst_peak_rss or [0]))} |")
    lines.append("\n*GB/s: bytes dst receives from the other ranks (for export: the "
                 "checkpoint's bytes) per second of dst's wall time (barrier to return); warm = "
                 "the median of the warm calls.")
    per_rank = [r for r in results if r.per_rank]
    if per_rank:
        lines += ["", "Per rank (export): peak RSS growth over the calls; bytes written to "
                  "files and sent over the link in the first call.", "",
                  "| size/rank | method | rank | peak RSS growth | written | sent |",
                  "|---|---|---|---|---|---|"]
        for r in per_rank:
            for f in r.per_rank:
                # torch's routes send through collectives, which wchar counts as writes
                sent = "-" if r.method in _TORCH_METHODS else format_size(f["sent"])
                written = format_size(f["written"]) + (" *" if r.method in _TORCH_METHODS
                                                       else "")
                lines.append(f"| {format_size(r.size)} | {r.method} | {f['rank']} | "
                             f"+{format_size(f['peak_rss'])} | {written} | {sent} |")
        if any(r.method in _TORCH_METHODS for r in per_rank):
            lines.append("\n\\* files and link together: torch's collectives are not "
                         "counted apart.")
    return "\n".join(lines)


def check_targets(results: list[Result]) -> list[str]:
    """The targets this run can judge, per workload and size, each verdict naming its target."""
    out = _export_targets([r for r in results if r.workload == "export"])
    for size in sorted({r.size for r in results if r.workload == "bytes"}, reverse=True):
        out += _targets_at([r for r in results if r.size == size or r.workload != "bytes"],
                           format_size(size))
    return out


def _export_targets(results: list[Result]) -> list[str]:
    out = []
    for size in sorted({r.size for r in results}, reverse=True):
        rows = {r.method: r for r in results if r.size == size}
        ours = rows.get("distributed_ext")
        if ours is None:
            continue
        label = f"export of a {format_size(ours.received)} checkpoint"
        torch_rows = [rows[m] for m in ("torch get_model_state_dict+save_pretrained",
                                        "torch dcp HuggingFaceStorageWriter") if m in rows]
        if torch_rows:
            best = min(r.first for r in torch_rows)
            ratio = best / ours.first
            out.append(f"{'met ' if ratio >= 2 else 'MISSED'} [{label}] first call vs the faster "
                       f"torch route: {ratio:.2f}x (target >= 2x)")
        b = rows.get("torch get_model_state_dict+save_pretrained")
        peak = max(ours.dst_peak_rss or [0])
        if b is not None:
            quarter = max(b.dst_peak_rss or [0]) / 4
            out.append(f"{'met ' if peak <= quarter else 'MISSED'} [{label}] dst peak RSS growth "
                       f"{format_size(peak)} vs 1/4 of route (b)'s: {format_size(quarter)}")
        out.append(f"{'met ' if peak <= 512 * 2**20 else 'MISSED'} [{label}] dst peak RSS "
                   f"growth {format_size(peak)} (target <= 512 MiB)")
        disks = [rows[m] for m in _DISK_METHODS if m in rows]
        if disks:
            # Against the faster of the disk's two ways, first call and warm alike.
            for when, of in (("first call", lambda r: r.first),
                             ("warm", lambda r: r.timing().median)):
                ratio = min(of(d) for d in disks) / of(ours)
                out.append(f"{'met ' if ratio >= 0.7 else 'MISSED'} [{label}] write rate vs "
                           f"the disk's faster way ({when}): {ratio:.2f}x (target >= 0.7x)")
        out.extend(_writers_targets(rows, label))
    return out


def _writers_targets(rows: dict[str, Result], label: str) -> list[str]:
    """Ours (every rank writing, the default where all see the directory) against one
    writer, route (b) and the disk (first calls): the targets are a RAM filesystem's (>= 1.6x
    dst, >= 5x route (b)) and a disk's (>= 0.8x its O_DIRECT rate); the caption names which
    this run wrote to. Beside a speed ratio, its ceiling on this filesystem: the baseline
    against the bare write of the same bytes (the faster of the disk rows), which no export
    can beat."""
    every, one = rows.get("distributed_ext"), rows.get(_ONE_WRITER)
    if every is None or one is None:
        return []
    bare = min([rows[m].first for m in ("disk O_DIRECT write", _PARALLEL_DISK) if m in rows],
               default=None)
    checks = [("vs writers=dst", one.first, 1.6)]
    if "torch get_model_state_dict+save_pretrained" in rows:
        checks.append(("vs route (b)", rows["torch get_model_state_dict+save_pretrained"].first,
                       5.0))
    out = [f"{'met ' if base / every.first >= target else 'MISSED'} [{label}, every rank "
           f"writing] first call {name}: {base / every.first:.2f}x (target >= {target}x"
           + (f"; this filesystem's ceiling {base / bare:.2f}x: the same baseline against "
              "the bare write of the bytes)" if bare else ")")
           for name, base, target in checks]
    rates = []
    if "disk O_DIRECT write" in rows:
        rates.append(("rate vs the disk's O_DIRECT", rows["disk O_DIRECT write"].first))
    if _PARALLEL_DISK in rows:  # the same target against what every rank writing can reach
        rates.append(("rate vs the disk's O_DIRECT, every rank its share",
                      rows[_PARALLEL_DISK].first))
    out += [f"{'met ' if disk / every.first >= 0.8 else 'MISSED'} [{label}, every rank "
            f"writing] first call {name}: {disk / every.first:.2f}x (target >= 0.8x)"
            for name, disk in rates]
    if every.per_rank:
        peak = max(f["peak_rss"] for f in every.per_rank)
        out.append(f"{'met ' if peak <= 128 * 2**20 else 'MISSED'} [{label}, every rank writing] "
                   f"every rank's peak RSS growth: at most {format_size(peak)} "
                   "(target <= 128 MiB)")
    return out


def _targets_at(results: list[Result], label: str) -> list[str]:
    by = {(r.workload, r.method): r.timing() for r in results}
    out = []

    def line(name: str, value: float, target: float, higher: bool = True) -> None:
        ok = value >= target if higher else value <= target
        out.append(f"{'met ' if ok else 'MISSED'} [{label}/rank] {name}: {value:.2f}x (target "
                   f"{'>=' if higher else '<='} {target}x)")

    ours = by.get(("bytes", "distributed_ext"))
    if ours is None:
        return out
    raw = by.get(("bytes", "raw gloo send/recv"))
    obj = by.get(("bytes", "torch gather_object"))
    floor = by.get(("bytes", "first-touch floor"))
    if raw is not None:
        line("first call vs raw gloo's first call", raw.first / ours.first, 0.9)
    if obj is not None:
        line("first call vs gather_object's first call", obj.first / ours.first, 3.0)
        line("warm vs gather_object warm", obj.median / ours.median, 10.0)
    if ours.warm:
        line("warm max/min over the warm calls", ours.spread, 1.5, higher=False)
    if floor is not None:
        line("warm vs the first-touch floor of dst's outputs (ours / floor)",
             ours.median / floor.median, 1.3, higher=False)
    return out


def environment() -> dict[str, Any]:
    """What a figure was measured on: versions, cores, memory, host, date."""
    import torch

    import distributed_ext

    total = None
    try:
        with open("/proc/meminfo") as f:
            total = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "distributed_ext": distributed_ext.__version__, "cores": os.cpu_count(),
            "memory_bytes": total, "host": platform.node(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def plot(results: list[Result], path: str) -> None:
    """First-call and warm GB/s per method, one group of bars per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.method != "first-touch floor"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r.workload}\n{r.method}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.gbps_first for r in rows], 0.4, label="first call")
    ax.bar([x + 0.2 for x in xs], [r.gbps_warm for r in rows], 0.4, label="warm median")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("GB/s received on dst")
    if results:
        ax.set_title(f"gather to rank 0, world {results[0].world}, "
                     f"{format_size(results[0].size)} per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_results(path: str) -> tuple[dict[str, Any], list[Result]]:
    """A JSON written by ``--json``: (its environment, its results)."""
    with open(path) as f:
        doc = json.load(f)
    return doc.get("environment", {}), [Result(**r) for r in doc["results"]]


def conditions(exports: bool) -> str:
    """What moves the figures, to print beside them: the machine's load now (read before the
    ranks start) and, for an export, the filesystem it writes to (disks differ 4x between
    machines; a RAM filesystem shows the software's own cost)."""
    try:
        load = _load_text(os.getloadavg())
    except OSError:
        load = "load average unknown"
    if exports:
        where = bench_dir()
        return f"{load}; exports write to {where} ({_filesystem(where)})"
    return load


def report(results: list[Result], args: argparse.Namespace, where: str) -> None:
    print(f"\ndistributed-ext-bench, {where}, {datetime.date.today()}, torch "
          f"{__import__('torch').__version__}: first call, then the median and spread of "
          f"{args.repeat} warm calls")
    if getattr(args, "conditions", None):
        print(args.conditions)
    print(format_table(results))
    for line in check_targets(results):
        print("  " + line)
    if args.json:
        from distributed_ext._atomic import replacing

        text = json.dumps({"environment": {**environment(), "where": where,
                                           "repeat": args.repeat,
                                           "conditions": getattr(args, "conditions", None)},
                           "results": [asdict(r) for r in results]}, indent=2)
        with replacing(args.json) as f:  # an interrupted run leaves the earlier file whole
            f.write(text.encode())
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")


# -- running ---------------------------------------------------------------------------------


def _rank_measure(workload: str, method: str, size: int, repeat: int, show: bool,
                  chunk_bytes: int | None = None) -> dict | None:
    """Entry point of a local rank (importable by name for the spawner)."""
    return measure(workload, method, size, repeat, show, chunk_bytes=chunk_bytes)


def measure_fresh(workload: str, method: str, world: int, size: int, repeat: int,
                  chunk_bytes: int | None = None, timeout: float = 3600) -> Result:
    """One method in fresh local ranks (for the scenarios of benchmarks/); raises on failure."""
    return Result(**_dst_value(f"{workload} ({method})", _rank_measure, world, workload,
                               method, size, repeat, False, chunk_bytes, timeout=timeout))


def _dst_value(what: str, fn: Any, world: int, *args: Any, timeout: float = 3600) -> Any:
    """``fn(*args)`` in ``world`` fresh local ranks; what rank 0 returned. RuntimeError
    naming ``what`` and every rank that failed, if any did."""
    outcomes = run_local(fn, world, *args, timeout=timeout, pg_timeout=timeout)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"{what}: " + "; ".join(o.describe() for o in failed))
    return outcomes[0].value


# -- many small tensors ----------------------------------------------------------------------


def _filesystem(path: str) -> str:
    """The filesystem type of ``path`` and its mount point, for a figure's caption."""
    from distributed_ext import _direct_io

    kind, mount = _direct_io.filesystem_of(path)
    return f"{kind} at {mount or '?'}"


def _load_text(load: tuple[float, ...]) -> str:
    return "load average (1/5/15 min) before the run: " + " ".join(f"{x:.2f}" for x in load)


def _many_rank(route: str, entries: int, per_rank: int, base: str, repeat: int
               ) -> dict | None:
    """In each fresh rank: ``entries`` Shard(0) DTensors of ``per_rank`` bytes per rank (fp32),
    exported ``1 + repeat`` times by ``route``; dst's Timing as a dict, None elsewhere."""
    import shutil
    from dataclasses import asdict

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import distributed_ext as dx
    from distributed_ext._timing import time_calls

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": distribute_tensor(
        torch.randn(per_rank // 4 * world, generator=g), mesh, [Shard(0)])
        for i in range(entries)}
    out = os.path.join(base, f"dext-many-{os.getppid()}")

    def call(i: int) -> None:
        path = f"{out}-{i}"
        if route == "distributed_ext":
            dx.export_hf_checkpoint(state, path)
        else:
            _save_full_tensors(state, path)

    def after(i: int, _value: None) -> None:
        if rank == 0:
            shutil.rmtree(f"{out}-{i}", ignore_errors=True)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    return asdict(timing) if rank == 0 else None


def _save_full_tensors(state: dict, path: str) -> None:
    """torch's route for a state of DTensors: every entry's ``full_tensor()`` (a collective
    each), rank 0 saving them with safetensors; every rank returns once it has."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    full = {k: v.full_tensor() for k, v in state.items()}
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        save_file(full, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()


def measure_many(world: int, per_rank: int, many: int, few_factor: int, repeat: int,
                 base: str) -> list[tuple[str, int, Timing]]:
    """Every (route, entries) pair in fresh local ranks: ``many`` entries, and the same bytes
    in ``many // few_factor`` entries."""
    rows = []
    for entries, size in ((many, per_rank), (many // few_factor, per_rank * few_factor)):
        for route in ("distributed_ext", "torch full_tensor()+save_file"):
            value = _dst_value(f"{route}, {entries} entries", _many_rank, world, route,
                               entries, size, base, repeat)
            rows.append((route, entries, Timing(**value)))
            print(f"  done: {entries} entries, {route}", file=sys.stderr, flush=True)
    return rows


def format_many(rows: list[tuple[str, int, Timing]], world: int, per_rank: int, many: int,
                base: str, load: tuple[float, float, float]) -> list[str]:
    lines = [f"many tensors: world {world} on gloo, Shard(0) fp32 DTensors, the same bytes "
             f"({format_size(many * per_rank * world)}) as {many} entries of "
             f"{format_size(per_rank)} per rank and as fewer, larger ones; writing to {base} "
             f"({_filesystem(base)}); {_load_text(load)}",
             "| route | entries | first call s | warm median s | warm min-max s |",
             "|---|---|---|---|---|"]
    for route, entries, t in rows:
        lines.append(f"| {route} | {entries} | {t.first:.3f} | {t.median:.3f} | "
                     f"{t.low:.3f}-{t.high:.3f} |")
    get = {(r, e): t for r, e, t in rows}
    few = min(e for _r, e, _t in rows)
    ours_many, ours_few = get[("distributed_ext", many)], get[("distributed_ext", few)]
    torch_many = get[("torch full_tensor()+save_file", many)]
    for label, value, target, ok in (
            ("ours, many / few entries, first call", ours_many.first / ours_few.first,
             "<= 3x", ours_many.first / ours_few.first <= 3),
            ("ours, many / few entries, warm", ours_many.median / ours_few.median, "<= 3x",
             ours_many.median / ours_few.median <= 3),
            ("torch's route / ours at many entries, first call",
             torch_many.first / ours_many.first, ">= 10x",
             torch_many.first / ours_many.first >= 10),
            ("torch's route / ours at many entries, warm", torch_many.median / ours_many.median,
             ">= 10x", torch_many.median / ours_many.median >= 10)):
        lines.append(f"  {'met ' if ok else 'MISSED'} {label}: {value:.2f}x (target {target})")
    return lines


TP_ROUTES = ("writers=all", "writers=dst", "torch full_tensor()+save_file")


def _tp_rank(route: str, size: int, run: int, base: str, repeat: int) -> dict | None:
    """In each fresh rank: a TP layout of ``size`` bytes -- 16 fp32 ``Shard(1)`` DTensors,
    each rank's part of a row ``run`` bytes -- exported ``1 + repeat`` times by ``route``;
    dst's Timing and every rank's bytes written and sent (the first call's) as a dict on
    dst, None elsewhere."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    cols = run // 4 * world
    rows = max(1, size // 16 // (cols * 4))
    state = {f"model.layers.{i}.w": distribute_tensor(torch.randn(rows, cols, generator=g),
                                                      mesh, [Shard(1)]) for i in range(16)}

    def save(path: str) -> None:
        _save_full_tensors(state, path)

    return _time_routes(route, state, save, os.path.join(base, f"dext-tp-{os.getppid()}"),
                        repeat)


def _time_routes(route: str, model: Any, baseline: Any, out: str, repeat: int) -> dict | None:
    """``model`` exported ``1 + repeat`` times by ``route`` (``writers=...``: ours; else
    ``baseline(path)``), into fresh directories ``out-<i>`` that dst removes; dst's Timing
    and every rank's bytes written and sent in the first call, on dst (None elsewhere)."""
    import shutil
    from dataclasses import asdict

    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext._timing import time_calls

    rank, world = dist.get_rank(), dist.get_world_size()
    moved: list[RankIO] = []

    def call(i: int) -> None:
        path = f"{out}-{i}"
        with RankIO() as counted:
            if route.startswith("writers="):
                dx.export_hf_checkpoint(model, path, writers=route.split("=")[1])
            else:
                baseline(path)
        moved.append(counted)

    def after(i: int, _value: None) -> None:
        if rank == 0:
            shutil.rmtree(f"{out}-{i}", ignore_errors=True)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (moved[0].written, moved[0].sent))  # (our own counts)
    return {"timing": asdict(timing), "io": every} if rank == 0 else None


def measure_tp(world: int, size: int, run: int, repeat: int, base: str
               ) -> list[tuple[str, Timing, list]]:
    """Each route of :data:`TP_ROUTES` in fresh local ranks (:func:`_tp_rank`)."""
    rows = []
    for route in TP_ROUTES:
        value = _dst_value(route, _tp_rank, world, route, size, run, base, repeat)
        rows.append((route, Timing(**value["timing"]), value["io"]))
        print(f"  done: TP layout, {route}", file=sys.stderr, flush=True)
    return rows


def format_tp(rows: list[tuple[str, Timing, list]], world: int, size: int, run: int,
              base: str, load: tuple[float, float, float]) -> list[str]:
    lines = [f"TP layout: world {world} on gloo, 16 fp32 Shard(1) DTensors, "
             f"{format_size(size)} in all, each rank's part of a row {run} bytes; writing to "
             f"{base} ({_filesystem(base)}); {_load_text(load)}", *_route_table(rows)]
    get = {r: t for r, t, _io in rows}
    ours, one, torch_route = (get[r] for r in TP_ROUTES)
    for label, a, b in (("writers=dst / writers=all", one, ours),
                        ("torch's route / writers=all", torch_route, ours)):
        lines.append(f"  {label}: first call {a.first / b.first:.2f}x, "
                     f"warm {a.median / b.median:.2f}x")
    return lines


def _route_table(rows: list[tuple[str, Timing, list]]) -> list[str]:
    """One row per route: first call, warm median and min-max, and each rank's MB written to
    files and sent in the first call (ours; the disk's rows: written; a baseline's are not
    known apart from its sockets' writes: "-")."""
    lines = ["| route | first call s | warm median s | warm min-max s | "
             "per rank, first call: MB written to files / MB sent |",
             "|---|---|---|---|---|"]
    for route, t, counts in rows:
        ours, disk = route.startswith("writers="), route.startswith("disk")
        per_rank = ", ".join((f"{w / 1e6:.0f}" if ours or disk else "-") + "/"
                             + (f"{n / 1e6:.0f}" if ours else "-") for w, n in counts)
        lines.append(f"| {route} | {t.first:.3f} | {t.median:.3f} | {t.low:.3f}-{t.high:.3f} "
                     f"| {per_rank} |")
    return lines


# -- FSDP x TP, as torch's 2-D recipe builds it ----------------------------------------------

_HF_SAVE = "transformers gather_full_state_dict+save_pretrained"
FSDP_TP_ROUTES = ("writers=all", "writers=dst", _HF_SAVE, "disk O_DIRECT write",
                  _PARALLEL_DISK)


def build_fsdp_tp_model(nbytes: int, dp: int, tp: int) -> Any:
    """The Llama-shaped model of :func:`build_export_model` under torch's 2-D recipe, as
    torchtitan applies it: ``parallelize_module`` (Colwise q/k/v/gate/up and lm_head,
    Rowwise o/down and the embedding) on the ``tp`` mesh dim, then ``fully_shard`` of each
    layer and the root over ``dp`` -- so colwise weights, the embedding and lm_head are
    ``(_StridedShard(0, split_factor=tp), Shard(0))``. Built on the meta device and
    materialized as shards (no rank holds the full model), filled with seeded values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(nbytes))
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.02, 0.02, generator=g)
    return model


def _fsdp_tp_rank(route: str, size: int, base: str, repeat: int) -> dict | None:
    """In each fresh rank (world 4: a 2 x 2 mesh): :func:`build_fsdp_tp_model` of ``size``
    bytes, written ``1 + repeat`` times by ``route``; as :func:`_time_routes`."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp_tp_model(size, world // 2, 2)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the full size

    def baseline(path: str) -> None:
        if route == _HF_SAVE:  # what save_pretrained runs for a model sharded over dp
            from transformers.distributed.utils import gather_full_state_dict

            state = gather_full_state_dict(model)
            if rank == 0:
                model.save_pretrained(path, state_dict=state)
            del state
        elif route == _PARALLEL_DISK:
            _write_shares(path, nbytes, rank, world, 0)
        elif rank == 0:
            _write_direct(path, nbytes)
        dist.barrier()

    return _time_routes(route, model, baseline, os.path.join(base, f"dext-2d-{os.getppid()}"),
                        repeat)


def measure_fsdp_tp(world: int, size: int, repeat: int, base: str
                    ) -> list[tuple[str, Timing, list]]:
    """Each route of :data:`FSDP_TP_ROUTES` in fresh local ranks (:func:`_fsdp_tp_rank`)."""
    if world < 4 or world % 2:
        raise ValueError(f"--world {world}: FSDP x TP needs an even world of at least 4 "
                         "(the mesh is world/2 x 2); pass --world 4")
    rows = []
    for route in FSDP_TP_ROUTES:
        value = _dst_value(route, _fsdp_tp_rank, world, route, size, base, repeat)
        rows.append((route, Timing(**value["timing"]), value["io"]))
        print(f"  done: FSDP x TP, {route}", file=sys.stderr, flush=True)
    return rows


def format_fsdp_tp(rows: list[tuple[str, Timing, list]], world: int, size: int, base: str,
                   load: tuple[float, float, float]) -> list[str]:
    lines = [f"FSDP x TP (torch's 2-D recipe: parallelize_module on tp, fully_shard over dp; "
             f"colwise weights (_StridedShard(0, 2), Shard(0))): a Llama-shaped model of "
             f"{format_size(size)} fp32, mesh {world // 2} x 2, world {world} on gloo; "
             f"writing to {base} ({_filesystem(base)}); {_load_text(load)}",
             *_route_table(rows)]
    get = {r: t for r, t, _io in rows}
    ours = get["writers=all"]
    for label, base_t, target in (
            ("transformers' save / ours", get[_HF_SAVE], 5.0),
            ("ours vs the disk's O_DIRECT rate (dst alone)", get["disk O_DIRECT write"], 0.8),
            ("ours vs the disk's O_DIRECT rate, every rank its share", get[_PARALLEL_DISK],
             0.8)):
        for when, a, b in (("first call", base_t.first, ours.first),
                           ("warm", base_t.median, ours.median)):
            ratio = a / b
            lines.append(f"  {'met ' if ratio >= target else 'MISSED'} {label}, {when}: "
                         f"{ratio:.2f}x (target >= {target}x)")
    one = get["writers=dst"]
    lines.append(f"  writers=dst / writers=all: first call {one.first / ours.first:.2f}x, "
                 f"warm {one.median / ours.median:.2f}x")
    return lines


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


def spawn_local(args: argparse.Namespace) -> int:
    args.conditions = conditions("export" in args.workloads)
    biggest = max(args.sizes)
    baseline = not args.no_baseline
    for workload in args.workloads:  # every workload refused up front, with the numbers
        check_memory(biggest, args.world, baseline, workload)
    with _run_directory("export" in args.workloads) as run_dir:
        return _spawn_in(args, biggest, baseline, run_dir)


def _spawn_in(args: argparse.Namespace, biggest: int, baseline: bool, run_dir: str | None) -> int:
    if not args.no_warm_up:
        need = max(estimate_peak_bytes(biggest, args.world, baseline, w) for w in args.workloads)
        print(f"distributed-ext-bench: warming the machine up first (--no-warm-up skips it): "
              f"writing {format_size(need)} of memory once"
              + (f", and a {format_size(biggest)} file to {run_dir} (removed at once)"
                 if run_dir else ""), flush=True)
        if run_dir is not None:  # the first write through the page cache, as for memory
            _write_sequential(os.path.join(run_dir, "warm-up"), biggest)
        touch_machine_memory(need)
    show = not args.quiet and sys.stderr.isatty()
    results: list[Result] = []
    env = {"DEXT_BENCH_RUN_DIR": run_dir} if run_dir else {}

    for size, workload in ((s, w) for s in args.sizes for w in args.workloads):
        def announce(pids: list[int], size: int = size, workload: str = workload) -> None:
            what = (f"a Llama-shaped model of about {format_size(size)}" if workload == "export"
                    else f"{format_size(size)} per rank")
            print(f"distributed-ext-bench: {args.world} local ranks on gloo (pids "
                  f"{', '.join(str(p) for p in pids)}), {what}", flush=True)

        for method in resolve_methods(workload, baseline):
            # Fresh ranks per method: its first call is a first call.
            outcomes = run_local(_rank_measure, args.world, workload, method, size,
                                 args.repeat, show, timeout=args.timeout,
                                 pg_timeout=args.timeout, capture_output=False,
                                 stop_on_sigint=True, on_start=announce, env=env)
            if any(o.interrupted for o in outcomes):
                print("\ndistributed-ext-bench: interrupted; every local rank stopped",
                      file=sys.stderr)
                return 130
            failed = [o for o in outcomes if not o.ok]
            if failed:
                print("distributed-ext-bench: failed: "
                      + "; ".join(o.describe() for o in failed), file=sys.stderr)
                return 1
            results.append(Result(**outcomes[0].value))
    report(results, args, f"{args.world} local ranks on gloo, fresh ranks per method, "
                          f"{platform.node()} ({os.cpu_count()} cores)")
    return 0


def run_launched(args: argparse.Namespace) -> int:
    """Under torchrun: NCCL on GPUs, gloo on a CPU-only node (both via distributed_run)."""
    import torch.distributed as dist

    import distributed_ext as dx

    args.conditions = conditions("export" in args.workloads)
    with dx.distributed_run() as state:
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        show = state.is_main and not args.quiet and sys.stderr.isatty()
        results = []
        for size, workload in ((s, w) for s in args.sizes for w in args.workloads):
            for method in resolve_methods(workload, not args.no_baseline, backend):
                row = measure(workload, method, size, args.repeat, show, fresh_ranks=False)
                if row is not None:
                    results.append(Result(**row))
        where = (f"torchrun, {state.world_size} ranks, {backend.upper() if backend == 'nccl' else backend}"
                 ", the methods share the launch's ranks (first calls after the first method's "
                 "are not fresh)")
        dist.barrier()  # tear down together
    if results:
        report(results, args, where)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        try:
            env, results = load_results(args.from_json)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"distributed-ext-bench: --from-json {args.from_json}: not a file written by "
                  f"--json ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        args.repeat = env.get("repeat", args.repeat)
        args.conditions = env.get("conditions")
        report(results, args, f"from {args.from_json} ({env.get('where', '?')}, "
                              f"{env.get('date', '?')})")
        return 0
    from distributed_ext import runtime

    try:
        if runtime.is_distributed_launch():
            return run_launched(args)
        return spawn_local(args)
    except KeyboardInterrupt:
        print("\ndistributed-ext-bench: interrupted; nothing was left behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
