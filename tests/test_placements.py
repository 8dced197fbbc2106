"""Where a DTensor's shard lies (``distributed_ext.export.plan.placements``), checked against torch.

In one process: every mesh entry's local shape and global index ranges against torch's own
``_split_tensor`` of each placement applied in turn (what ``distribute_tensor`` does) and
``compute_local_shape_and_global_offset``. On real gloo ranks: random placements
(``_StridedShard`` with any split factor, uneven and empty shards, size-1 mesh dims, 1-D to
3-D meshes, sub-meshes, a permuted mesh) built by ``distribute_tensor``, written by both
writers and gathered by ``gather_full_state``, each tensor compared with the tensor it was
built from and with torch's own ``full_tensor()``.
"""

from __future__ import annotations

import os
import random

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import distributed_ext as dx
from distributed_ext.export.plan import placements as P

MESHES = {2: [(2,), (2, 1), (1, 2), (1, 2, 1)],
          3: [(3,), (3, 1), (1, 3)],
          4: [(4,), (2, 2), (4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)]}


def _random_layout(rng: random.Random, mesh_shape: tuple[int, ...]):
    """A global shape (1-3 dims, sizes 0-13 or 12/24/48, which most meshes split evenly)
    and one placement per mesh dim: Replicate, Shard or _StridedShard (split factor 1-4,
    dividing the dim or not)."""
    shape = tuple(rng.choice([12, 24, 48]) if rng.random() < 0.5 else rng.randint(0, 13)
                  for _ in range(rng.randint(1, 3)))
    placements = []
    for _ in mesh_shape:
        kind, d = rng.random(), rng.randrange(len(shape))
        if kind < 0.25:
            placements.append(Replicate())
        elif kind < 0.55:
            placements.append(Shard(d))
        else:
            placements.append(_StridedShard(d, split_factor=rng.randint(1, 4)))
    return shape, placements


def _torch_local(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """The local shard torch's own splitting gives the entry at ``coord`` (placements in
    mesh-dim order, each split of what the previous ones left)."""
    local = full
    for p, k, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(local, k, with_padding=False)
        local = shards[c]
    return local


def _our_local(full: torch.Tensor, ranges) -> torch.Tensor:
    """The local shard ``held_ranges`` describes, cut from ``full``."""
    out = full
    for d, r in enumerate(ranges):
        idx = [i for a, b in r for i in range(a, b)]
        out = out.index_select(d, torch.tensor(idx, dtype=torch.long))
    return out


def test_every_mesh_entry_holds_what_torch_splits_for_it():
    rng = random.Random(0)
    checked = strided = 0
    for _ in range(1500):
        mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        shape, placements = _random_layout(rng, mesh_shape)
        codes = tuple(P.placement_code("w", p) for p in placements)
        full = torch.arange(max(1, torch.Size(shape).numel())).float()[
            :torch.Size(shape).numel()].reshape(shape)
        for i in range(torch.Size(mesh_shape).numel()):
            coord = list(torch.unravel_index(torch.tensor(i), mesh_shape))
            coord = [int(c) for c in coord]
            ranges = P.held_ranges(shape, mesh_shape, codes, coord)
            want = _torch_local(full, mesh_shape, placements, coord)
            got = _our_local(full, ranges)
            assert got.shape == want.shape and torch.equal(got, want), \
                (shape, mesh_shape, placements, coord, ranges)
            if not any(isinstance(p, _StridedShard) for p in placements):
                # torch's offset arithmetic covers Shard/Replicate (one box per shard)
                tshape, _ = _compute_local_shape_and_global_offset(
                    shape, mesh_shape, coord, placements)
                assert tuple(tshape) == P.local_shape(ranges)
            checked += 1
            strided += any(isinstance(p, _StridedShard) for p in placements)
    assert checked > 5000 and strided > 2000


def test_boxes_tile_the_local_shard_in_its_own_order():
    ranges = (((4, 6), (0, 2)), ((1, 3),))  # rows 4-5 then 0-1, cols 1-2
    got = P.boxes(ranges)
    assert got == [((4, 1), (2, 2), (0, 0)), ((0, 1), (2, 2), (2, 0))]
    assert P.boxes(((), ((0, 3),))) == [((0, 0), (0, 3), None)]  # holds no rows: one empty box


def test_a_partial_placement_is_refused_with_advice_that_works():
    from torch.distributed.tensor import Partial

    with pytest.raises(ValueError, match=r"state\['w'\] .*Partial.*redistribute\(placements="
                                         r"\[Replicate\(\)\] \* "):
        P.placement_code("w", Partial())


# -- on real ranks -------------------------------------------------------------------------------


def _case_layouts(seed: int, world: int, count: int):
    """The same random cases on every rank and in the test: key -> (mesh shape, global
    shape, placements, mesh ranks or None for the default)."""
    rng = random.Random(seed * 1000 + world)
    out = {}
    for i in range(count):
        mesh_shape = rng.choice(MESHES[world])
        shape, placements = _random_layout(rng, mesh_shape)
        out[f"t{i}"] = (mesh_shape, shape, placements)
    return out


def _full(key: str, shape) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32) + 1000 * int(key[1:])).reshape(shape)


def _even(value) -> bool:
    """Whether every mesh entry's shard has one shape, by torch's own splitting."""
    mesh_shape = tuple(value.device_mesh.shape)
    full = torch.empty(value.shape, dtype=torch.uint8)
    shapes = {tuple(_torch_local(full, mesh_shape, value.placements,
                                 [int(c) for c in torch.unravel_index(torch.tensor(i),
                                                                      mesh_shape)]).shape)
              for i in range(torch.Size(mesh_shape).numel())}
    return len(shapes) == 1


def _torch_inverts(value) -> bool:
    """Whether torch's ``full_tensor()`` inverts its own ``distribute_tensor()`` for this
    layout, so that it can serve as the reference: even shards (on some uneven
    ``_StridedShard`` layouts it raises on some ranks only, and the others hang), at most
    one ``_StridedShard`` per tensor dim (for two it permutes the dim), and each
    ``_StridedShard``'s split factor the product of the mesh sizes of the ``Shard``s on its
    dim after it, the form FSDP2 and EP build (for others it raises). The export is
    compared with ``distribute_tensor()``'s input for every layout."""
    mesh_shape, placements = tuple(value.device_mesh.shape), value.placements
    strided_dims = [p.dim for p in placements if isinstance(p, _StridedShard)]
    if not _even(value) or len(strided_dims) != len(set(strided_dims)):
        return False
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [k for q, k in zip(placements[i + 1:], mesh_shape[i + 1:])
                     if type(q) is Shard and q.dim == p.dim]
            if later and p.split_factor != torch.Size(later).numel():
                return False
    return True


def _random_export(base: str, seed: int, count: int):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    world = dist.get_world_size()
    state, fulls = {}, {}
    for key, (mesh_shape, shape, placements) in _case_layouts(seed, world, count).items():
        mesh = init_device_mesh("cpu", mesh_shape)
        # src_data_rank=None: each rank splits its own copy (torch scatters _StridedShard
        # only where it divides evenly)
        state[key] = distribute_tensor(_full(key, shape), mesh, placements, src_data_rank=None)
    # a DTensor on a sub-mesh: on each half of a 2 x k mesh, Shard(0) over its row
    if world % 2 == 0:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "fsdp"))
        state["norm"] = distribute_tensor(_full("t900", (7, 3)), mesh["fsdp"], [Shard(0)])
        # a mesh whose ranks are not ascending (even shards: torch's full_tensor is right)
        perm = DeviceMesh("cpu", list(reversed(range(world))))
        state["perm"] = distribute_tensor(_full("t901", (world * 2, 3)), perm,
                                          [_StridedShard(0, split_factor=2)])
    for key, value in state.items():
        if _torch_inverts(value):
            fulls[key] = value.full_tensor()
    for writers in ("all", "dst"):
        dx.export_hf_checkpoint(state, os.path.join(base, writers), writers=writers,
                                max_shard_size="2KB")
    got = dx.gather_full_state(state)
    return fulls if dist.get_rank() == 0 else None, got


@pytest.mark.parametrize("world, seed", [(2, 1), (3, 2), (4, 3), (4, 4)])
def test_random_placements_are_written_and_gathered_exactly(world, seed, tmp_path):
    count = 24
    values = assert_all_ok(run_ranks(_random_export, world, str(tmp_path), seed, count,
                                     timeout=240))
    fulls, gathered = values[0]
    assert all(v == (None, None) for v in values[1:])
    want = {key: _full(key, shape)
            for key, (_m, shape, _p) in _case_layouts(seed, world, count).items()}
    if world % 2 == 0:
        want["norm"], want["perm"] = _full("t900", (7, 3)), _full("t901", (world * 2, 3))
    strided = sum(any(isinstance(p, _StridedShard) for p in pl)
                  for _m, _s, pl in _case_layouts(seed, world, count).values())
    assert strided >= 6
    for writers in ("all", "dst"):
        written = {}
        for name in os.listdir(tmp_path / writers):
            if name.endswith(".safetensors"):
                written.update(safetensors_torch.load_file(str(tmp_path / writers / name)))
        assert sorted(written) == sorted(want), writers
        for key, value in want.items():
            assert torch.equal(written[key], value), (writers, key)
    for key, value in fulls.items():
        assert torch.equal(value, want[key]), ("full_tensor", key)
    assert len(fulls) >= len(want) // 4, sorted(fulls)
    assert sorted(gathered) == sorted(want)
    for key, value in want.items():
        assert torch.equal(gathered[key], value), ("gather_full_state", key)
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "all")  # 2KB shards


def _partial_then_advice(out: str):
    from harness import outcome
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (dist.get_rank() + 1)
    value = DTensor.from_local(local, mesh, [Partial(), Shard(0)])
    refused = outcome(lambda: dx.export_hf_checkpoint({"w": value}, out))
    # the advice, as the message gives it
    fixed = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
    dx.export_hf_checkpoint({"w": fixed}, out)
    return refused, fixed.full_tensor()


def test_a_partial_dtensor_is_refused_and_the_advice_given_works(tmp_path):
    values = assert_all_ok(run_ranks(_partial_then_advice, 4, str(tmp_path / "ckpt")))
    for refused, _full_value in values:
        assert refused[:2] == ("raised", "ValueError") and "Partial" in refused[2], refused
    written = safetensors_torch.load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    # the sum over the Partial mesh dim of each rank's rows: ranks (0, 2) and (1, 3)
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(written["w"], torch.cat([rows * (1 + 3), rows * (2 + 4)]))
    assert torch.equal(values[0][1], written["w"])
