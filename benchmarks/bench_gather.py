"""gather_bytes vs dist.gather_object vs raw gloo send/recv, local ranks on gloo (CPU).

Prints, in one run, for each world size and payload size per rank: seconds and GB/s of
``gather_bytes``, of ``dist.gather_object`` on the same payloads, and of raw gloo send/recv of
preallocated tensors into freshly allocated outputs (the transport's ceiling here), plus the
dst peak RSS each call adds (peak sampled during the call minus RSS before it), and the
ratios.

GB/s counts the bytes dst ends up holding from the other ranks (sum of their payloads) per
second of wall time on dst, from a barrier to the call's return. Each figure is the median of
``--repeat`` calls in the same fresh ranks after one warm-up call (full size for gather_bytes
and raw, 1 MiB for the slow gather_object).

Usage:
    python benchmarks/bench_gather.py [--worlds 2 3] [--sizes 256MiB 1GiB] [--repeat 3]
        [--chunk-bytes 256MiB] [--skip-gather-object] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

from distributed_ext.bench import format_size, parse_size


def _rank_main(method: str, rank: int, world: int, size: int, chunk: int, store: str,
               queue: mp.Queue, repeat: int = 1) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist


    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    payload = bytearray(size)
    if size:
        torch.frombuffer(payload, dtype=torch.uint8).random_(0, 256)
    dst = 0
    from distributed_ext.bench import PeakRSS

    # Warm up every method once (connections, thread pools, the allocator), at full size for
    # the fast ones; gather_object, seconds per call, gets a 1 MiB warm-up.
    warm = bytearray(2**20) if method == "gather_object" else payload
    _transfer(method, warm, rank, world, dst, chunk)
    times, peaks, ok = [], [], True
    for _ in range(repeat):
        dist.barrier()
        with PeakRSS() as rss:  # samples RSS every 5 ms during the call
            start = time.perf_counter()
            ok = _transfer(method, payload, rank, world, dst, chunk) and ok
            times.append(time.perf_counter() - start)
        peaks.append(rss.added)
    dist.barrier()
    queue.put((rank, statistics.median(times), max(peaks), ok))
    dist.destroy_process_group()


def _transfer(method: str, payload: bytearray, rank: int, world: int, dst: int,
              chunk: int) -> bool:
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    size = len(payload)
    if method == "gather_bytes":
        out = dx.gather_bytes(payload, dst, chunk_bytes=chunk)
        ok = out is None or all(len(o) == size for o in out)
        if out is not None:
            ok = ok and out[rank] == payload
    elif method == "gather_object":
        holder = [None] * world if rank == dst else None
        dist.gather_object(bytes(payload), holder, dst=dst)
        ok = holder is None or all(len(o) == size for o in holder)
    elif method == "raw":
        if rank == dst:
            outs = [torch.empty(size, dtype=torch.uint8) for _ in range(world - 1)]
            works = [dist.irecv(o, src=r) for r, o in zip(range(1, world), outs)]
            for w in works:
                w.wait()
        else:
            dist.send(torch.frombuffer(payload, dtype=torch.uint8), dst=dst)
        ok = True
    else:
        raise ValueError(method)
    return ok


def run_case(method: str, world: int, size: int, chunk: int, timeout: float = 1800,
             rank_main=None, repeat: int = 1) -> dict:
    """Runs ``rank_main(method, rank, world, size, chunk, store, queue, repeat)`` in fresh ranks.

    Each rank puts ``(rank, seconds, dst_peak_rss, ok)``; rank 0's figures are returned.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    target = rank_main or _rank_main
    with tempfile.TemporaryDirectory(prefix="dext-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(method, r, world, size, chunk, store, queue,
                                                        repeat))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{method} world={world} size={size}: a rank failed or "
                                       "timed out")
                try:
                    rank, seconds, peak, ok = queue.get(timeout=min(remaining, 1.0))
                except Exception:
                    continue
                results[rank] = (seconds, peak, ok)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    seconds, peak, ok = results[0]
    if not all(r[2] for r in results.values()):
        raise RuntimeError(f"{method}: wrong result")
    moved = (world - 1) * size
    return {"method": method, "world": world, "size": size, "seconds": seconds,
            "gbps": moved / seconds / 1e9, "dst_peak_rss": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=[parse_size("256MiB"),
                                                                    parse_size("1GiB")])
    ap.add_argument("--chunk-bytes", type=parse_size, default=parse_size("256MiB"))
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed calls per figure in the same ranks, after a warm-up; median")
    ap.add_argument("--skip-gather-object", action="store_true",
                    help="leave out the (slow) dist.gather_object baseline")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    methods = ["gather_bytes", "raw"] + ([] if args.skip_gather_object else ["gather_object"])
    rows = []
    print(f"# bench_gather: {platform.node()} {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {datetime.date.today()}\n", flush=True)
    for world in args.worlds:
        for size in args.sizes:
            figures = {}
            for method in methods:
                best = run_case(method, world, size, args.chunk_bytes, repeat=args.repeat)
                figures[method] = best
                print(f"  {method:>13}  world={world} size={format_size(size):>8}: "
                      f"{best['seconds']:8.3f} s {best['gbps']:7.3f} GB/s  dst peak RSS "
                      f"+{best['dst_peak_rss'] / 2**20:7.0f} MiB", flush=True)
            rows.append(figures)
    print()
    header = ("| world | size/rank | gather_bytes s | GB/s | raw gloo GB/s | vs raw | "
              "gather_object GB/s | vs gather_object | dst peak RSS ours / bound / "
              "gather_object (MiB) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for figures in rows:
        ours, raw = figures["gather_bytes"], figures["raw"]
        obj = figures.get("gather_object")
        world, size = ours["world"], ours["size"]
        bound = world * size + 3 * min(args.chunk_bytes, size) + 256 * 2**20
        print(f"| {world} | {format_size(size)} | {ours['seconds']:.3f} | {ours['gbps']:.3f} | "
              f"{raw['gbps']:.3f} | {ours['gbps'] / raw['gbps']:.2f}x | "
              + (f"{obj['gbps']:.3f} | {ours['gbps'] / obj['gbps']:.1f}x | " if obj else "- | - | ")
              + f"{ours['dst_peak_rss'] / 2**20:.0f} / {bound / 2**20:.0f} / "
              + (f"{obj['dst_peak_rss'] / 2**20:.0f} |" if obj else "- |"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([list(r.values()) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
