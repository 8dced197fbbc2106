"""The report: the table, the target verdicts, the environment, JSON and the plot."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from dataclasses import asdict
from typing import Any

from distributed_ext.bench.export import _export_targets
from distributed_ext.bench.gather import _targets_at
from distributed_ext.bench.methods import _TORCH_METHODS, BASELINE, Result
from distributed_ext.bench.resources import _filesystem, _load_text, bench_dir
from distributed_ext.bench.sizes import format_size

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
