"""Who holds which in-memory tensor, and which block of it: every rank's description (the
metadata round) merged into one table, the same on every rank, checked against the
distribution plan the models record. What the plan (:mod:`plan.pieces`) is made from."""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass

from distributed_ext.export.plan.blocks import Block
from distributed_ext.export.plan.entries import Described, Signature, _dtensor_blocks
from distributed_ext.plan import DistributionPlan


@dataclass
class Holding:
    """How the ranks hold an in-memory key: its signature and each holder's block (one
    object may serve every key of a signature; ``key`` is then the first of them)."""

    key: str
    sig: Signature
    blocks: list[tuple[int, Block]]  # (group rank, block), in rank order


def merge_holdings(described: list[Described], ranks: list[int], dst_rank: int,
                   recorded: DistributionPlan | None) -> dict[str, Holding]:
    """Who holds which in-memory key, and which block of it (the same on every rank);
    ValueError if holders disagree on a key's dtype, shape or placements, a DTensor's mesh is
    not the group's ranks, or a plain tensor is held against the recorded plan."""
    world = len(described)
    if recorded is not None and recorded.world_size != world:
        raise ValueError(
            f"the model records {recorded} but the export's group has {world} rank(s): every "
            f"rank that holds a part of the model must take part (pass group=None, or a group "
            f"of the plan's {recorded.world_size} ranks)")
    first = described[dst_rank]
    # The common case: every rank holds the same keys with the same signatures (an FSDP2
    # model, a replicated state): one comparison per rank instead of one per key and rank.
    same = all(d.keys == first.keys and d.sig_ids == first.sig_ids
               and d.signatures == first.signatures for d in described)
    holders: dict[str, list[tuple[int, Signature]]] = {}
    if same:
        sigs = array.array("i")
        sigs.frombytes(first.sig_ids)
        table = first.signatures
        # One holding per signature, shared by its keys (checked once, with the first key).
        shared: dict[int, Holding] = {}
        out = {}
        for key, i in zip(first.keys, sigs):
            holding = shared.get(i)
            if holding is None:
                sig = table[i]
                holding = shared[i] = _holding(key, [(r, sig) for r in range(world)], sig,
                                               ranks, world, recorded)
            out[key] = holding
        return out
    for r in [dst_rank] + [r for r in range(world) if r != dst_rank]:
        d = described[r]
        sigs = array.array("i")
        sigs.frombytes(d.sig_ids)
        for key, i in zip(d.keys, sigs):
            holders.setdefault(key, []).append((r, d.signatures[i]))
    out = {}
    for key, held in holders.items():
        held.sort(key=lambda rs: rs[0])
        kinds = {s for _r, s in held}
        if len(kinds) > 1 and not _sub_meshes(kinds):
            listing = "; ".join(f"rank {ranks[r]}: {s.show()}" for r, s in held)
            raise ValueError(f"state[{key!r}] differs between ranks ({listing}); every rank "
                             "that holds a key must hold the same dtype, shape and placements "
                             "(a DTensor: on one mesh, or on disjoint meshes of one shape, "
                             "each holding all of it)")
        out[key] = _holding(key, held, held[0][1], ranks, world, recorded)
    return out


def _sub_meshes(kinds: set[Signature]) -> bool:
    """Whether the holders' signatures differ only by their mesh's ranks, on disjoint meshes
    each held by exactly its ranks (a norm on the 1-D ``fsdp`` mesh of a 2-D run: each TP
    rank's fsdp mesh holds a whole copy). Each mesh is then a replica of the tensor."""
    first = next(iter(kinds))
    if first.placements is None or any(
            (s.dtype, s.shape, s.placements, s.mesh_shape)
            != (first.dtype, first.shape, first.placements, first.mesh_shape) for s in kinds):
        return False
    seen: set[int] = set()
    for s in kinds:
        assert s.mesh_ranks is not None
        if seen & set(s.mesh_ranks):
            return False
        seen |= set(s.mesh_ranks)
    return True


def _holding(key: str, held: list[tuple[int, Signature]], sig: Signature, ranks: list[int],
             world: int, recorded: DistributionPlan | None) -> Holding:
    if sig.placements is None:
        if recorded is not None:
            allowed = sorted({world, recorded.edp})
            if len(held) not in allowed:
                raise ValueError(
                    f"state[{key!r}] is held by {len(held)} rank(s) "
                    f"({[ranks[r] for r, _s in held]}), but the model records {recorded}: "
                    f"a plain tensor is held by {' or '.join(map(str, allowed))} ranks "
                    "(every rank, or an expert shard's edp replicas); record the plan the "
                    "model was distributed with")
        whole = Block((0,) * len(sig.shape), sig.shape)
        return Holding(key, sig, [(r, whole) for r, _s in held])
    meshes = sorted({s for _r, s in held}, key=lambda s: s.mesh_ranks)
    mesh_ranks = sorted(g for s in meshes for g in _dtensor_blocks(s))
    if sorted(ranks[r] for r, _s in held) != mesh_ranks or any(
            ranks[r] not in s.mesh_ranks for r, s in held):
        raise ValueError(
            f"state[{key!r}] is a DTensor on a mesh of global ranks {mesh_ranks}, but "
            f"ranks {[ranks[r] for r, _s in held]} of the export's group (global ranks "
            f"{ranks}) hold it; export over the group its mesh spans")
    if len(meshes) == 1:
        return Holding(key, sig, _group_blocks(sig, tuple(ranks)))
    return Holding(key, sig, sorted((rb for s in meshes for rb in _group_blocks(s, tuple(ranks))),
                                    key=lambda rb: rb[0]))


@functools.lru_cache(maxsize=4096)
def _group_blocks(sig: Signature, ranks: tuple[int, ...]) -> list[tuple[int, Block]]:
    """A DTensor's blocks by group rank, in rank order (a ``_StridedShard`` shard: several
    per rank, each with its place in the shard): one list per signature, shared by every
    key of that signature (read-only)."""
    blocks = _dtensor_blocks(sig)
    group_rank = {g: r for r, g in enumerate(ranks)}
    return [(group_rank[g], Block(offset, shape, local))
            for g in sorted(blocks, key=group_rank.get)
            for offset, shape, local in blocks[g][1]]


def agree_plan(plans: list[tuple | None], ranks: list[int]) -> DistributionPlan | None:
    """The plan the ranks' models record (as tuples), the same on all; ValueError if not."""
    if len(set(plans)) > 1:
        listing = "; ".join(f"rank {g}: {DistributionPlan(*p) if p else 'none'}"
                            for g, p in zip(ranks, plans))
        raise ValueError(f"the ranks' models record different distribution plans ({listing}); "
                         "record one plan on every rank's model")
    return DistributionPlan(*plans[0]) if plans[0] is not None else None
