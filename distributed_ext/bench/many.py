"""Many small tensors: 5000 Shard(0) entries against the same bytes in 50, ours and
torch's full_tensor() route, each in fresh ranks."""

from __future__ import annotations

import functools
import os

from distributed_ext._timing import Timing
from distributed_ext.bench.measure import _time_routes, routes_in_fresh_ranks
from distributed_ext.bench.resources import _filesystem, _load_text
from distributed_ext.bench.sizes import format_size


def _many_rank(route: str, entries: int, per_rank: int, base: str, repeat: int
               ) -> dict | None:
    """In each fresh rank: ``entries`` Shard(0) DTensors of ``per_rank`` bytes per rank (fp32),
    exported ``1 + repeat`` times by ``route``; as :func:`_time_routes`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": distribute_tensor(
        torch.randn(per_rank // 4 * world, generator=g), mesh, [Shard(0)])
        for i in range(entries)}
    # Ours with its default writers ("auto").
    return _time_routes("writers=auto" if route == "distributed_ext" else route, state,
                        functools.partial(_save_full_tensors, state),
                        os.path.join(base, f"dext-many-{os.getppid()}"), repeat)


def _save_full_tensors(state: dict, path: str) -> None:
    """torch's route for a state of DTensors: every entry's ``full_tensor()`` (a collective
    each), rank 0 saving them with safetensors; every rank returns once it has."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    full = {k: v.full_tensor() for k, v in state.items()}
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        save_file(full, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()


def measure_many(world: int, per_rank: int, many: int, few_factor: int, repeat: int,
                 base: str) -> list[tuple[str, int, Timing]]:
    """Every (route, entries) pair in fresh local ranks: ``many`` entries, and the same bytes
    in ``many // few_factor`` entries."""
    rows = []
    for entries, size in ((many, per_rank), (many // few_factor, per_rank * few_factor)):
        rows += [(route, entries, timing) for route, timing, _io in routes_in_fresh_ranks(
            f"{entries} entries", ("distributed_ext", "torch full_tensor()+save_file"),
            _many_rank, world, entries, size, base, repeat)]
    return rows


def format_many(rows: list[tuple[str, int, Timing]], world: int, per_rank: int, many: int,
                base: str, load: tuple[float, float, float]) -> list[str]:
    lines = [f"many tensors: world {world} on gloo, Shard(0) fp32 DTensors, the same bytes "
             f"({format_size(many * per_rank * world)}) as {many} entries of "
             f"{format_size(per_rank)} per rank and as fewer, larger ones; writing to {base} "
             f"({_filesystem(base)}); {_load_text(load)}",
             "| route | entries | first call s | warm median s | warm min-max s |",
             "|---|---|---|---|---|"]
    for route, entries, t in rows:
        lines.append(f"| {route} | {entries} | {t.first:.3f} | {t.median:.3f} | "
                     f"{t.low:.3f}-{t.high:.3f} |")
    get = {(r, e): t for r, e, t in rows}
    few = min(e for _r, e, _t in rows)
    ours_many, ours_few = get[("distributed_ext", many)], get[("distributed_ext", few)]
    torch_many = get[("torch full_tensor()+save_file", many)]
    for label, value, target, ok in (
            ("ours, many / few entries, first call", ours_many.first / ours_few.first,
             "<= 3x", ours_many.first / ours_few.first <= 3),
            ("ours, many / few entries, warm", ours_many.median / ours_few.median, "<= 3x",
             ours_many.median / ours_few.median <= 3),
            ("torch's route / ours at many entries, first call",
             torch_many.first / ours_many.first, ">= 10x",
             torch_many.first / ours_many.first >= 10),
            ("torch's route / ours at many entries, warm", torch_many.median / ours_many.median,
             ">= 10x", torch_many.median / ours_many.median >= 10)):
        lines.append(f"  {'met ' if ok else 'MISSED'} {label}: {value:.2f}x (target {target})")
    return lines
