"""convert_dcp_to_hf against the routes people take from a DCP checkpoint to a Hugging Face
one, and against the disk.

A Llama-shaped fp32 model of ``--size`` (FSDP2 over world 2, the bench's own
``build_export_model``) is saved twice, untimed: by ``dcp.save`` with its default
``FileSystemWriter`` and by ``HuggingFaceStorageWriter`` unconsolidated. Then, each route in
fresh processes, the saved files evicted from the page cache first (``posix_fadvise``
DONTNEED: "cold") and its output removed after each call:

- ours: ``convert_dcp_to_hf`` at ``--world``, first call (cold), then ``--repeat`` warm calls
  (the saved files cached by the calls before);
- (a) ``dcp_to_torch_save`` + ``torch.load`` + ``save_pretrained`` in one process, what
  torchtitan's and trainers' conversion scripts do;
- (b) torch's ``consolidate_safetensors_files`` (2 threads) on the HF-writer save, and
  ``consolidate_safetensors_files_on_every_rank`` at ``--world`` (one output file a rank:
  its best case), each followed by an fsync of its files (ours returns with its checkpoint
  durable; torch's consolidation leaves its bytes in the page cache);
- (c) the disk: the saved bytes read and written again with O_DIRECT by one process.

Every route's process imports torch's DCP, transformers and safetensors before its timer.
Each call's peak RSS growth (``VmHWM``) per rank is printed beside its seconds, and ours'
CPU-seconds a GB. Checkpoints go under $DEXT_BENCH_DIR (default: the temp dir).

Usage: python benchmarks/bench_convert.py [--size 2GiB] [--world 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time

from distributed_ext._spawn import run_local
from distributed_ext.bench.resources import PeakRSS

GiB = 2**30


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _evict(directory: str) -> None:
    """The files under ``directory`` out of the page cache (their clean pages)."""
    for folder, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _save(size: int, base: str, hf: bool = True) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from distributed_ext.bench.export import build_export_model

    model = build_export_model(size)
    sd = get_model_state_dict(model)
    dcp.save(sd, checkpoint_id=os.path.join(base, "dcp"))
    if hf:  # (for torch's consolidation only)
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
            os.path.join(base, "hf"), save_distributed=True, enable_consolidation=False))
    if dist.get_rank() == 0:
        model.config.save_pretrained(os.path.join(base, "config"))


def _timed(call) -> tuple[float, int, float]:
    """(seconds, peak RSS growth, CPU-seconds) of ``call()`` in this process, the libraries
    every route uses (torch's DCP, transformers, safetensors) imported before: a trainer's
    process has them, and their import (~6 s and ~200 MiB for transformers here) is no
    route's work."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    before = _cpu()
    with PeakRSS() as rss:
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    return seconds, rss.added, _cpu() - before


def _ours(base: str, out: str, repeat: int) -> list[tuple[float, int, float]]:
    import torch.distributed as dist

    import distributed_ext as dx

    rows = []
    for _ in range(1 + repeat):
        dist.barrier()
        rows.append(_timed(lambda: dx.convert_dcp_to_hf(
            os.path.join(base, "dcp"), out, os.path.join(base, "config"))))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(out)
        dist.barrier()
    return rows


def _torch_save_route(base: str, out: str) -> tuple[float, int, float]:
    def run() -> None:
        import torch
        import transformers
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        pt = out + ".pt"
        dcp_to_torch_save(os.path.join(base, "dcp"), pt)
        state = torch.load(pt, weights_only=True)
        config = transformers.AutoConfig.from_pretrained(os.path.join(base, "config"))
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(state, assign=True)
        model.save_pretrained(out)
        os.remove(pt)

    return _timed(run)


def _fsynced(call, out: str):
    """``call``, then its output made durable (as ours returns: published, fsynced)."""
    def run() -> None:
        call()
        _evict(out)  # (fsyncs each file first)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    return run


def _consolidate(base: str, out: str) -> tuple[float, int, float]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    os.makedirs(out, exist_ok=True)  # (it writes into an existing directory)
    return _timed(_fsynced(lambda: consolidate_safetensors_files(
        os.path.join(base, "hf"), out, _mapping(base, 1), num_threads=2), out))


def _consolidate_every_rank(base: str, out: str, world: int) -> tuple[float, int, float]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    os.makedirs(out, exist_ok=True)
    return _timed(_fsynced(lambda: consolidate_safetensors_files_on_every_rank(
        os.path.join(base, "hf"), out, _mapping(base, world)), out))


def _mapping(base: str, files: int) -> dict[str, int]:
    """The keys over ``files`` output files of about equal bytes, in the saved order (what
    the consolidation asks to be told; on every rank, one file a rank: its best case)."""
    import json
    import math
    import struct

    sizes: dict[str, int] = {}
    folder = os.path.join(base, "hf")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                for k, v in json.loads(f.read(n)).items():
                    if k != "__metadata__":
                        sizes[k] = sizes.get(k, 0) + math.prod(v["shape"])
    total, at, out = sum(sizes.values()) or 1, 0, {}
    for k, n in sizes.items():
        out[k] = 1 + min(files - 1, (at + n // 2) * files // total)
        at += n
    return out


def _disk(base: str, out: str) -> tuple[float, int, float]:
    """The saved bytes read and written again, O_DIRECT both ways where the disk takes it."""
    from distributed_ext import _direct_io

    def run() -> None:
        block = _direct_io.huge_empty(16 * 2**20)
        folder = os.path.join(base, "dcp")
        os.makedirs(out)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".distcp"):
                continue
            size = os.path.getsize(os.path.join(folder, name))
            src = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            dst = _direct_io.DirectFile(os.path.join(out, name), size)
            try:
                for at in range(0, size, block.numel()):
                    n = os.preadv(src, [memoryview(block.numpy())], at)
                    dst.write(at, block[:n])
                dst.sync()
            finally:
                os.close(src)
                dst.close()

    return _timed(run)


def main(argv: list[str] | None = None) -> int:
    from distributed_ext.bench.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only-ours", action="store_true", help="no baseline routes")
    ap.add_argument("--keep", metavar="DIR", help="save into DIR once and keep it there "
                    "(later runs with the same DIR reuse it)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    base = args.keep or tempfile.mkdtemp(prefix="dext-convert-",
                                         dir=os.environ.get("DEXT_BENCH_DIR"))
    out = os.path.join(base, "out")
    try:
        if not os.path.isdir(os.path.join(base, "config")):
            os.makedirs(base, exist_ok=True)
            for o in run_local(_save, args.world, size, base, not args.only_ours,
                               timeout=3600):
                assert o.ok, o.describe()
        saved = sum(os.path.getsize(os.path.join(base, "dcp", n))
                    for n in os.listdir(os.path.join(base, "dcp")))
        rows: dict[str, list] = {}

        def fresh(label: str, fn, world: int, *fn_args) -> None:
            _evict(base)
            outcomes = run_local(fn, world, *fn_args, timeout=3600)
            bad = [o for o in outcomes if not o.ok]
            assert not bad, bad[0].describe()
            rows[label] = [o.value for o in outcomes]
            shutil.rmtree(out, ignore_errors=True)

        fresh("ours", _ours, args.world, base, out, args.repeat)
        if not args.only_ours:
            _baselines(fresh, base, out, args.world)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    _report(rows, saved, args)
    return 0


def _baselines(fresh, base: str, out: str, world: int) -> None:
    fresh("(a) dcp_to_torch_save + torch.load + save_pretrained", _torch_save_route, 1, base, out)
    fresh("(b) consolidate_safetensors_files, 2 threads, + fsync", _consolidate, 1, base, out)
    fresh(f"(b) consolidate_safetensors_files_on_every_rank, world {world}, + fsync",
          _consolidate_every_rank, world, base, out, world)
    fresh("(c) the disk: read + write O_DIRECT", _disk, 1, base, out)


def _report(rows: dict, saved: int, args: argparse.Namespace) -> None:
    from distributed_ext.bench.resources import _filesystem
    from distributed_ext.bench.sizes import format_size

    where = _filesystem(os.environ.get("DEXT_BENCH_DIR") or tempfile.gettempdir())
    print(f"{format_size(saved)} saved (fp32 Llama-shaped, FSDP2 world {args.world}) and "
          f"converted on {where}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; saved files evicted before "
          "each route's first call; the baselines one call each")
    print("| route | first call, s (cold) | warm median, s (spread) | peak RSS growth a rank, "
          "MiB | ratio, first / warm |")
    print("|---|---|---|---|---|")
    ours = rows["ours"]
    first = max(r[0][0] for r in ours)
    warm = [max(r[i][0] for r in ours) for i in range(1, 1 + args.repeat)]
    wmed = statistics.median(warm) if warm else first
    rss = max(x[1] for r in ours for x in r) / 2**20
    spread = f" ({min(warm):.2f}-{max(warm):.2f})" if warm else ""
    print(f"| ours, world {args.world} | {first:.2f} | {wmed:.2f}{spread} | {rss:.0f} | 1x |")
    for label, values in rows.items():
        if label == "ours":
            continue
        seconds = max(v[0] for v in values)
        peak = max(v[1] for v in values) / 2**20
        print(f"| {label} | {seconds:.2f} | - | {peak:.0f} | {seconds / first:.2f}x / "
              f"{seconds / wmed:.2f}x |")
    cpu = [sum(r[i][2] for r in ours) / len(ours) / (saved / 1e9) for i in range(1 + args.repeat)]
    print(f"ours: {cpu[0]:.2f} CPU-s a GB a rank first, "
          f"{statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0]:.2f} warm")


if __name__ == "__main__":
    raise SystemExit(main())
