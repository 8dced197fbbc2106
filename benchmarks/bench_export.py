"""Scenarios of export_hf_checkpoint against torch's two Hugging Face routes and the disk.

For each model size (fp32 parameters of an FSDP2-wrapped Llama-shaped model built from a
config), each route runs in fresh local ranks on gloo -- ours, (b) get_model_state_dict(full,
cpu_offload) + save_pretrained on rank 0, (c) DCP save with HuggingFaceStorageWriter(
save_distributed, enable_consolidation) -- beside the disk's own write+fsync of the same bytes;
the machinery, table and target lines are distributed_ext.bench's. Checkpoints go under
$DEXT_BENCH_DIR (default: the temp dir) and are removed after each call.

The many-tensors scenario (``--many``): world 4, 5000 Shard(0) entries of 1 KiB per rank
against the same bytes in 50 entries, ours and torch's ``full_tensor()`` route (every entry
gathered, rank 0 saving with safetensors), each in fresh ranks; the filesystem and the load
average are printed beside the figures.

The TP scenario (``--tp``): 16 ``Shard(1)`` entries (each rank's part of a row
``--tp-run`` bytes: a ``Shard(1)``/TP layout's short runs), ``writers="all"`` beside
``writers="dst"`` and torch's ``full_tensor()`` route, each in fresh ranks, with the bytes
each rank wrote and sent.

The FSDP x TP scenario (``--fsdp-tp``): the Llama-shaped model under torch's own 2-D recipe
(``parallelize_module`` on a tp mesh dim of 2, ``fully_shard`` over dp = world / 2: colwise
weights ``(_StridedShard(0, 2), Shard(0))``), world 4 by default, ours (both writers) beside
transformers' own save of it (``gather_full_state_dict`` + ``save_pretrained`` on rank 0, what
``save_pretrained`` runs for a model sharded over dp) and the disk's O_DIRECT write of the
same bytes, by dst alone and by every rank its share; each in fresh ranks.

The quantized scenario (``--quantize fp8|nvfp4``): the Llama-shaped model in bf16, FSDP2
over world 2, quantized by ModelOpt's own ``mtq.quantize``, written by ours (both writers)
beside ModelOpt's own ``export_hf_checkpoint`` of it (its FSDP2 route: per-module unshard,
the full state gathered on rank 0, ``save_pretrained`` there) and the disk's O_DIRECT write of
the same bytes; each in fresh ranks, with every rank's peak RSS growth. With ``--moe E``:
a Qwen3-MoE of ``E`` experts a layer (hidden 1024, experts' intermediate 256) instead.

With ``--launches K`` (those three scenarios), each route's first call is taken in K fresh
launches, the routes taking turns round by round, and judged by the median; each launch's
first call and each launch's ratio (paired with the same round's) are printed beside it.

Usage: python benchmarks/bench_export.py [--sizes 1GiB 4GiB] [--world 2] [--repeat 2]
       python benchmarks/bench_export.py --many [--many-world 4] [--many-entries 5000]
       python benchmarks/bench_export.py --tp [--sizes 1GiB] [--world 2] [--tp-run 2KiB]
       python benchmarks/bench_export.py --fsdp-tp [--sizes 1GiB] [--world 4] [--launches 3]
       python benchmarks/bench_export.py --quantize fp8 [--sizes 1GiB] [--world 2] [--moe 128]
"""

from __future__ import annotations

import argparse
import os
import sys

from distributed_ext import bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=bench.parse_size, nargs="+",
                    default=[bench.parse_size("1GiB"), bench.parse_size("4GiB")])
    ap.add_argument("--world", type=int, default=None,
                    help="ranks (default 2; 4 with --fsdp-tp)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--many", action="store_true",
                    help="run the many-small-tensors scenario instead of the model sizes")
    ap.add_argument("--many-world", type=int, default=4)
    ap.add_argument("--many-entries", type=int, default=5000)
    ap.add_argument("--many-bytes", type=bench.parse_bytes, default=1024,
                    help="bytes per entry per rank (default 1KiB)")
    ap.add_argument("--tp", action="store_true",
                    help="run the TP-layout scenario (writers all, dst, torch) instead")
    ap.add_argument("--tp-run", type=bench.parse_bytes, default=2048,
                    help="bytes of each rank's part of a row (default 2KiB)")
    ap.add_argument("--fsdp-tp", action="store_true",
                    help="run the FSDP x TP scenario (torch's 2-D recipe; --world defaults "
                         "to 4) instead")
    ap.add_argument("--quantize", choices=("fp8", "nvfp4"), default=None,
                    help="run the quantized scenario (needs nvidia-modelopt) instead")
    ap.add_argument("--moe", type=int, default=0, metavar="EXPERTS",
                    help="with --quantize: a Qwen3-MoE of this many experts a layer instead "
                         "of the Llama")
    ap.add_argument("--launches", type=int, default=1, metavar="K",
                    help="with --quantize, --fsdp-tp or --tp: each route's first call in K "
                         "fresh launches, the routes taking turns (round by round), judged "
                         "by their median; each launch's figures shown (default 1)")
    args = ap.parse_args(argv)
    if args.launches < 1:
        ap.error(f"--launches {args.launches}: pass a positive count of fresh launches")
    if args.launches > 1 and not (args.quantize or args.fsdp_tp or args.tp):
        ap.error("--launches applies to --quantize, --fsdp-tp and --tp only")
    world = args.world or (4 if args.fsdp_tp else 2)
    if args.quantize:
        base = bench.bench_dir()
        load = os.getloadavg()
        for size in args.sizes:
            rows = bench.measure_quantized(world, size, args.quantize, args.repeat, base,
                                           args.moe, args.launches)
            print("\n".join(bench.format_quantized(rows, world, size, args.quantize, base,
                                                   load, args.moe)))
        return 0
    if args.fsdp_tp:
        base = bench.bench_dir()
        load = os.getloadavg()
        for size in args.sizes:
            rows = bench.measure_fsdp_tp(world, size, args.repeat, base, args.launches)
            print("\n".join(bench.format_fsdp_tp(rows, world, size, base, load)))
        return 0
    if args.tp:
        base = bench.bench_dir()
        load = os.getloadavg()
        for size in args.sizes:
            rows = bench.measure_tp(world, size, args.tp_run, args.repeat, base, args.launches)
            print("\n".join(bench.format_tp(rows, world, size, args.tp_run, base, load)))
        return 0
    if args.many:
        base = bench.bench_dir()
        load = os.getloadavg()  # the machine's load before our ranks add to it
        rows = bench.measure_many(args.many_world, args.many_bytes, args.many_entries, 100,
                            args.repeat, base)
        print("\n".join(bench.format_many(rows, args.many_world, args.many_bytes,
                                     args.many_entries, base, load)))
        return 0
    results = []
    for size in args.sizes:
        for method in bench.resolve_methods("export", True):
            results.append(bench.measure_fresh("export", method, world, size, args.repeat))
            print(f"  done: {bench.format_size(size)} model, {method}", file=sys.stderr,
                  flush=True)
    print(bench.format_table(results))
    for line in bench.check_targets(results):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
