"""Scenarios of export_hf_checkpoint against torch's two Hugging Face routes and the disk.

For each model size (fp32 parameters of an FSDP2-wrapped Llama-shaped model built from a
config), each route runs in fresh local ranks on gloo -- ours, (b) get_model_state_dict(full,
cpu_offload) + save_pretrained on rank 0, (c) DCP save with HuggingFaceStorageWriter(
save_distributed, enable_consolidation) -- beside the disk's own write+fsync of the same bytes;
the machinery, table and target lines are distributed_ext.bench's. Checkpoints go under
$DEXT_BENCH_DIR (default: the temp dir) and are removed after each call.

Usage: python benchmarks/bench_export.py [--sizes 1GiB 4GiB] [--world 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys

from distributed_ext import bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=bench.parse_size, nargs="+",
                    default=[bench.parse_size("1GiB"), bench.parse_size("4GiB")])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    results = []
    for size in args.sizes:
        for method in bench.resolve_methods("export", True):
            results.append(bench.measure_fresh("export", method, args.world, size, args.repeat))
            print(f"  done: {bench.format_size(size)} model, {method}", file=sys.stderr,
                  flush=True)
    print(bench.format_table(results))
    for line in bench.check_targets(results):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
