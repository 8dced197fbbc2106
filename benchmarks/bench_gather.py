"""Scenarios of gather_bytes against raw gloo send/recv and dist.gather_object (local ranks).

For each world size and size per rank, each method runs in fresh ranks (the machinery, table
and targets are distributed_ext.bench's: the first call, the warm median and spread, GB/s
as bytes dst receives from the other ranks per second). Usage:

    python benchmarks/bench_gather.py [--worlds 2 3] [--sizes 256MiB 1GiB] [--repeat 5]
        [--chunk-bytes 256MiB] [--skip-gather-object] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from distributed_ext import bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sizes", type=bench.parse_size, nargs="+",
                    default=[bench.parse_size("256MiB"), bench.parse_size("1GiB")])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=bench.parse_bytes, default=None)
    ap.add_argument("--skip-gather-object", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    methods = bench.resolve_methods("bytes", not args.skip_gather_object)
    results = []
    for world in args.worlds:
        for size in args.sizes:
            bench.check_memory(size, world, not args.skip_gather_object)
            for method in methods:
                results.append(bench.measure_fresh("bytes", method, world, size, args.repeat,
                                                   args.chunk_bytes))
                print(f"  done: world {world}, {bench.format_size(size)}, {method}",
                      file=sys.stderr, flush=True)
    print(bench.format_table(results))
    for line in bench.check_targets(results):
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": bench.environment(),
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
