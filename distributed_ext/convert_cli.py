"""``distributed-ext convert DCP_DIR OUT_DIR --config PATH``: :func:`convert_dcp_to_hf` from
the command line, in ``--world`` fresh local ranks on gloo (one: this process), or in the
ranks of a torchrun launch (several nodes on a shared filesystem: each rank reads and
writes its share)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="distributed-ext",
        description="Checkpoint tools of distributed_ext.")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser(
        "convert", help="write a DCP checkpoint as a Hugging Face checkpoint, every rank "
        "writing its share")
    convert.add_argument("dcp_dir", help="the directory dcp.save wrote")
    convert.add_argument("out_dir", help="where the Hugging Face checkpoint is published")
    convert.add_argument("--config", required=True,
                         help="the directory of the model's config.json")
    convert.add_argument("--world", type=int, default=1,
                         help="local ranks to spawn (default 1; ignored under torchrun)")
    convert.add_argument("--dtype", choices=_DTYPES, default=None,
                         help="cast floating-point tensors (default: as saved)")
    convert.add_argument("--prefix", default="",
                         help="the model's keys' prefix in the checkpoint (e.g. model.)")
    convert.add_argument("--max-shard-size", default="5GB")
    convert.add_argument("--writers", choices=("auto", "all", "dst"), default="auto")
    convert.add_argument("--timeout", type=float, default=3600.0,
                         help="seconds before every local rank is stopped (default 3600)")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be at least 1, got {args.world}")
    for name in ("dcp_dir", "config"):
        if not os.path.isdir(getattr(args, name)):
            parser.error(f"{'--config' if name == 'config' else 'DCP_DIR'} "
                         f"{getattr(args, name)!r} is not a directory")
    return args


def _convert(args: dict[str, Any]) -> float:
    """One rank's call; returns its seconds."""
    import torch

    import distributed_ext as dx

    start = time.perf_counter()
    dx.convert_dcp_to_hf(args["dcp_dir"], args["out_dir"], args["config"],
                         prefix=args["prefix"],
                         dtype=None if args["dtype"] is None else getattr(torch, args["dtype"]),
                         max_shard_size=args["max_shard_size"], writers=args["writers"])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    call = {k: getattr(args, k) for k in ("dcp_dir", "out_dir", "config", "prefix", "dtype",
                                          "max_shard_size", "writers")}
    from distributed_ext import runtime

    show = True
    try:
        if runtime.is_distributed_launch():
            import distributed_ext as dx

            with dx.distributed_run() as state:
                seconds = _convert(call)
                where, show = f"torchrun, {state.world_size} ranks", state.is_main
        elif args.world == 1:
            seconds, where = _convert(call), "1 process"
        else:
            from distributed_ext._spawn import TRANSFORMERS_PRELOAD, run_local

            outcomes = run_local(_convert, args.world, call, timeout=args.timeout,
                                 pg_timeout=args.timeout, capture_output=False,
                                 stop_on_sigint=True, preload=TRANSFORMERS_PRELOAD)
            if any(o.interrupted for o in outcomes):
                print("\ndistributed-ext convert: interrupted; every local rank stopped, "
                      f"{args.out_dir} as it was", file=sys.stderr)
                return 130
            failed = [o for o in outcomes if not o.ok]
            if failed:
                print("distributed-ext convert: failed: " + failed[0].describe(),
                      file=sys.stderr)
                return 1
            seconds = max(o.value for o in outcomes)
            where = f"{args.world} local ranks on gloo"
    except (ValueError, RuntimeError, ImportError) as exc:
        print(f"distributed-ext convert: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ndistributed-ext convert: interrupted; {args.out_dir} as it was",
              file=sys.stderr)
        return 130
    if show:
        print(f"distributed-ext convert: {args.dcp_dir} -> {args.out_dir} in {seconds:.2f} s "
              f"({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
