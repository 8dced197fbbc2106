"""distributed-ext-bench: gather multi-GB shards, ours against torch's baseline, in one command.

Without a launcher it spawns ``--world`` local ranks on gloo (CPU), FRESH RANKS FOR EVERY
METHOD, so that each method's first call is what a job that exports once pays; under torchrun
it joins the launch (``distributed_run``: NCCL on GPUs, gloo on a CPU-only node), where the
methods share the launch's ranks. Rank 0 is dst; it shows progress while data moves and a
table at the end: per method, the first call, the warm median and spread (min-max) of
``--repeat`` more calls, GB/s and dst's peak RSS, and the ratios to the baselines.

GB/s, everywhere: bytes dst receives from the other ranks, per second of dst's wall time from
a barrier to the call's return.

Workloads (``--size`` per rank):
  bytes        gather_bytes vs raw gloo send/recv into fresh tensors (the transport's
               ceiling) vs dist.gather_object, and the first-touch floor of dst's outputs
  state-dict   gather_state_dicts of an LLM-shaped state (4096x4096 bf16 matrices and small
               tensors) vs torch.save + dist.gather_object + torch.load(weights_only=True)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

from distributed_ext._spawn import run_local
from distributed_ext.bench.export import _write_sequential
from distributed_ext.bench.measure import _rank_measure, measure
from distributed_ext.bench.methods import Result, resolve_methods
from distributed_ext.bench.report import conditions, load_results, report
from distributed_ext.bench.resources import (
    _run_directory,
    check_memory,
    estimate_peak_bytes,
    touch_machine_memory,
)
from distributed_ext.bench.sizes import WORKLOADS, format_size, parse_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="distributed-ext-bench",
        description="Gather multi-GB shards to one rank: distributed_ext against torch's "
        "baseline. Local ranks on gloo without a launcher; the launch's ranks under torchrun.",
    )
    ap.add_argument("--world", type=int, default=2,
                    help="local ranks to spawn without a launcher (default 2)")
    ap.add_argument("--size", type=parse_size, nargs="+", default=[parse_size("256MiB")],
                    help="bytes per rank, with units: 256MiB (default), 1GiB, ...; several "
                    "sizes run one after the other (e.g. --size 256MiB 64MiB)")
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all",
                    help="all = bytes and state-dict; export (an FSDP2 model to one Hugging "
                    "Face checkpoint, --size = the model's parameter bytes) runs when named")
    ap.add_argument("--repeat", type=int, default=5,
                    help="warm calls after the first, per method (default 5)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch baselines")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines (they are drawn only when stderr is a terminal)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the machine warm-up before the first rank starts (it writes the "
                    "memory the run will use once, and for export a file of the model's size "
                    "to the bench directory, removed at once: so that the VM's or the page "
                    "cache's first use is not billed to whichever method runs first)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw first-call and warm GB/s (matplotlib)")
    ap.add_argument("--from-json", metavar="PATH",
                    help="run nothing: print (and --plot) the figures of a saved --json")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds before local ranks are stopped (default 3600)")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world must be at least 2 (rank 0 gathers from the others), got "
                 f"{args.world}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        ap.error(f"--timeout must be a positive, finite number of seconds, got "
                 f"{args.timeout:g}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error(f"--plot needs matplotlib: {install_hint('plot', 'matplotlib')}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        # Checked before the run: a figure file that cannot be written loses the whole run.
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            ap.error(f"{flag} {path}: the directory {folder!r} does not exist or is not "
                     "writable; create it first or pass another path")
    if args.from_json:
        if not os.path.isfile(args.from_json):
            ap.error(f"--from-json {args.from_json}: no such file (write one with --json PATH)")
        return args
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not args.no_baseline and not args.from_json:
        try:
            import numpy  # noqa: F401
        except ImportError:
            ap.error("the torch baseline (dist.gather_object) needs numpy: "
                     f"{install_hint('bench', 'numpy')}, or pass --no-baseline")
    if args.workload == "export":
        missing = [m for m in ("transformers", "safetensors") if not _importable(m)]
        if missing:
            ap.error(f"--workload export needs {' and '.join(missing)}: "
                     f"{install_hint('export', ' '.join(missing))}")
        # Checked before any rank starts: the run directory is made there after the start.
        where = os.environ.get("DEXT_BENCH_DIR")
        if where and not (os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK)):
            why = ("is not a directory" if os.path.exists(where) else "does not exist")
            ap.error(f"DEXT_BENCH_DIR={where!r} {why} or cannot be written (the export "
                     "workload writes its checkpoints there); create it, point it at a "
                     "writable directory, or unset it for the system's temp dir")
    args.workloads = ["bytes", "state-dict"] if args.workload == "all" else [args.workload]
    args.sizes = list(args.size)
    return args


def install_hint(extra: str, packages: str) -> str:
    """How to install an extra, in the README's form (the package is installed from its
    checkout, not from an index)."""
    return (f"pip install --no-build-isolation -e '.[{extra}]' in the distributed_ext "
            f"checkout (or pip install {packages})")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def spawn_local(args: argparse.Namespace) -> int:
    args.conditions = conditions("export" in args.workloads)
    biggest = max(args.sizes)
    baseline = not args.no_baseline
    for workload in args.workloads:  # every workload refused up front, with the numbers
        check_memory(biggest, args.world, baseline, workload)
    with _run_directory("export" in args.workloads) as run_dir:
        return _spawn_in(args, biggest, baseline, run_dir)


def _spawn_in(args: argparse.Namespace, biggest: int, baseline: bool, run_dir: str | None) -> int:
    if not args.no_warm_up:
        need = max(estimate_peak_bytes(biggest, args.world, baseline, w) for w in args.workloads)
        print(f"distributed-ext-bench: warming the machine up first (--no-warm-up skips it): "
              f"writing {format_size(need)} of memory once"
              + (f", and a {format_size(biggest)} file to {run_dir} (removed at once)"
                 if run_dir else ""), flush=True)
        if run_dir is not None:  # the first write through the page cache, as for memory
            _write_sequential(os.path.join(run_dir, "warm-up"), biggest)
        touch_machine_memory(need)
    show = not args.quiet and sys.stderr.isatty()
    results: list[Result] = []
    env = {"DEXT_BENCH_RUN_DIR": run_dir} if run_dir else {}

    for size, workload in ((s, w) for s in args.sizes for w in args.workloads):
        def announce(pids: list[int], size: int = size, workload: str = workload) -> None:
            what = (f"a Llama-shaped model of about {format_size(size)}" if workload == "export"
                    else f"{format_size(size)} per rank")
            print(f"distributed-ext-bench: {args.world} local ranks on gloo (pids "
                  f"{', '.join(str(p) for p in pids)}), {what}", flush=True)

        for method in resolve_methods(workload, baseline):
            # Fresh ranks per method: its first call is a first call.
            outcomes = run_local(_rank_measure, args.world, workload, method, size,
                                 args.repeat, show, timeout=args.timeout,
                                 pg_timeout=args.timeout, capture_output=False,
                                 stop_on_sigint=True, on_start=announce, env=env)
            if any(o.interrupted for o in outcomes):
                print("\ndistributed-ext-bench: interrupted; every local rank stopped",
                      file=sys.stderr)
                return 130
            failed = [o for o in outcomes if not o.ok]
            if failed:
                print("distributed-ext-bench: failed: "
                      + "; ".join(o.describe() for o in failed), file=sys.stderr)
                return 1
            results.append(Result(**outcomes[0].value))
    report(results, args, f"{args.world} local ranks on gloo, fresh ranks per method, "
                          f"{platform.node()} ({os.cpu_count()} cores)")
    return 0


def run_launched(args: argparse.Namespace) -> int:
    """Under torchrun: NCCL on GPUs, gloo on a CPU-only node (both via distributed_run)."""
    import torch.distributed as dist

    import distributed_ext as dx

    args.conditions = conditions("export" in args.workloads)
    with dx.distributed_run() as state:
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        show = state.is_main and not args.quiet and sys.stderr.isatty()
        results = []
        for size, workload in ((s, w) for s in args.sizes for w in args.workloads):
            for method in resolve_methods(workload, not args.no_baseline, backend):
                row = measure(workload, method, size, args.repeat, show, fresh_ranks=False)
                if row is not None:
                    results.append(Result(**row))
        where = (f"torchrun, {state.world_size} ranks, {backend.upper() if backend == 'nccl' else backend}"
                 ", the methods share the launch's ranks (first calls after the first method's "
                 "are not fresh)")
        dist.barrier()  # tear down together
    if results:
        report(results, args, where)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        try:
            env, results = load_results(args.from_json)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"distributed-ext-bench: --from-json {args.from_json}: not a file written by "
                  f"--json ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        args.repeat = env.get("repeat", args.repeat)
        args.conditions = env.get("conditions")
        report(results, args, f"from {args.from_json} ({env.get('where', '?')}, "
                              f"{env.get('date', '?')})")
        return 0
    from distributed_ext import runtime

    try:
        if runtime.is_distributed_launch():
            return run_launched(args)
        return spawn_local(args)
    except KeyboardInterrupt:
        print("\ndistributed-ext-bench: interrupted; nothing was left behind", file=sys.stderr)
        return 130
