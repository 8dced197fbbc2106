"""Scenarios of the state format and gather_state_dicts against torch.save/load and safetensors.

Part 1 (one process): encode + decode of a ~1 GiB LLM-shaped state (distributed_ext.bench's
``make_state``) through bytes: ours (a fresh buffer, and a reused one with
``write_state_into``), ``torch.save`` + ``torch.load(weights_only=True)``, and safetensors'
``save`` + ``load`` when installed. Part 2 (fresh local ranks on gloo): gather_state_dicts
against torch.save + gather_object + torch.load, through distributed_ext.bench's machinery.
Both report the first call beside the warm median and spread (distributed_ext._timing).

Usage: python benchmarks/bench_state_dicts.py [--size 1GiB] [--gather-size 512MiB]
    [--repeat 5] [--world 2] [--skip 1|2]
"""

from __future__ import annotations

import argparse
import gc
import io
import sys

from distributed_ext import bench
from distributed_ext._timing import time_calls


def part1(size: int, repeat: int) -> None:
    import torch

    from distributed_ext import serialization

    state = bench.make_state(size)
    n = sum(t.numel() * t.element_size() for t in state.values())
    buffer = bytearray(serialization.encode_state(state).nbytes)

    def ours(_i: int) -> None:
        assert serialization.decode_state(serialization.write_state(state)).keys() == state.keys()

    def ours_reused(_i: int) -> None:
        k = serialization.write_state_into(state, buffer)
        assert serialization.decode_state(memoryview(buffer)[:k]).keys() == state.keys()

    def torch_save_load(_i: int) -> None:
        bio = io.BytesIO()
        torch.save(state, bio)
        assert torch.load(io.BytesIO(bio.getbuffer()), weights_only=True).keys() == state.keys()

    rows = [("distributed_ext write_state+decode_state", ours),
            ("distributed_ext write_state_into (reused buffer)+decode_state", ours_reused),
            ("torch.save+torch.load(weights_only=True)", torch_save_load)]
    try:
        from safetensors.torch import load, save

        rows.append(("safetensors save+load (bytes)",
                     lambda _i: load(save(state)).keys() == state.keys()))
    except ImportError:
        print("  (safetensors is not installed: pip install safetensors to compare)")
    print(f"part 1: encode+decode of a {bench.format_size(n)} state ({len(state)} tensors), "
          f"first call, then the median (min-max) of {repeat}; GB/s of the state's bytes")
    timings = [(name, time_calls(fn, repeat, sync=gc.collect)) for name, fn in rows]
    ref = timings[0][1]
    for name, t in timings:
        vs = "" if name.startswith("distributed_ext") else (
            f"  ours is {t.first / ref.first:.1f}x / {t.median / ref.median:.1f}x faster "
            "(first / warm)")
        print(f"  {name:>62}: first {t.first:.3f} s, warm {t.median:.3f} s "
              f"({t.low:.3f}-{t.high:.3f}), {n / t.median / 1e9:.2f} GB/s{vs}", flush=True)


def part2(size: int, world: int, repeat: int) -> None:
    results = [bench.measure_fresh("state-dict", m, world, size, repeat)
               for m in bench.resolve_methods("state-dict", True)]
    print(f"\npart 2: gather_state_dicts of {bench.format_size(size)} per rank, world {world}")
    print(bench.format_table(results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=bench.parse_size, default=bench.parse_size("1GiB"))
    ap.add_argument("--gather-size", type=bench.parse_size, default=bench.parse_size("512MiB"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip", choices=["1", "2"], help="leave out part 1 or part 2")
    args = ap.parse_args(argv)
    env = bench.environment()
    print(f"# bench_state_dicts: {env['host']}, {env['cores']} cores, python {env['python']}, "
          f"torch {env['torch']}, {env['date']}\n", flush=True)
    if args.skip != "1":
        part1(args.size, args.repeat)
    if args.skip != "2":
        part2(args.gather_size, args.world, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
