"""GPU figures (run on a CUDA machine): the device pipeline and encoding a GPU-resident state.

Prints, side by side in one run:
  * pinned H2D and D2H copy rates of torch (the ceiling), 1 GiB;
  * the gather_bytes device pipeline as a component (host -> pinned -> device chunk -> pinned
    -> output, chunk by chunk, distributed_ext._device_pipeline.roundtrip_through_device);
  * encode_state of a GPU-resident state (4 GiB by default) into host segments, against the
    pinned D2H rate; and dist.gather_object at NCCL world 1 of the same bytes (baseline).

Usage: python benchmarks/bench_device.py [--size 4GiB] [--chunk-bytes 256MiB]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from distributed_ext._timing import time_calls
from distributed_ext.bench import parse_bytes, parse_size


def _rate(nbytes: int, fn, repeat: int = 3) -> float:
    """GB/s of the warm median of ``fn`` (the shared timing loop, CUDA-synchronized)."""
    import torch

    def call(_i: int) -> None:
        fn()
        torch.cuda.synchronize()

    return nbytes / time_calls(call, repeat, sync=torch.cuda.synchronize).median / 1e9


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from distributed_ext import serialization
    from distributed_ext._device_pipeline import roundtrip_through_device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("4GiB"))
    ap.add_argument("--chunk-bytes", type=parse_bytes, default=parse_size("256MiB"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_device: no CUDA device; run it on a GPU machine")
        return 2
    gib = 2**30
    bufs = {"host": torch.empty(gib, dtype=torch.uint8, pin_memory=True),
            "dev": torch.empty(gib, dtype=torch.uint8, device="cuda")}
    h2d = _rate(gib, lambda: bufs["dev"].copy_(bufs["host"], non_blocking=True))
    d2h = _rate(gib, lambda: bufs["host"].copy_(bufs["dev"], non_blocking=True))
    print(f"torch pinned copy, 1 GiB: H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    bufs.clear()

    data = os.urandom(gib)
    start = time.perf_counter()
    out = roundtrip_through_device(data, args.chunk_bytes)
    secs = time.perf_counter() - start
    assert bytes(out) == data
    print(f"device pipeline component (1 GiB, {args.chunk_bytes >> 20} MiB chunks): "
          f"{gib / secs / 1e9:.1f} GB/s end to end (both directions)")
    del out

    n = args.size // (4096 * 4096 * 2)
    state = {f"layers.{i}.w": torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
             for i in range(n)}
    state.update({f"layers.{i}.norm": torch.randn(4096, device="cuda") for i in range(300)})
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    for attempt in ("first call (pins its host buffer)", "second call"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        encoded = serialization.encode_state(state)
        secs = time.perf_counter() - start
        print(f"encode_state of a GPU-resident {nbytes / gib:.2f} GiB state, {attempt}: "
              f"{secs:.3f} s, {nbytes / secs / 1e9:.1f} GB/s (pinned D2H ceiling {d2h:.1f})")
        del encoded

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/s", rank=0, world_size=1)
        torch.cuda.set_device(0)
        payload = os.urandom(gib)
        holder = [None]
        start = time.perf_counter()
        dist.gather_object(payload, holder, dst=0)
        rate = gib / (time.perf_counter() - start) / 1e9
        print(f"dist.gather_object, NCCL world 1, 1 GiB: {rate:.2f} GB/s")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
