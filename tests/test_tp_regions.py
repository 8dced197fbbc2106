"""A TP layout's short rows (``writers="all"``): each region written once by the holder of
most of it (plan/tp_regions.py), planned in one process at a simulated world of 1024 and
written on real gloo ranks, each rank writing and sending its share."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks
from hf_models import read_checkpoint

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export.plan import holdings as export_holdings

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")
from test_writers import (  # noqa: E402
    _blocks_written,
    _recording_writes,
    _zone_writer,
)


def _tp_entries(shape, mesh, placements, world, spread=True, keep=None, n=1,
                dtype="float32"):
    """Every rank's plan (``keep``: that rank's) of ``n`` tensors of ``shape`` (pieces, as
    ``writers='all'`` plans them), from the metadata alone."""
    import array

    from distributed_ext.export.plan import entries as export_entries
    from distributed_ext.export.plan import pieces as export_pieces

    sig = export_entries.Signature(dtype, shape, placements, tuple(range(world)), mesh)
    keys = ["w"] if n == 1 else [f"w{i}" for i in range(n)]
    described = [export_entries.Described(keys, (array.array("i", [0]) * n).tobytes(), [sig])]
    holdings = export_holdings.merge_holdings(described * world, list(range(world)), 0, None)
    plans = [export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=r,
                                        spread=spread)
             for r in (range(world) if keep is None else [keep])]
    return plans if keep is None else plans[0]


def _rows_held(entry, piece):
    """The file-independent byte intervals ``[a, b)`` of a 2-D block in its tensor, row by
    row, from the block's own offset and shape (not from the planner's runs)."""
    (r0, c0), (rows, cols) = piece.block.offset, piece.block.shape
    width = entry.shape[1] * 4
    return [((r0 + i) * width + c0 * 4, (r0 + i) * width + (c0 + cols) * 4)
            for i in range(rows)]


@pytest.mark.parametrize("base", [4096, 4096 * 3 + 300, 2**20 - 5000])
@pytest.mark.parametrize("shape, mesh, placements", [
    ((700, 1536), (3,), (("S", 1),)),  # TP 3: rows of 2 KiB, three ranks' in each 6 KiB
    ((1024, 1024), (2, 2), (("S", 0), ("S", 1))),  # FSDP x TP
    ((1200, 1000), (4,), (("S", 1),)),  # TP 4: rows of 1000 bytes, unaligned
])
def test_each_region_of_a_tp_tensor_is_written_once_by_the_holder_of_most_of_it(
        shape, mesh, placements, base):
    from distributed_ext.export.plan import tp_regions as export_zones

    world = math.prod(mesh)
    plans = _tp_entries(shape, mesh, placements, world)
    assert all(entries[0].zoned for entries in plans)
    bases = torch.tensor([base], dtype=torch.int64)
    zones = [export_zones.plan_zones(entries, bases, r, 0, 4096, 2**20)
             for r, entries in enumerate(plans)]

    def ident(segs):
        return [(p.rank, start, n) for _e, p, start, n in segs]

    # Both ends of every pair list the same segments in the same order (so they cut the
    # same messages); each rank sends only its own pieces' bytes.
    for r, o in itertools.permutations(range(world), 2):
        assert ident(zones[r].outgoing.get(o, [])) == ident(zones[o].incoming.get(r, [])), (r, o)
        assert all(p.rank == r for _e, p, _s, _n in zones[r].outgoing.get(o, []))
    # Every byte of every piece is written once: by whom, per 4 KiB block of the file.
    entry = plans[0][0]
    pieces = {p.rank: p for p in entry.pieces}
    writer_of: dict[int, int] = {}
    covered = {r: 0 for r in pieces}
    for me, z in enumerate(zones):
        for _e, p, start, n in z.kept + [s for segs in z.incoming.values() for s in segs]:
            covered[p.rank] += n
            pos = 0  # the piece's bytes [start, start + n), row by row, to file offsets
            for a, b in _rows_held(entry, pieces[p.rank]):
                lo, hi = max(a, a + start - pos), min(b, a + start + n - pos)
                for blk in range((base + lo) // 4096, (base + hi - 1) // 4096 + 1) if lo < hi else ():
                    assert writer_of.setdefault(blk, me) == me, (blk, writer_of[blk], me)
                pos += b - a
    assert covered == {r: p.nbytes for r, p in pieces.items()}, covered
    # Who writes each block: dst the partial blocks at the tensor's ends; else the rank that
    # holds most of the bytes of its 1 MiB region of the file (in whole rows: within two
    # runs of the most is a tie, taken in turn by the region's index).
    end = base + entry.nbytes
    first, last = -(-base // 4096), end // 4096

    def held_in(x, y):
        out = {}
        for r, p in pieces.items():
            out[r] = sum(max(0, min(base + b, y) - max(base + a, x))
                         for a, b in _rows_held(entry, p))
        return out

    run = max(p.block.shape[1] for p in pieces.values()) * 4
    writers = set()
    for blk, w in writer_of.items():
        if not first <= blk < last:
            assert w == 0, (blk, w)
            continue
        groups = {base + p.block.offset[0] * entry.shape[1] * 4 for p in pieces.values()}
        owner, by_rank = _zone_writer(blk, first, last, groups, held_in, run)
        assert w == owner, (blk, by_rank, w)
        writers.add(w)
    assert len(writers) == world, writers  # the writing spread over every holder


def test_one_rank_plans_its_zones_at_a_simulated_world_of_1024():
    # FSDP 128 x TP 8 at world 1024, 500 TP tensors of 32 MiB (bf16 4096 x 4096; each DP
    # group's rows 256 KiB, each rank's part of a row 1 KiB): a rank plans only the zones
    # its pieces touch, finding their holders by bisection (measured on the 2-core VM with
    # 2000 tensors: 0.76 s for rank 5, 1.4 s for dst, which also plans every tensor's ends;
    # 47 MiB at peak, the plan of the 1024 blocks included).
    import tracemalloc

    from distributed_ext.export.plan import tp_regions as export_zones

    world, n, me = 1024, 500, 5
    tracemalloc.start()
    plans = {r: _tp_entries((4096, 4096), (128, 8), (("S", 0), ("S", 1)), world, keep=r,
                            n=n, dtype="bfloat16") for r in (me, 0)}
    bases = torch.arange(n, dtype=torch.int64) * (4096 * 4096 * 2) + 4000
    zones = {r: export_zones.plan_zones(plans[r], bases, r, 0, 4096, 2**20) for r in plans}
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mine = zones[me]
    # Rank 5 holds 32 rows x 1 KiB of each tensor, in the zone of the first DP group's rows
    # (its TP group: ranks 0-7): it sends them to that zone's writer, one of those 8, but
    # for the block the next DP group's zone begins with (under 4 KiB a tensor).
    assert sum(s[3] for segs in mine.outgoing.values() for s in segs) + sum(
        s[3] for s in mine.kept) == n * 32 * 1024
    beyond = sum(s[3] for o, segs in mine.outgoing.items() if o >= 8 for s in segs)
    assert beyond < n * 4096 and not mine.incoming, (beyond, mine.outgoing.keys())
    for o, segs in mine.outgoing.items():  # what the writer (here dst) lists alike
        if o == 0:
            assert [(s[1].rank, s[2], s[3]) for s in zones[0].incoming[me]] == \
                [(s[1].rank, s[2], s[3]) for s in segs]
    assert peak < 128 * 2**20, peak / 2**20


def test_a_rank_plans_no_zone_it_neither_holds_nor_owns():
    from distributed_ext.export.plan import tp_regions as export_zones

    # FSDP x TP: ranks 0 and 1 hold the first half's rows, 2 and 3 the second's. Rank 1
    # meets only the first half's zones; rank 3 sends nothing to 0 or 1 (no zone of theirs).
    plans = _tp_entries((2048, 1024), (2, 2), (("S", 0), ("S", 1)), 4)
    bases = torch.tensor([2**20], dtype=torch.int64)  # (the halves meet at a region's start)
    z1 = export_zones.plan_zones(plans[1], bases, 1, 0, 4096, 2**20)
    z3 = export_zones.plan_zones(plans[3], bases, 3, 0, 4096, 2**20)
    assert set(z1.incoming) <= {0} and set(z1.outgoing) <= {0}, (z1.incoming, z1.outgoing)
    assert set(z3.outgoing) <= {2} and set(z3.incoming) <= {2}, (z3.incoming, z3.outgoing)
    assert z1.kept and z3.kept  # (each writes regions of its own half)
    # Zoned: more than one holder, each block many runs under SHORT_RUN; not Shard(1) rows
    # of 64 KiB (written where held), nor one holder's, nor Shard(0) blocks (one run each).
    from distributed_ext.export.plan import pieces as export_pieces

    def runs(offset, block, shape):
        return export_pieces._piece_runs(E.Block(offset, block), shape, 4)

    tp = [runs((0, 0), (8, 512), (8, 1024)), runs((0, 512), (8, 512), (8, 1024))]
    assert export_pieces._zoned(tp) and not export_pieces._zoned(tp[:1])
    assert not export_pieces._zoned([runs((0, 0), (8, 2**14), (8, 2**15)),
                                     runs((0, 2**14), (8, 2**14), (8, 2**15))])
    assert not export_pieces._zoned([runs((0, 0), (4, 1024), (8, 1024)),
                                     runs((4, 0), (4, 1024), (8, 1024))])
    # Under "dst" (no spread) a TP tensor is not zoned: dst assembles its rows.
    assert not _tp_entries((64, 1024), (2,), (("S", 1),), 2, spread=False)[1][0].zoned


def _short_rows_every_rank_writes(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export.plan import block_owners as export_owners

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    tiny = export_owners.SHORT_RUN = 512  # (at most 20 fragments a block)
    # Shard(1) rows of exactly SHORT_RUN bytes (8 a block, from every rank in turn), of
    # 1.5 KiB (which the 4 KiB chunks cut inside a run), and of one float under SHORT_RUN.
    state = {
        "at_tiny": distribute_tensor(torch.randn(300, tiny // 4 * world, generator=g),
                                     mesh, [Shard(1)]),
        "rows": distribute_tensor(torch.randn(301, 384 * world, generator=g), mesh,
                                  [Shard(1)]),
        "under": distribute_tensor(torch.randn(50, (tiny // 4 - 1) * world, generator=g),
                                   mesh, [Shard(1)]),
    }
    full = {k: v.full_tensor() for k, v in state.items()}
    got = {}
    for writers in ("all", "dst"):
        where = os.path.join(out, writers)
        writes = _recording_writes(lambda w=writers, o=where: dx.export_hf_checkpoint(
            state, o, chunk_bytes=4096, writers=w))
        got[writers] = (_blocks_written(writes), sum(n for _f, _o, n in writes))
    return got, full


def test_tp_rows_down_to_the_short_run_threshold_are_written_where_they_are_held(tmp_path):
    # SHORT_RUN lowered to 512 bytes (20 fragments a block at most): runs of a Shard(1)
    # layout at least that long are written by their holders, every block once, by the
    # holder of most of its bytes; shorter ones go to dst. The files are the single
    # writer's, byte for byte.
    world = 3
    values = assert_all_ok(run_ranks(_short_rows_every_rank_writes, world, str(tmp_path),
                                     timeout=120))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    blocks = [got["all"][0] for got, _full in values]
    for a, b in itertools.combinations(range(world), 2):
        assert not blocks[a] & blocks[b], (a, b, sorted(blocks[a] & blocks[b])[:5])
    assert len(set().union(*blocks)) == -(-len(data) // 4096)  # every block written
    # Every rank writes a part: the long TP rows' blocks are spread over their holders
    # (with "dst", the others write nothing). These rows tie two ranks in most blocks
    # (the data starts at a block boundary): a tie is dst's, else taken by turns.
    wrote_all = [got["all"][1] for got, _full in values]
    wrote_dst = [got["dst"][1] for got, _full in values]
    assert min(wrote_all[1:]) > len(data) // (5 * world), wrote_all
    assert max(wrote_dst[1:]) == 0 and wrote_dst[0] >= len(data), wrote_dst
    got = read_checkpoint(tmp_path / "all")
    for k, v in values[0][1].items():
        assert torch.equal(got[k], v), k


def _tp_rows_by_region(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(6)
    # 2 x 4 MiB of fp32 Shard(1) rows, each rank's part of a row 2 KiB
    state = {f"w{i}": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                        [Shard(1)]) for i in range(2)}
    got = {}
    for writers in ("all", "dst"):
        sent, real = [0], dist.isend

        def counting(tensor, *args, sent=sent, real=real, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return real(tensor, *args, **kwargs)

        dist.isend = counting
        try:
            writes = _recording_writes(lambda w=writers: dx.export_hf_checkpoint(
                state, os.path.join(out, w), writers=w))
        finally:
            dist.isend = real
        got[writers] = (sum(n for _f, _o, n in writes), sent[0])
    return got, {k: v.full_tensor() for k, v in state.items()}


def test_tp_rows_are_written_by_region_each_rank_writing_and_sending_its_share(tmp_path):
    # World 2, TP: every region is half each rank's, so the regions alternate between
    # them: each writes about half of the file and sends about half of its own bytes (the
    # other's regions), where with one writer rank 1 sends all of its bytes and writes none.
    values = assert_all_ok(run_ranks(_tp_rows_by_region, 2, str(tmp_path), timeout=120))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    got = read_checkpoint(tmp_path / "all")
    for k, v in values[0][1].items():
        assert torch.equal(got[k], v), k
    mine = 8 * 2**20 // 2  # each rank's bytes
    for r, (by, _full) in enumerate(values):
        wrote, sent = by["all"]
        assert 0.4 * len(data) < wrote < 0.6 * len(data), (r, by)
        assert 0.4 * mine < sent < 0.6 * mine, (r, by)
    assert values[1][0]["dst"][0] == 0 and values[1][0]["dst"][1] >= mine, values[1][0]
