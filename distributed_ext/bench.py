"""distributed-ext-bench: gather multi-GB shards, ours against torch's baseline, in one command.

Without a launcher it spawns ``--world`` local ranks on gloo (CPU); under torchrun it joins
the launch (``distributed_run``: NCCL on GPUs, gloo on a CPU-only node), so the same command
runs on a laptop and across many nodes. Rank 0 is dst; it prints a progress bar while data
moves and a results table at the end.

Workloads (``--size`` per rank):
  bytes        gather_bytes                 vs dist.gather_object of the same bytes
  state-dict   gather_state_dicts of an LLM-shaped state (4096x4096 bf16 matrices and small
               tensors) vs torch.save + dist.gather_object + torch.load(weights_only=True)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import io
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

WORKLOADS = ("bytes", "state-dict")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '1.5GB', '4096' -> bytes; argparse-friendly errors otherwise."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected a positive number with an optional unit, e.g. "
            "512MiB, 1GiB, 1.5GB or 4096 (bytes)"
        )
    return int(value * _UNITS[unit])


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
    ap.add_argument("--size", type=parse_size, default=parse_size("256MiB"),
                    help="bytes per rank, with units: 256MiB (default), 1GiB, ...")
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is shown")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch baselines")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw ours vs baseline (matplotlib)")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds before local ranks are stopped (default 3600)")
    args = ap.parse_args(argv)
    if args.world < 1:
        ap.error(f"--world must be at least 1, got {args.world}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.no_baseline:
        try:
            import numpy  # noqa: F401
        except ImportError:
            ap.error("the torch baseline (dist.gather_object) needs numpy: pip install "
                     "'distributed_ext[bench]' (or numpy), or pass --no-baseline")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install 'distributed_ext[plot]' (or "
                     "pip install matplotlib)")
    args.workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    return args


# -- memory ----------------------------------------------------------------------------------


def estimate_peak_bytes(size: int, world: int, baseline: bool) -> int:
    """Host memory one machine needs for a local run: payloads, dst's outputs, the baseline.

    gather_object holds, on dst, each rank's pickle as received, its unpickled copy and
    staging (measured: 7 GiB for 1 GiB at world 2); senders hold a pickle and a tensor copy.
    """
    per_rank_runtime = 400 * 2**20  # torch + gloo per process
    ours = world * size + world * size
    base = (3 * world + 1) * size + (world - 1) * 3 * size if baseline else 0
    return max(ours, base) + world * per_rank_runtime


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(size: int, world: int, baseline: bool) -> None:
    need = estimate_peak_bytes(size, world, baseline)
    have = available_bytes()
    if have is not None and need > have:
        raise SystemExit(
            f"distributed-ext-bench: --size {format_size(size)} at --world {world} needs about "
            f"{format_size(need)} of host memory ({'with' if baseline else 'without'} the "
            f"gather_object baseline), but only {format_size(have)} is available; pass a "
            "smaller --size" + ("" if not baseline else " or --no-baseline")
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


# -- progress --------------------------------------------------------------------------------


class ProgressBar:
    """``[#####.....] 1.20/2.00 GiB  0.85 GB/s`` on stderr, at most 10 updates a second."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.start = time.perf_counter()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        rate = done / max(now - self.start, 1e-9) / 1e9
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {self.label:<28} [{bar:<30}] {done / 2**30:6.2f}/"
                         f"{total / 2**30:.2f} GiB {rate:6.2f} GB/s")
        if done >= total:
            sys.stderr.write("\n")
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


@dataclass
class Result:
    workload: str
    method: str
    world: int
    size: int
    seconds: float
    gbps: float
    dst_peak_rss: int
    ratio: float | None = None  # baseline seconds / these seconds (ours only)


def _payload(size: int, rank: int) -> bytearray:
    import torch

    data = bytearray(size)
    torch.frombuffer(data, dtype=torch.uint8).random_(
        0, 256, generator=torch.Generator().manual_seed(rank))
    return data


def _warm_up(workload: str, method: str, dst: int, world: int) -> None:
    """One small call of the same kind first (connections, thread pools), for every method."""
    import torch.distributed as dist

    import distributed_ext as dx

    if method == "distributed_ext":
        if workload == "bytes":
            dx.gather_bytes(bytearray(2**20), dst)
        else:
            list(dx.gather_state_dicts(make_state(2**20), dst))
    else:
        dist.gather_object(bytes(2**20), [None] * world if dist.get_rank() == dst else None,
                           dst=dst)


def run_workloads(args: argparse.Namespace, rank: int, world: int) -> list[Result]:
    """Runs every workload and method on this rank (collective); dst returns the results.

    Each method first makes one small warm-up call, then ``args.repeat`` timed calls (median).
    """
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    dst = 0
    # A bar is for a person at a terminal; in a log it would be noise.
    show_progress = rank == dst and not args.quiet and sys.stderr.isatty()
    results: list[Result] = []
    for workload in args.workloads:
        methods = ["distributed_ext"] + ([] if args.no_baseline else ["torch baseline"])
        timings: dict[str, tuple[float, int]] = {}
        for method in methods:
            if workload == "bytes":
                data: Any = _payload(args.size, rank)
            else:
                data = make_state(args.size, seed=rank)
            moved = sum(t.numel() * t.element_size() for t in data.values()) \
                if isinstance(data, dict) else len(data)
            _warm_up(workload, method, dst, world)
            secs, peaks = [], []
            for rep in range(args.repeat):
                label = f"{workload} ({method}) {rep + 1}/{args.repeat}"
                bar = ProgressBar(label, show_progress)
                dist.barrier()
                with PeakRSS() as rss:
                    start = time.perf_counter()
                    if method == "distributed_ext":
                        if workload == "bytes":
                            out = dx.gather_bytes(data, dst, progress=bar)
                            ok = out is None or len(out[rank]) == len(data)
                        else:
                            got = [len(s) for s in dx.gather_state_dicts(data, dst,
                                                                          progress=bar)]
                            ok = rank != dst or got == [len(data)] * world
                    else:
                        if show_progress:
                            sys.stderr.write(f"  {label:<28} (torch: no progress to show)\r")
                            sys.stderr.flush()
                        holder = [None] * world if rank == dst else None
                        if workload == "bytes":
                            dist.gather_object(bytes(data), holder, dst=dst)
                            ok = holder is None or len(holder[rank]) == len(data)
                        else:
                            bio = io.BytesIO()
                            torch.save(data, bio)
                            dist.gather_object(bio.getvalue(), holder, dst=dst)
                            del bio
                            got = [len(torch.load(io.BytesIO(b), weights_only=True))
                                   for b in holder or []]
                            ok = rank != dst or got == [len(data)] * world
                        del holder
                    secs.append(time.perf_counter() - start)
                if not ok:
                    raise RuntimeError(f"{workload} ({method}): wrong result on rank {rank}")
                peaks.append(rss.added)
                out = got = None  # noqa: F841  free before the next repetition
            timings[method] = (statistics.median(secs), max(peaks))
            if show_progress:
                sys.stderr.write(" " * 100 + "\r")
            seconds, peak = timings[method]
            # GB/s counts what dst ends up holding: every rank's payload.
            results.append(Result(workload, method, world, moved, seconds,
                                  world * moved / seconds / 1e9, peak))
        if "torch baseline" in timings:
            results[-2].ratio = timings["torch baseline"][0] / timings["distributed_ext"][0]
    return results if rank == dst else []


# -- reporting -------------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    lines = ["| workload | world | size/rank | method | seconds | GB/s | dst peak RSS | "
             "vs baseline |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.ratio:
            ratio = f"{r.ratio:.1f}x faster" if r.ratio >= 1 else f"{1 / r.ratio:.1f}x slower"
        else:
            ratio = "1.0x" if "baseline" in r.method else "-"
        lines.append(f"| {r.workload} | {r.world} | {format_size(r.size)} | {r.method} | "
                     f"{r.seconds:.3f} | {r.gbps:.3f} | +{format_size(r.dst_peak_rss)} | "
                     f"{ratio} |")
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in results}, key=WORKLOADS.index)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for i, method in enumerate(("distributed_ext", "torch baseline")):
        values = [next((r.gbps for r in results if r.workload == w and r.method == method), 0)
                  for w in workloads]
        ax.bar([x + (i - 0.5) * width for x in range(len(workloads))], values, width,
               label=method)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("GB/s gathered on dst")
    world, size = results[0].world, results[0].size
    ax.set_title(f"gather to rank 0, world {world}, {format_size(size)} per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: list[Result], args: argparse.Namespace, where: str) -> None:
    print(f"\ndistributed-ext-bench, {where}, {datetime.date.today()}, torch "
          f"{__import__('torch').__version__}, median of {args.repeat}")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")


# -- local ranks -----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the spawner dies (no orphans, even on SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _local_rank(args: argparse.Namespace, rank: int, world: int, store: str, queue: Any) -> None:
    # Ctrl-C reaches the whole foreground process group; the spawner alone handles it and
    # stops the ranks, so a rank never dies half-way through a collective on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        results = run_workloads(args, rank, world)
        if rank == 0:
            queue.put(("ok", [asdict(r) for r in results]))
        dist.barrier()
    except BaseException as exc:
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def spawn_local(args: argparse.Namespace) -> int:
    check_memory(args.size, args.world, not args.no_baseline)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs: list[Any] = []
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with tempfile.TemporaryDirectory(prefix="dext-bench-") as tmp:
            for r in range(args.world):
                p = ctx.Process(target=_local_rank,
                                args=(args, r, args.world, os.path.join(tmp, "store"), queue))
                p.start()
                procs.append(p)
            print(f"distributed-ext-bench: {args.world} local ranks on gloo (pids "
                  f"{', '.join(str(p.pid) for p in procs)}), {format_size(args.size)} per rank",
                  flush=True)
            deadline = time.monotonic() + args.timeout
            outcome = None
            while outcome is None:
                if interrupted.is_set():
                    _stop(procs)
                    print("\ndistributed-ext-bench: interrupted; every local rank stopped",
                          file=sys.stderr)
                    return 130
                if time.monotonic() > deadline:
                    _stop(procs)
                    print(f"distributed-ext-bench: timed out after {args.timeout} s",
                          file=sys.stderr)
                    return 1
                try:
                    outcome = queue.get(timeout=0.2)
                except Exception:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        outcome = ("error", "a rank exited with code "
                                   + str([p.exitcode for p in procs]))
            for p in procs:
                p.join(30)
            _stop(procs)
    finally:
        signal.signal(signal.SIGINT, previous)
    kind, payload = outcome
    if kind != "ok":
        print(f"distributed-ext-bench: failed: {payload}", file=sys.stderr)
        return 1
    results = [Result(**r) for r in payload]
    report(results, args, f"{args.world} local ranks on gloo, {platform.node()} "
                          f"({os.cpu_count()} cores)")
    return 0


def run_launched(args: argparse.Namespace) -> int:
    """Under torchrun: NCCL on GPUs (via distributed_run), gloo on a CPU-only node."""
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    if torch.cuda.is_available():
        with dx.distributed_run() as state:
            results = run_workloads(args, state.rank, state.world_size)
            where = f"torchrun, {state.world_size} ranks, NCCL"
    else:
        dist.init_process_group("gloo")
        try:
            results = run_workloads(args, dist.get_rank(), dist.get_world_size())
            where = f"torchrun, {dist.get_world_size()} ranks, gloo"
            dist.barrier()  # tear down together
        finally:
            dist.destroy_process_group()
    if results:
        report(results, args, where)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from distributed_ext import runtime

    if runtime.is_distributed_launch():
        return run_launched(args)
    return spawn_local(args)


if __name__ == "__main__":
    sys.exit(main())
