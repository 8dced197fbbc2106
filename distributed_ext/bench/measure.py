"""The measuring loops in the ranks: each method's first call and warm calls, its result
checked, dst's figures returned (:func:`measure`; one method in fresh local ranks:
:func:`measure_fresh`); and the layout scenarios' routes, each timed in its own fresh ranks
(:func:`_time_routes` in the ranks, :func:`routes_in_fresh_ranks` around them)."""

from __future__ import annotations

import io
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from distributed_ext._spawn import run_local
from distributed_ext._timing import Timing, merge_launches, time_calls
from distributed_ext.bench.export import _export_call, build_export_model
from distributed_ext.bench.gather import _payload, make_state
from distributed_ext.bench.methods import Result
from distributed_ext.bench.progress import ProgressBar, Running
from distributed_ext.bench.resources import PeakRSS, RankIO, fsync_tree


def _call(workload: str, method: str, data: Any, rank: int, world: int, dst: int,
          bar: ProgressBar | None, chunk_bytes: int | None = None) -> bool:
    """One measured call of ``method`` on this rank; True if dst's result is right."""
    import torch
    import torch.distributed as dist

    import distributed_ext as dx

    if workload == "export":
        return _export_call(method, data, rank, dst)
    if method == "distributed_ext":
        if workload == "bytes":
            kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
            out = dx.gather_bytes(data, dst, progress=bar, **kw)
            return out is None or (len(out) == world and len(out[rank]) == len(data))
        got = [len(s) for s in dx.gather_state_dicts(data, dst, progress=bar,
                                                      chunk_bytes=chunk_bytes)]
        return rank != dst or got == [len(data)] * world
    if method == "raw gloo send/recv":
        if rank == dst:
            outs = [torch.empty(len(data), dtype=torch.uint8) for _ in range(world - 1)]
            works = [dist.irecv(o, src=r) for o, r in zip(outs, [r for r in range(world)
                                                                   if r != dst])]
            for w in works:
                w.wait()
        else:
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=dst)
        return True
    if method == "first-touch floor":
        from distributed_ext.gather import allocate_outputs

        if rank == dst:  # allocate dst's outputs fresh, as gather_bytes does, and write
            # every page once
            outs = allocate_outputs([len(data)] * world, rank)
            for o in outs:
                torch.frombuffer(o, dtype=torch.uint8).fill_(1)
        return True
    holder = [None] * world if rank == dst else None
    if workload == "bytes":
        dist.gather_object(bytes(data), holder, dst=dst)
        return holder is None or len(holder[rank]) == len(data)
    bio = io.BytesIO()
    torch.save(data, bio)
    dist.gather_object(bio.getvalue(), holder, dst=dst)
    del bio
    got = [len(torch.load(io.BytesIO(b), weights_only=True)) for b in holder or []]
    return rank != dst or got == [len(data)] * world


def measure(workload: str, method: str, size: int, repeat: int, show_progress: bool,
            fresh_ranks: bool = True, chunk_bytes: int | None = None,
            device: str = "cpu") -> dict | None:
    """Runs on every rank (collective): the first call, then ``repeat`` warm ones.

    ``device``: where the export workload's shards live ("cuda": GPU-resident).

    Returns dst's figures as a dict (a :class:`Result`'s fields); None on the other ranks.
    """
    import torch.distributed as dist

    rank, world, dst = dist.get_rank(), dist.get_world_size(), 0
    if workload == "export":
        # transformers' own "Writing model shards" bars would interleave with ours.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        data: Any = build_export_model(size, device)
        # A DTensor's numel is the full tensor's: this is the checkpoint's size, on every rank.
        checkpoint = sum(p.numel() * p.element_size() for p in data.parameters())
        moved = checkpoint // world  # a rank's share, for the table's size/rank column
    elif workload == "bytes":
        data = _payload(size, rank)
        moved = len(data)
    else:
        data = make_state(size, seed=rank)
        moved = sum(t.numel() * t.element_size() for t in data.values())
    show = show_progress and rank == dst
    peaks: list[int] = []
    checks: list[bool] = []
    rss: list[PeakRSS] = []

    moved_io: list[RankIO] = []

    def call(i: int) -> bool:
        label = f"{workload} ({method}) {'first' if i == 0 else f'{i}/{repeat}'}"
        with PeakRSS() as sampler, RankIO() as counted:
            rss.append(sampler)
            moved_io.append(counted)
            if method == "distributed_ext":
                ok = _call(workload, method, data, rank, world, dst, ProgressBar(label, show),
                           chunk_bytes)
            else:
                with Running(label, show):
                    ok = _call(workload, method, data, rank, world, dst, None)
        return ok

    def after(i: int, ok: bool) -> None:
        checks.append(ok)
        peaks.append(rss[-1].added)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    if not all(checks):
        raise RuntimeError(f"{workload} ({method}): a wrong result on rank {rank}")
    per_rank: list[dict] = []
    if workload == "export":  # every rank's own figures, to dst (as JSON: nothing unpickled)
        import distributed_ext as dx

        mine = {"rank": rank, "peak_rss": max(peaks), "written": moved_io[0].written,
                "sent": moved_io[0].sent}
        got = dx.gather_bytes(json.dumps(mine).encode(), dst)
        per_rank = [] if got is None else [json.loads(bytes(b)) for b in got]
    if rank != dst:
        return None
    # GB/s numerator: what dst receives from the others (the whole checkpoint for export).
    received = checkpoint if workload == "export" else (world - 1) * moved
    return asdict(Result(workload, method, world, moved, received, timing.first, timing.warm,
                         peaks, fresh_ranks, per_rank))


# -- running ---------------------------------------------------------------------------------


def _rank_measure(workload: str, method: str, size: int, repeat: int, show: bool,
                  chunk_bytes: int | None = None) -> dict | None:
    """Entry point of a local rank (importable by name for the spawner)."""
    return measure(workload, method, size, repeat, show, chunk_bytes=chunk_bytes)


def measure_fresh(workload: str, method: str, world: int, size: int, repeat: int,
                  chunk_bytes: int | None = None, timeout: float = 3600) -> Result:
    """One method in fresh local ranks (for the scenarios of benchmarks/); raises on failure."""
    return Result(**_dst_value(f"{workload} ({method})", _rank_measure, world, workload,
                               method, size, repeat, False, chunk_bytes, timeout=timeout))


def _dst_value(what: str, fn: Any, world: int, *args: Any, timeout: float = 3600) -> Any:
    """``fn(*args)`` in ``world`` fresh local ranks; what rank 0 returned. RuntimeError
    naming ``what`` and every rank that failed, if any did."""
    outcomes = run_local(fn, world, *args, timeout=timeout, pg_timeout=timeout)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"{what}: " + "; ".join(o.describe() for o in failed))
    return outcomes[0].value


def routes_in_fresh_ranks(label: str, routes: tuple[str, ...], rank_fn: Any, world: int,
                          *args: Any, launches: int = 1) -> list[tuple[str, Timing, list]]:
    """``rank_fn(route, *args)`` in ``world`` fresh local ranks for each route (a dict of
    :func:`_time_routes` on dst): (route, Timing, every rank's bytes written and sent).
    With ``launches`` > 1 the routes run that many rounds, each route once a round in fresh
    ranks (so that each round's routes meet the machine in about the same state), and each
    route's Timings are merged (:func:`~distributed_ext._timing.merge_launches`); every
    rank's figures are the largest of the launches (the bytes are the same in each; a
    peak, the highest)."""
    if isinstance(launches, bool) or not isinstance(launches, int) or launches < 1:
        raise ValueError(f"launches must be a positive int (fresh launches per route), "
                         f"got {launches!r}")
    timings: dict[str, list[Timing]] = {route: [] for route in routes}
    figures: dict[str, list] = {}
    for launch in range(launches):
        for route in routes:
            # What the route before left for the kernel to write back (a baseline that saves
            # through the page cache without fsync, as save_pretrained does) is written out
            # first, outside any timing: it would land on whichever route runs next.
            os.sync()
            value = _dst_value(route, rank_fn, world, route, *args)
            timing = Timing(**value["timing"])
            timings[route].append(timing)
            flushed = value.get("flushed")
            if flushed:  # (a route that returned before its bytes were on the disk)
                timings.setdefault(durable_route(route), []).append(Timing(
                    timing.first + flushed[0],
                    [w + f for w, f in zip(timing.warm, flushed[1:])]))
            io = [tuple(f) for f in value["io"]]
            got = figures.get(route)
            figures[route] = io if got is None else [
                tuple(max(a, b) for a, b in zip(x, y)) for x, y in zip(got, io)]
            at = f" (launch {launch + 1} of {launches})" if launches > 1 else ""
            print(f"  done: {label}, {route}{at}", file=sys.stderr, flush=True)
    return [(name, merge_launches(timings[name]), figures[route]) for route in routes
            for name in (route, durable_route(route)) if name in timings]


def durable_route(route: str) -> str:
    """The row of a baseline route that returns before its bytes are on the disk, timed
    until they are (its call, then :func:`~distributed_ext.bench.resources.fsync_tree` of
    what it wrote: ours returns once its bytes are durable)."""
    return f"{route}, then fsync of its files"


def _time_routes(route: str, model: Any, baseline: Any, out: str, repeat: int,
                 cached: bool = False) -> dict | None:
    """``model`` exported ``1 + repeat`` times by ``route`` (``writers=...``: ours; else
    ``baseline(path)``), into fresh directories ``out-<i>`` that dst removes; dst's Timing
    and every rank's bytes written and sent in the first call, on dst (None elsewhere).
    ``cached``: the baseline writes through the page cache and returns without ``fsync``;
    dst then times the ``fsync`` of its files after each call, outside the timing
    (``"flushed"``: :func:`durable_route`)."""
    import shutil
    from dataclasses import asdict

    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext._timing import time_calls

    rank, world = dist.get_rank(), dist.get_world_size()
    moved: list[RankIO] = []

    def call(i: int) -> None:
        path = f"{out}-{i}"
        with RankIO() as counted:
            if route.startswith("writers="):
                dx.export_hf_checkpoint(model, path, writers=route.split("=")[1])
            else:
                baseline(path)
        moved.append(counted)

    flushed: list[float] = []

    def after(i: int, _value: None) -> None:
        if rank == 0:
            if cached:
                flushed.append(fsync_tree(f"{out}-{i}"))
            shutil.rmtree(f"{out}-{i}", ignore_errors=True)

    timing = time_calls(call, repeat, sync=dist.barrier, after=after)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (moved[0].written, moved[0].sent))  # (our own counts)
    if rank != 0:
        return None
    return {"timing": asdict(timing), "io": every, **({"flushed": flushed} if cached else {})}
