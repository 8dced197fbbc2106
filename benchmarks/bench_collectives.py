"""Latency scenarios: all_reduce / broadcast_from against torch's *_object collectives.

Fresh local ranks (distributed_ext._spawn) on gloo; every call is timed with the shared loop
(distributed_ext._timing): the first call in fresh ranks, then the median and spread of
``--iters`` warm calls, on rank 0, side by side with dist.all_gather_object /
dist.broadcast_object_list of the same value.

Usage: python benchmarks/bench_collectives.py [--world 2] [--iters 200]
"""

from __future__ import annotations

import argparse
import sys

from distributed_ext._spawn import run_local
from distributed_ext._timing import time_calls


def _rank(iters: int) -> list[tuple[str, float, float, float, float]] | None:
    import torch.distributed as dist

    import distributed_ext as dx

    rank, world = dist.get_rank(), dist.get_world_size()
    value = {"batch_size": 32 + rank, "host": f"node-{rank}", "free_gib": [70.5, 71.25]}
    calls = {
        "all_reduce": lambda _i: dx.all_reduce("batch", lambda: value, lambda vs: vs),
        "dist.all_gather_object": lambda _i: dist.all_gather_object([None] * world, value),
        "broadcast_from": lambda _i: dx.broadcast_from("cfg", lambda: value),
        "dist.broadcast_object_list": lambda _i: dist.broadcast_object_list([value], src=0),
    }
    rows = []
    for name, call in calls.items():
        t = time_calls(call, iters, sync=dist.barrier)
        rows.append((name, t.first * 1e6, t.median * 1e6, t.low * 1e6, t.high * 1e6))
    return rows if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    outcomes = run_local(_rank, args.world, args.iters, timeout=600)
    if not all(o.ok for o in outcomes):
        print("; ".join(o.describe() for o in outcomes if not o.ok), file=sys.stderr)
        return 1
    rows = outcomes[0].value
    print(f"world {args.world}, gloo: the first call in fresh ranks, then the median (min-max) "
          f"of {args.iters} warm calls, microseconds per call on rank 0")
    print("| call | first us | warm median us | warm min-max us | warm vs torch |")
    print("|---|---|---|---|---|")
    for i, (name, first, median, low, high) in enumerate(rows):
        base = rows[i - i % 2 + 1][2]
        print(f"| {name} | {first:.0f} | {median:.0f} | {low:.0f}-{high:.0f} | "
              f"{median / base:.2f}x the time |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
