"""The README's headline table: each headline bench run quietly in fresh local ranks, ours
beside the usual route in the same run, printed as the README's Markdown table with the
machine, the date and the load named once above it.

Each row: what, ours first call / warm median (every call in fresh ranks first, then
``--repeat`` warm ones), the baseline's first / warm in the same run, the ratio (baseline /
ours), the filesystem written. Exports write under $DEXT_BENCH_DIR (default: the temp dir);
the MoE row writes to /dev/shm (the software's own cost) where it exists.

Below it, every route of each bench (ours, the baseline, and the bound: raw gloo send/recv for
the link, the disk's O_DIRECT write of the same bytes for an export), for RESULTS.md.

Usage: python benchmarks/headline.py [--repeat 3]   (about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from collections.abc import Callable

from distributed_ext import bench
from distributed_ext._timing import Timing
from distributed_ext.bench import fsdp_tp, quantized
from distributed_ext.bench.measure import routes_in_fresh_ranks
from distributed_ext.bench.resources import _filesystem

GiB, MiB = 2**30, 2**20


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def _cell(t: Timing) -> str:
    return f"{t.first:.3f} / {t.median:.3f} s"


def _ratio(base: Timing, ours: Timing) -> str:
    return f"{base.first / ours.first:.1f}x / {base.median / ours.median:.1f}x"


# A bench: (headline "what", the baseline's name, the filesystem, every route's Timing: ours
# first, the baseline second, then the bounds -- the link, the disk).
Bench = tuple[str, str, str, list[tuple[str, Timing]]]


def _fresh(workload: str, methods: list[str], repeat: int, size: int, world: int
           ) -> list[tuple[str, Timing]]:
    return [(m, bench.measure_fresh(workload, m, world, size, repeat).timing()) for m in methods]


def _gather(workload: str, what: str, repeat: int) -> Bench:
    """gather_bytes / gather_state_dicts, 256 MiB a rank, world 2 (no file written)."""
    bounds = ["raw gloo send/recv"] if workload == "bytes" else []
    name = {"bytes": "`dist.gather_object`",
            "state-dict": "`torch.save` + `gather_object` + `torch.load`"}[workload]
    return what, name, "(memory)", _fresh(
        workload, ["distributed_ext", bench.BASELINE[workload], *bounds], repeat, 256 * MiB, 2)


def _export(repeat: int, where: str) -> Bench:
    return ("export, FSDP2 Llama-shaped, 1 GiB fp32, world 2",
            "`get_model_state_dict` + `save_pretrained`", _filesystem(where),
            _fresh("export", ["distributed_ext", bench.BASELINE["export"], "disk O_DIRECT write"],
                   repeat, GiB, 2))


def _routes(what: str, label: str, rank_fn: Callable, world: int, baseline: str,
            base_name: str, where: str, *args: object) -> Bench:
    rows = routes_in_fresh_ranks(label, ("writers=all", baseline, "disk O_DIRECT write"),
                                 rank_fn, world, *args)
    return what, base_name, _filesystem(where), [(route, t) for route, t, _io in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="warm calls after the first (3)")
    ap.add_argument("--small", action="store_true",
                    help="every size /16 (a quick check that the benches run, not figures)")
    args = ap.parse_args(argv)
    global GiB, MiB
    if args.small:
        GiB, MiB = GiB // 16, MiB // 16
    where = bench.bench_dir()
    ram = "/dev/shm" if os.path.isdir("/dev/shm") else where
    load = os.getloadavg()
    repeat = args.repeat
    modelopt = "ModelOpt's route (full state to rank 0 + its `export_hf_checkpoint`)"
    jobs: list[Callable[[], Bench]] = [
        lambda: _gather("bytes", "`gather_bytes`, 256 MiB a rank, world 2", repeat),
        lambda: _gather("state-dict", "`gather_state_dicts`, 256 MiB a rank, world 2", repeat),
        lambda: _export(repeat, where),
        lambda: _routes("export, torch's 2-D recipe (FSDP x TP), 1 GiB fp32, world 4",
                            "FSDP x TP", fsdp_tp._fsdp_tp_rank, 4, fsdp_tp._HF_SAVE,
                            "transformers' save (`gather_full_state_dict` + `save_pretrained`)",
                            where, GiB, where, repeat),
        lambda: _routes("export, ModelOpt FP8, FSDP2 Llama, 1 GiB bf16, world 2",
                            "quantized fp8", quantized._quantized_rank, 2, quantized._MODELOPT,
                            modelopt, where, GiB, "fp8", where, repeat, 0),
        lambda: _routes("export, ModelOpt NVFP4, FSDP2 Llama, 1 GiB bf16, world 2",
                            "quantized nvfp4", quantized._quantized_rank, 2,
                            quantized._MODELOPT, modelopt, where, GiB, "nvfp4", where, repeat, 0),
        lambda: _routes("export, ModelOpt FP8, FSDP2 Qwen3-MoE (128 experts), 1 GiB bf16, "
                            "world 2", "quantized fp8 MoE", quantized._quantized_rank, 2,
                            quantized._MODELOPT, modelopt, ram, GiB, "fp8", ram, repeat, 128),
    ]
    benches = []
    for job in jobs:
        benches.append(job())
        print(f"  done: {benches[-1][0]}", file=sys.stderr, flush=True)
    today = datetime.date.today().isoformat()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    print(f"Measured {today} on {_cpu()}, {memory:.0f} GiB, torch "
          f"{bench.environment().get('torch', '?')}, gloo; load average before the run "
          f"{load[0]:.2f}. First call in fresh ranks / warm median of {repeat}; "
          "ratio = baseline / ours.\n")
    print("| what | ours first / warm | baseline | baseline first / warm | ratio first / warm "
          "| filesystem |")
    print("|---|---|---|---|---|---|")
    for what, name, fs, routes in benches:
        (_o, ours), (_b, base) = routes[0], routes[1]
        print(f"| {what} | {_cell(ours)} | {name} | {_cell(base)} | {_ratio(base, ours)} | "
              f"{fs} |")
    print("\nEvery route of each bench (first / warm median, min-max of the warm calls; "
          "the ratio of each to ours):")
    for what, _name, fs, routes in benches:
        ours = routes[0][1]
        print(f"\n{what} ({fs})\n")
        print("| route | first / warm (min-max) | route / ours, first / warm |")
        print("|---|---|---|")
        for route, t in routes:
            print(f"| {route} | {_cell(t)} ({t.low:.3f}-{t.high:.3f}) | {_ratio(t, ours)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
