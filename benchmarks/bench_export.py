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

Usage: python benchmarks/bench_export.py [--sizes 1GiB 4GiB] [--world 2] [--repeat 2]
       python benchmarks/bench_export.py --many [--many-world 4] [--many-entries 5000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from distributed_ext import bench
from distributed_ext._spawn import run_local
from distributed_ext._timing import Timing
from distributed_ext.bench import format_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=bench.parse_size, nargs="+",
                    default=[bench.parse_size("1GiB"), bench.parse_size("4GiB")])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--many", action="store_true",
                    help="run the many-small-tensors scenario instead of the model sizes")
    ap.add_argument("--many-world", type=int, default=4)
    ap.add_argument("--many-entries", type=int, default=5000)
    ap.add_argument("--many-bytes", type=bench.parse_size, default=1024,
                    help="bytes per entry per rank (default 1KiB)")
    args = ap.parse_args(argv)
    if args.many:
        base = os.environ.get("DEXT_BENCH_DIR") or tempfile.gettempdir()
        load = os.getloadavg()  # the machine's load before our ranks add to it
        rows = measure_many(args.many_world, args.many_bytes, args.many_entries, 100,
                            args.repeat, base)
        print("\n".join(format_many(rows, args.many_world, args.many_bytes,
                                     args.many_entries, base, load)))
        return 0
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


# -- many small tensors ----------------------------------------------------------------------


def _filesystem(path: str) -> str:
    """The filesystem type of ``path`` (from /proc/mounts: the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (path == fields[1] or path.startswith(
                        fields[1].rstrip("/") + "/")) and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return f"{kind} at {best or '?'}"


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
        else:  # torch's route: every entry's full_tensor() (a collective), rank 0 saves
            from safetensors.torch import save_file

            full = {k: v.full_tensor() for k, v in state.items()}
            if rank == 0:
                os.makedirs(path, exist_ok=True)
                save_file(full, os.path.join(path, "model.safetensors"),
                          metadata={"format": "pt"})
            dist.barrier()

    def after(i: int, _value: None) -> None:
        if rank == 0:
            shutil.rmtree(f"{out}-{i}", ignore_errors=True)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    return asdict(timing) if rank == 0 else None


def measure_many(world: int, per_rank: int, many: int, few_factor: int, repeat: int,
                 base: str) -> list[tuple[str, int, Timing]]:
    """Every (route, entries) pair in fresh local ranks: ``many`` entries, and the same bytes
    in ``many // few_factor`` entries."""
    rows = []
    for entries, size in ((many, per_rank), (many // few_factor, per_rank * few_factor)):
        for route in ("distributed_ext", "torch full_tensor()+save_file"):
            outcomes = run_local(_many_rank, world, route, entries, size, base, repeat,
                                 timeout=3600, pg_timeout=3600)
            bad = [o for o in outcomes if not o.ok]
            if bad:
                raise RuntimeError(f"{route}, {entries} entries: " +
                                   "; ".join(o.describe() for o in bad))
            rows.append((route, entries, Timing(**outcomes[0].value)))
            print(f"  done: {entries} entries, {route}", file=sys.stderr, flush=True)
    return rows


def format_many(rows: list[tuple[str, int, Timing]], world: int, per_rank: int, many: int,
                base: str, load: tuple[float, float, float]) -> list[str]:
    lines = [f"many tensors: world {world} on gloo, Shard(0) fp32 DTensors, the same bytes "
             f"({format_size(many * per_rank * world)}) as {many} entries of "
             f"{format_size(per_rank)} per rank and as fewer, larger ones; writing to {base} "
             f"({_filesystem(base)}); load average (1/5/15 min) before the run: "
             f"{' '.join(f'{x:.2f}' for x in load)}",
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


if __name__ == "__main__":
    sys.exit(main())
