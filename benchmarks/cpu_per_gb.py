"""CPU-seconds a GB of our export: the CPU (user + system, ``getrusage``) each rank spends in
``export_hf_checkpoint`` per GB of parameters, for the headline's exports, first call and
warm -- the bound a 2-core machine puts on two ranks (their CPU-seconds cannot overlap more
than two cores allow).

Usage: python benchmarks/cpu_per_gb.py [--repeat 2]   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile

from distributed_ext._spawn import run_local

GiB = 2**30


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank(kind: str, size: int, base: str, repeat: int) -> list[float]:
    """This rank's CPU-seconds in each call (the first, then ``repeat`` warm)."""
    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext import bench

    if kind == "plain":
        model = bench.build_export_model(size)
    else:
        model = bench.build_quantized_model(size, kind)
    out = []
    for i in range(1 + repeat):
        dist.barrier()
        before = _cpu()
        dx.export_hf_checkpoint(model, os.path.join(base, f"{kind}-{i}"))
        out.append(_cpu() - before)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(base, f"{kind}-{i}"), ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="dext-cpu-", dir=os.environ.get("DEXT_BENCH_DIR"))
    try:
        print("| export (1 GiB of parameters, world 2) | CPU-s a GB a rank, first / warm | "
              "both ranks, first / warm |")
        print("|---|---|---|")
        for kind, label in (("plain", "FSDP2 Llama-shaped, fp32"), ("fp8", "ModelOpt FP8, bf16"),
                            ("nvfp4", "ModelOpt NVFP4, bf16")):
            results = run_local(_rank, 2, kind, GiB, base, args.repeat, timeout=1800,
                                env={"OMP_NUM_THREADS": "1"})
            bad = [r.describe() for r in results if not r.ok]
            if bad:
                raise SystemExit(f"cpu_per_gb: {kind} failed: {bad}")
            per = [r.value for r in results]
            first = [calls[0] for calls in per]
            warm = [sorted(calls[1:])[len(calls[1:]) // 2] for calls in per]
            print(f"| {label} | {max(first):.2f} / {max(warm):.2f} | {sum(first):.2f} / "
                  f"{sum(warm):.2f} |", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
