"""The FP8 per-tensor rows of a quantized export, three ways, one thread, side by side:
ModelOpt's own arithmetic (``to_quantized_weight``: torch's division and cast), the
compiled core's table lookup (``map_through_table``, a ModelOpt-made table of every bfloat16
value) and its division (``fp8_divide``); the bytes of the last two compared with the first.

The rows are bfloat16 weights of ``--size`` (as an FSDP2 shard holds them), written into a
16 MiB buffer a message at a time, as an export's staging does. Each way reports its first
pass beside the warm median and spread (distributed_ext._timing). Needs nvidia-modelopt (the
[quantize] extra).

Usage: python benchmarks/bench_fp8_rows.py [--size 256MiB] [--repeat 5]
"""

from __future__ import annotations

import argparse

from distributed_ext._timing import time_calls
from distributed_ext.bench.sizes import format_size, parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB", help="bfloat16 bytes of rows")
    parser.add_argument("--repeat", type=int, default=5, help="warm passes after the first")
    args = parser.parse_args()
    import torch
    from modelopt.torch.export.quant_utils import to_quantized_weight

    from distributed_ext._native import fp8_divide, map_through_table

    torch.set_num_threads(1)  # (a rank's staging thread: one core)
    size = parse_size(args.size)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(size // 2 // 4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
    scale = rows.float().abs().amax() / 448.0  # (a 0-dim float32 scale, as ModelOpt's)
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = to_quantized_weight(values.reshape(256, 256), scale, "fp8")
    table = table.reshape(-1).view(torch.uint8).contiguous()
    out = torch.empty(16 * 2**20, dtype=torch.uint8)
    per = out.numel() // rows.shape[1]  # rows a message
    ref = to_quantized_weight(rows, scale, "fp8").view(torch.uint8).reshape(-1)

    def passes(fn):
        def run(_i: int) -> None:
            for a in range(0, rows.shape[0], per):
                fn(rows[a : a + per], out[: rows[a : a + per].numel()])
        return run

    ways = {
        "ModelOpt's to_quantized_weight": passes(
            lambda r, o: o.copy_(to_quantized_weight(r, scale, "fp8").view(torch.uint8)
                                 .reshape(-1))),
        "compiled table lookup": passes(lambda r, o: map_through_table(r, table, o)),
        "compiled division": passes(lambda r, o: fp8_divide(r, float(scale), True, table, o)),
    }
    same = {"compiled table lookup": torch.equal(map_through_table(rows, table).reshape(-1), ref),
            "compiled division": torch.equal(
                fp8_divide(rows, float(scale), True, table).reshape(-1), ref)}
    print(f"FP8 rows of {format_size(rows.numel() * 2)} bfloat16, one thread, into 16 MiB "
          "messages")
    timings = {name: time_calls(fn, args.repeat) for name, fn in ways.items()}
    base = timings["ModelOpt's to_quantized_weight"]
    for name, t in timings.items():
        rate = rows.numel() / t.median / 1e9
        print(f"  {name:32s} first {t.first:.3f} s, warm {t.median:.3f} s ({t.low:.3f}-"
              f"{t.high:.3f}): {rate:.2f} G values/s, {base.median / t.median:.2f}x ModelOpt's"
              + (f"; ModelOpt's bytes: {same[name]}" if name in same else ""))
    lookup, division = timings["compiled table lookup"], timings["compiled division"]
    print(f"  the division / the lookup: {lookup.median / division.median:.2f}x")


if __name__ == "__main__":
    main()
