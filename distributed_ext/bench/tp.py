"""The TP layout: Shard(1) rows, writers="all" beside writers="dst" and torch's
full_tensor() route, with the bytes each rank wrote and sent; the route table the layout
scenarios share."""

from __future__ import annotations

import functools
import os

from distributed_ext._timing import Timing
from distributed_ext.bench.many import _save_full_tensors
from distributed_ext.bench.measure import _time_routes, durable_route, routes_in_fresh_ranks
from distributed_ext.bench.resources import _filesystem, _load_text
from distributed_ext.bench.sizes import format_size

TP_ROUTES = ("writers=all", "writers=dst", "torch full_tensor()+save_file")


def _tp_rank(route: str, size: int, run: int, base: str, repeat: int) -> dict | None:
    """In each fresh rank: a TP layout of ``size`` bytes -- 16 fp32 ``Shard(1)`` DTensors,
    each rank's part of a row ``run`` bytes -- exported ``1 + repeat`` times by ``route``;
    dst's Timing and every rank's bytes written and sent (the first call's) as a dict on
    dst, None elsewhere."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    cols = run // 4 * world
    rows = max(1, size // 16 // (cols * 4))
    state = {f"model.layers.{i}.w": distribute_tensor(torch.randn(rows, cols, generator=g),
                                                      mesh, [Shard(1)]) for i in range(16)}

    return _time_routes(route, state, functools.partial(_save_full_tensors, state),
                        os.path.join(base, f"dext-tp-{os.getppid()}"), repeat)


def measure_tp(world: int, size: int, run: int, repeat: int, base: str, launches: int = 1
               ) -> list[tuple[str, Timing, list]]:
    """Each route of :data:`TP_ROUTES` in fresh local ranks (:func:`_tp_rank`), ``launches``
    rounds of them."""
    return routes_in_fresh_ranks("TP layout", TP_ROUTES, _tp_rank, world, size, run, base,
                                 repeat, launches=launches)


def format_tp(rows: list[tuple[str, Timing, list]], world: int, size: int, run: int,
              base: str, load: tuple[float, float, float]) -> list[str]:
    lines = [f"TP layout: world {world} on gloo, 16 fp32 Shard(1) DTensors, "
             f"{format_size(size)} in all, each rank's part of a row {run} bytes; writing to "
             f"{base} ({_filesystem(base)}); {_load_text(load)}", *_route_table(rows)]
    get = {r: t for r, t, _io in rows}
    ours, one, torch_route = (get[r] for r in TP_ROUTES)
    for label, a, b in (("writers=dst / writers=all", one, ours),
                        ("torch's route / writers=all", torch_route, ours)):
        lines.append(f"  {label}: first call {a.first / b.first:.2f}x, "
                     f"warm {a.median / b.median:.2f}x")
    return lines


def _route_table(rows: list[tuple[str, Timing, list]]) -> list[str]:
    """One row per route: first call (over several fresh launches: their median, then each
    launch's), warm median and min-max, and each rank's MB written to files and sent in the
    first call (ours; the disk's rows: written; a baseline's are not known apart from its
    sockets' writes: "-")."""
    launches = max((len(t.firsts) for _r, t, _c in rows), default=0)
    first = "first call s" if launches < 2 else f"first call s: median (each of {launches} launches)"
    lines = [f"| route | {first} | warm median s | warm min-max s | "
             "per rank, first call: MB written to files / MB sent |",
             "|---|---|---|---|---|"]
    for route, t, counts in rows:
        ours, disk = route.startswith("writers="), route.startswith("disk")
        per_rank = ", ".join((f"{w / 1e6:.0f}" if ours or disk else "-") + "/"
                             + (f"{n / 1e6:.0f}" if ours else "-") for w, n in counts)
        each = f" ({', '.join(f'{f:.3f}' for f in t.firsts)})" if len(t.firsts) > 1 else ""
        lines.append(f"| {route} | {t.first:.3f}{each} | {t.median:.3f} | "
                     f"{t.low:.3f}-{t.high:.3f} | {per_rank} |")
    return lines


def _ratio_lines(checks: list[tuple[str, Timing, float]], ours: Timing) -> list[str]:
    """A verdict line per (label, baseline, target) and per first call / warm median:
    the baseline's seconds over ours against the target."""
    lines = []
    for label, base, target in checks:
        for when, a, b in (("first call", base.first, ours.first),
                           ("warm", base.median, ours.median)):
            ratio = a / b
            each = ""
            if when == "first call" and len(ours.firsts) > 1 and \
                    len(base.firsts) == len(ours.firsts):  # (each launch's, paired)
                each = "; each launch " + ", ".join(
                    f"{x / y:.2f}x" for x, y in zip(base.firsts, ours.firsts))
            lines.append(f"  {'met ' if ratio >= target else 'MISSED'} {label}, {when}: "
                         f"{ratio:.2f}x (target >= {target}x{each})")
    return lines


def _durable_lines(get: dict[str, Timing], label: str, route: str, ours: Timing) -> list[str]:
    """Beside a target judged against a baseline as it returns (with its bytes still in the
    page cache), the same baseline until its bytes are on the disk, as ours returns: a
    figure, not a target (:func:`~distributed_ext.bench.measure.durable_route`)."""
    durable = get.get(durable_route(route))
    if durable is None:
        return []
    return [f"  (no target) {label} until its files are on the disk (then fsync) / ours: "
            f"first call {durable.first / ours.first:.2f}x, warm "
            f"{durable.median / ours.median:.2f}x"]
