"""Where a DTensor's local shard lies in its global tensor, from its global shape, mesh and
placements alone (the same on every rank, nothing exchanged): per tensor dim, the ranges of
global indices a mesh entry holds, in the order its local shard holds them.

Why ranges and not one box: under ``_StridedShard`` (FSDP2 over tensor parallelism, a
packed colwise ``gate_up_proj``, experts sharded by EP then FSDP) a local shard is a set of
whole index ranges of the global tensor, e.g. rows 0-1 and 4-5. Each combination of one
range per dim is a box (:class:`~plan.blocks.Block`) with its place in the local shard
(``Block.local``); the bytes then move by box as for any other layout, never redistributed.

The placements are applied left to right over the mesh dims, as ``distribute_tensor`` and
``full_tensor()`` read them: ``Shard(d)`` takes chunk ``p`` of ``k`` of what the dim holds so
far (``torch.chunk``: chunks of ``ceil(n / k)``, the last ones short or empty);
``_StridedShard(d, split_factor=f)`` first cuts what it holds into ``f`` chunks and takes
chunk ``p`` of ``k`` of each, in order. Pure arithmetic: unit-tested in one process against
torch's own ``_StridedShard._split_tensor`` / ``compute_local_shape_and_global_offset``, and
across ranks against ``full_tensor()``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

Ranges = tuple[tuple[int, int], ...]  # (start, stop) of global indices, in local order


def placement_code(key: str, p: Any) -> tuple:
    """A placement as plain data: ``("S", dim)``, ``("SS", dim, split_factor)`` or ``("R",)``;
    ValueError naming ``key`` for one the export cannot place exactly (``Partial``: its values
    are unreduced sums; a placement type it does not know)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # (a subclass of Shard in some torch versions)
        return ("SS", int(p.dim), int(p.split_factor))
    if type(p) is Shard:
        return ("S", int(p.dim))
    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, Partial):
        raise ValueError(
            f"state[{key!r}] is a DTensor with a Partial placement ({p}): its values are "
            "unreduced sums, which no checkpoint holds; reduce it first -- in a model, "
            "replace the parameter with its reduced value (module.<name> = nn.Parameter("
            "param.redistribute(placements=[Replicate()] * param.device_mesh.ndim))), in a "
            "state dict the entry with value.redistribute(placements=[Replicate()] * "
            "value.device_mesh.ndim)")
    raise ValueError(f"state[{key!r}] is a DTensor with placement {p!r}, which the export "
                     "does not know how to place; replace the entry with a DTensor of "
                     "Shard/_StridedShard/Replicate placements (value.redistribute(placements="
                     "[Replicate()] * value.device_mesh.ndim) always is one)")


def _chunk(n: int, k: int, p: int) -> tuple[int, int]:
    """Chunk ``p`` of ``k`` of ``n`` indices as ``torch.chunk`` cuts them (possibly empty)."""
    size = -(-n // k) if n else 0
    return min(p * size, n), min((p + 1) * size, n)


def _select(held: Ranges, picks: list[tuple[int, int]]) -> Ranges:
    """The global ranges of the local positions ``picks`` (ranges of positions in the order
    ``held`` lists its indices), adjacent ranges merged."""
    out: list[list[int]] = []
    for lo, hi in picks:
        at = 0
        for a, b in held:
            n = b - a
            s, e = max(lo, at), min(hi, at + n)
            if s < e:
                start, stop = a + s - at, a + e - at
                if out and out[-1][1] == start:
                    out[-1][1] = stop
                else:
                    out.append([start, stop])
            at += n
            if at >= hi:
                break
    return tuple((a, b) for a, b in out)


def held_ranges(shape: tuple[int, ...], mesh_shape: tuple[int, ...], codes: tuple[tuple, ...],
                position: list[int]) -> tuple[Ranges, ...]:
    """Per tensor dim, the global index ranges the mesh entry at ``position`` holds (one
    index along each mesh dim), in its local shard's order; an empty tuple where it holds
    none of that dim."""
    ranges: list[Ranges] = [((0, n),) if n else () for n in shape]
    for mesh_dim, code in enumerate(codes):
        if code[0] == "R":
            continue
        d, k, p = code[1], mesh_shape[mesh_dim], position[mesh_dim]
        n = sum(b - a for a, b in ranges[d])
        if code[0] == "S":
            picks = [_chunk(n, k, p)]
        else:  # ("SS", dim, split_factor): chunk p of each of the split_factor chunks
            picks = []
            for j in range(code[2]):
                a, b = _chunk(n, code[2], j)
                s, e = _chunk(b - a, k, p)
                picks.append((a + s, a + e))
        ranges[d] = _select(ranges[d], picks)
    return tuple(ranges)


def local_shape(ranges: tuple[Ranges, ...]) -> tuple[int, ...]:
    """The shape of the local shard that holds ``ranges``."""
    return tuple(sum(b - a for a, b in r) for r in ranges)


def boxes(ranges: tuple[Ranges, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...],
                                                      tuple[int, ...] | None]]:
    """The boxes of a local shard: ``(global offset, shape, offset in the local shard)``, one
    per combination of one range per dim, in the local shard's row-major order; the local
    offset is None where the shard is one box (it is then the box itself). A shard that
    holds nothing is one empty box."""
    if not ranges:  # a 0-d tensor
        return [((), (), None)]
    if any(not r for r in ranges):
        return [(tuple(r[0][0] if r else 0 for r in ranges), local_shape(ranges), None)]
    if all(len(r) == 1 for r in ranges):
        return [(tuple(r[0][0] for r in ranges), tuple(r[0][1] - r[0][0] for r in ranges),
                 None)]
    per_dim = []
    for r in ranges:
        at, items = 0, []
        for a, b in r:
            items.append((a, b - a, at))
            at += b - a
        per_dim.append(items)
    out: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]] = [((), (), ())]
    for items in per_dim:
        out = [(o + (a,), s + (n,), lo + (at,)) for o, s, lo in out for a, n, at in items]
    return out


def mesh_positions(mesh_ranks: tuple[int, ...], mesh_shape: tuple[int, ...]
                   ) -> list[tuple[list[int], list[int]]]:
    """Per mesh entry (in the mesh's row-major order): its coordinate, and its position
    along each mesh dim as torch's collectives see it -- its rank in the process group of
    that dim, whose members are the dim's slice of the mesh in ascending global rank (the
    order ``new_group`` keeps). The two differ only where a mesh's ranks are not ascending
    along a dim (``DeviceMesh("cpu", [1, 0])``); ``full_tensor()`` (and
    ``distribute_tensor``) then place a shard by its position, so the export does too."""
    coords = []
    for i in range(len(mesh_ranks)):
        coord, rest = [], i
        for n in reversed(mesh_shape):
            rest, c = divmod(rest, n)
            coord.append(c)
        coords.append(list(reversed(coord)))
    strides = [math.prod(mesh_shape[d + 1:]) for d in range(len(mesh_shape))]
    out = []
    for i, coord in enumerate(coords):
        position = []
        for d, n in enumerate(mesh_shape):
            base = i - coord[d] * strides[d]
            line = [mesh_ranks[base + k * strides[d]] for k in range(n)]
            position.append(sorted(line).index(mesh_ranks[i]))
        out.append((coord, position))
    return out


@functools.lru_cache(maxsize=4096)
def mesh_boxes(shape: tuple[int, ...], codes: tuple[tuple, ...], mesh_ranks: tuple[int, ...],
               mesh_shape: tuple[int, ...]) -> dict[int, tuple[tuple[int, ...], list]]:
    """Every mesh rank's local shape and boxes (:func:`boxes`): global rank -> (local shape,
    boxes), placed by each rank's position along the mesh dims (:func:`mesh_positions`), as
    ``full_tensor()`` places it. Read-only (cached per signature)."""
    out = {}
    for g, (_coord, position) in zip(mesh_ranks, mesh_positions(mesh_ranks, mesh_shape)):
        ranges = held_ranges(shape, mesh_shape, codes, position)
        out[g] = (local_shape(ranges), boxes(ranges))
    return out


def check_mesh_order(key: str, shape: tuple[int, ...], codes: tuple[tuple, ...],
                     mesh_ranks: tuple[int, ...], mesh_shape: tuple[int, ...]) -> None:
    """ValueError where a mesh's ranks are not ascending along a dim AND its shards are
    uneven there: torch itself then sizes a shard by its coordinate but gathers it by its
    group rank, so ``full_tensor()`` mixes rows up -- there is no right answer to write."""
    for coord, position in mesh_positions(mesh_ranks, mesh_shape):
        if coord != position and local_shape(held_ranges(shape, mesh_shape, codes, coord)) \
                != local_shape(held_ranges(shape, mesh_shape, codes, position)):
            raise ValueError(
                f"state[{key!r}] is a DTensor of shape {list(shape)} sharded unevenly "
                f"({show_codes(codes)}) on a mesh whose ranks are not ascending "
                f"({list(mesh_ranks)}, shape {list(mesh_shape)}): torch sizes its shards by "
                "mesh coordinate but gathers them in group-rank order, so even its own "
                "full_tensor() is wrong here; build the DeviceMesh with ascending ranks, or "
                "pad the dim to a multiple of the mesh dim's size")


def show_codes(codes: tuple[tuple, ...]) -> str:
    """Placement codes as torch prints them: ``[_StridedShard(dim=0, sf=2), Shard(dim=0)]``."""
    names = []
    for c in codes:
        if c[0] == "S":
            names.append(f"Shard(dim={c[1]})")
        elif c[0] == "SS":
            names.append(f"_StridedShard(dim={c[1]}, sf={c[2]})")
        else:
            names.append("Replicate()")
    return "[" + ", ".join(names) + "]"
