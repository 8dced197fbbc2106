"""Latency of all_reduce / broadcast_from against torch's *_object collectives (gloo, local ranks).

Each rank runs every call ``--iters`` times after a warm-up; the median per-call latency on
rank 0 is printed side by side with dist.all_gather_object / dist.broadcast_object_list of the
same value, and the ratio.

Usage: python benchmarks/bench_collectives.py [--world 2] [--iters 200]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


def _median_us(fn, iters: int) -> float:
    import torch.distributed as dist

    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _rank(rank: int, world: int, store: str, iters: int, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    import distributed_ext as dx

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    value = {"batch_size": 32 + rank, "host": f"node-{rank}", "free_gib": [70.5, 71.25]}

    def ours():
        dx.all_reduce("batch", lambda: value, lambda vs: vs)

    def theirs():
        out = [None] * world
        dist.all_gather_object(out, value)

    def ours_b():
        dx.broadcast_from("cfg", lambda: value)

    def theirs_b():
        box = [value]
        dist.broadcast_object_list(box, src=0)

    rows = [("all_reduce", _median_us(ours, iters)),
            ("dist.all_gather_object", _median_us(theirs, iters)),
            ("broadcast_from", _median_us(ours_b, iters)),
            ("dist.broadcast_object_list", _median_us(theirs_b, iters))]
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.world, f"{tmp}/s", args.iters, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join(60)
    print(f"world {args.world}, gloo, median of {args.iters} calls (microseconds per call)")
    print("| call | us | vs torch |")
    print("|---|---|---|")
    for i, (name, us) in enumerate(rows):
        base = rows[i - i % 2 + 1][1]
        print(f"| {name} | {us:.0f} | {us / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
