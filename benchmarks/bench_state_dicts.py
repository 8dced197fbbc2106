"""The state format and gather_state_dicts against torch.save/torch.load and safetensors.

Part 1 (one process): encode + decode of a ~1 GiB LLM-like state (4096x4096 bf16 matrices and
a few hundred small tensors) through bytes:
  ours:        write_state (encode, pack into one new bytearray) + decode_state (views),
               and write_state_into a reused buffer + decode_state
  torch:       torch.save to BytesIO + torch.load(weights_only=True)
  safetensors: safetensors.torch.save + load (bytes), when safetensors is installed
Part 2 (local ranks on gloo): gather_state_dicts at world 2 against the pattern it replaces,
torch.save to bytes + dist.gather_object + torch.load(weights_only=True) on dst; dst peak RSS.

Usage: python benchmarks/bench_state_dicts.py [--size 1GiB] [--gather-size 512MiB] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gather import run_case  # noqa: E402

from distributed_ext.bench import format_size, parse_size  # noqa: E402


def make_state(nbytes: int, seed: int = 0) -> dict:
    """~nbytes of an LLM-like state: 4096x4096 bf16 matrices plus ~300 small tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state: dict = {}
    small = 0
    for i in range(300):
        t = torch.randn(1024 if i % 3 else 4096, generator=g).to(
            torch.float32 if i % 2 else torch.bfloat16)
        state[f"model.layers.{i // 3}.norm{i % 3}.weight"] = t
        small += t.numel() * t.element_size()
    matrix = 4096 * 4096 * 2
    for i in range(max(1, (nbytes - small) // matrix)):
        w = torch.empty(4096, 4096, dtype=torch.bfloat16)
        w.view(torch.int16).random_(generator=g)
        state[f"model.layers.{i}.mlp.up_proj.weight"] = w
    return state


def state_nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def time_it(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part1(size: int, repeat: int) -> list[tuple[str, float]]:
    import torch

    from distributed_ext import serialization

    state = make_state(size)
    n = state_nbytes(state)
    print(f"part 1: encode+decode of a {n / 2**30:.2f} GiB state ({len(state)} tensors), "
          f"median of {repeat}", flush=True)

    def ours():
        out = serialization.decode_state(serialization.write_state(state))
        assert out.keys() == state.keys()

    def torch_save_load():
        bio = io.BytesIO()
        torch.save(state, bio)
        out = torch.load(io.BytesIO(bio.getbuffer()), weights_only=True)
        assert out.keys() == state.keys()

    buffer = bytearray(serialization.encode_state(state).nbytes)

    def ours_reused():
        n = serialization.write_state_into(state, buffer)
        out = serialization.decode_state(memoryview(buffer)[:n])
        assert out.keys() == state.keys()

    ours_reused()  # fault the reused buffer in once
    rows = [("distributed_ext write_state+decode_state", time_it(ours, repeat)),
            ("distributed_ext, reused buffer (write_state_into)", time_it(ours_reused, repeat)),
            ("torch.save+torch.load(weights_only=True)", time_it(torch_save_load, repeat))]
    try:
        from safetensors.torch import load, save

        def st_save_load():
            out = load(save(state))
            assert out.keys() == state.keys()

        rows.append(("safetensors save+load (bytes)", time_it(st_save_load, repeat)))
    except ImportError:
        print("  (safetensors is not installed: pip install safetensors to compare)")
    ours_s, reused_s = rows[0][1], rows[1][1]
    for name, secs in rows:
        ratio = "" if name.startswith("distributed_ext") else (
            f"  ours is {secs / ours_s:5.1f}x (fresh buffer) / {secs / reused_s:5.1f}x "
            "(reused buffer) faster")
        print(f"  {name:>50}: {secs:7.3f} s  {n / secs / 1e9:6.2f} GB/s{ratio}", flush=True)
    return rows


def _rank_main(method, rank, world, size, chunk, store, queue, repeat=1):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=20))
    from distributed_ext.bench import PeakRSS

    state = make_state(size, seed=rank)
    dist.barrier()
    rss = PeakRSS().__enter__()  # samples RSS every 5 ms until __exit__
    start = time.perf_counter()
    if method == "gather_state_dicts":
        got = [len(s) for s in dx.gather_state_dicts(state, 0, chunk_bytes=chunk)]
    else:
        bio = io.BytesIO()
        torch.save(state, bio)
        holder = [None] * world if rank == 0 else None
        dist.gather_object(bio.getvalue(), holder, dst=0)
        del bio
        got = [len(torch.load(io.BytesIO(b), weights_only=True)) for b in holder or []]
    seconds = time.perf_counter() - start
    rss.__exit__(None, None, None)
    peak = rss.added
    ok = rank != 0 or got == [len(state)] * world
    dist.barrier()
    queue.put((rank, seconds, peak, ok))
    dist.destroy_process_group()


def part2(size: int, chunk: int, world: int) -> None:
    print(f"\npart 2: gather of {format_size(size)} states per rank at world {world} (gloo)",
          flush=True)
    ours = run_case("gather_state_dicts", world, size, chunk, rank_main=_rank_main)
    base = run_case("torch.save+gather_object+torch.load", world, size, chunk,
                    rank_main=_rank_main)
    bound = world * size + 3 * chunk + 256 * 2**20
    print("| method | seconds | GB/s | ratio | dst peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for name, r in (("gather_state_dicts", ours), ("torch.save+gather_object+torch.load", base)):
        print(f"| {name} | {r['seconds']:.3f} | {r['gbps']:.3f} | "
              f"{base['seconds'] / r['seconds']:.1f}x | {r['dst_peak_rss'] / 2**20:.0f} |")
    print(f"dst peak RSS bound (gathered + 3 x chunk + 256 MiB): {bound / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--gather-size", type=parse_size, default=parse_size("512MiB"))
    ap.add_argument("--chunk-bytes", type=parse_size, default=parse_size("16MiB"),
                    help="gather_state_dicts' chunk (its gloo default: 16MiB)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip", choices=["1", "2"], help="leave out part 1 or part 2")
    args = ap.parse_args(argv)
    print(f"# bench_state_dicts: {platform.node()} {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {datetime.date.today()}\n", flush=True)
    if args.skip != "1":
        part1(args.size, args.repeat)
    if args.skip != "2":
        part2(args.gather_size, args.chunk_bytes, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
