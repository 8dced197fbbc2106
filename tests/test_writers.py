"""writers="all" on real gloo ranks: every rank writes its own bytes into the files the single
writer makes (byte for byte), each 4 KiB block by one rank -- the holder of most of its
bytes (shared blocks: :mod:`distributed_ext.export.owners`, :mod:`.edges`; TP rows by
region: :mod:`.zones`) -- and the planners' pure functions in one process, up to a
simulated world of 1024."""

from __future__ import annotations

import itertools
import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, run_ranks
from hf_models import read_checkpoint
from test_export import (  # (skips where transformers is missing, as that module does)
    _counting_sends,
    _export_then_use_the_group,
)

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export import holdings as export_holdings

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


# -- writers="all": every rank writes its own bytes --------------------------------------------


def _written_bytes() -> int:
    """Bytes this process passed to write calls so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _recording_writes(fn):
    """Runs ``fn()``; the ``(file name, offset, nbytes)`` of every write this rank made to a
    checkpoint file (pwrite, direct or not, and the native batched writes)."""
    from distributed_ext import _direct_io, _native

    writes, real_pwrite, real_segments = [], _direct_io._pwrite_fully, _native.pwrite_segments

    def name(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def pwrite(fd, view, offset):
        writes.append((name(fd), offset, len(view)))
        return real_pwrite(fd, view, offset)

    def segments(fd, table):
        rows = table.tolist() if isinstance(table, torch.Tensor) else table
        writes.extend((name(fd), offset, n) for _src, offset, n in rows)
        return real_segments(fd, table)

    _direct_io._pwrite_fully, _native.pwrite_segments = pwrite, segments
    try:
        fn()
    finally:
        _direct_io._pwrite_fully, _native.pwrite_segments = real_pwrite, real_segments
    return writes


def _blocks_written(writes, align=4096):
    """The ``(file name, block index)`` of every aligned block these writes touch."""
    return {(f, b) for f, offset, n in writes if n
            for b in range(offset // align, (offset + n - 1) // align + 1)}


def _both_writers(base):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    r, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    # Every placement and dtype: uneven and empty shards, short Shard(1) runs, replicas.
    state = {
        "fsdp": distribute_tensor(torch.randn(1024, 256, generator=g), mesh, [Shard(0)]),
        "uneven": distribute_tensor(torch.randn(7, 33, generator=g), mesh, [Shard(0)]),
        "tp": distribute_tensor(torch.randn(64, 96, generator=g).bfloat16(), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.randint(-9, 9, (300,), generator=g, dtype=torch.int8),
                                 mesh, [Replicate()]),
        "flags": torch.arange(77) % 3 == 0,  # a plain tensor every rank holds
        "dense": torch.randn(4096, 256, generator=g),  # 4 MiB on every rank: split to write
        f"own{r}": torch.full((5000,), float(r), dtype=torch.float16),  # only this rank's
    }
    out = {}
    writes = []
    for writers in ("all", "dst", None):  # None: the default, on this one host's disk
        before = _written_bytes()
        kwargs = {} if writers is None else {"writers": writers}
        sent = _counting_sends(lambda w=writers, kw=kwargs: writes.extend(_recording_writes(
            lambda: dx.export_hf_checkpoint(state, os.path.join(base, str(w)),
                                            max_shard_size="300KB", **kw))))
        out[writers] = (sent, _written_bytes() - before)
        if writers == "all":
            out["blocks"] = _blocks_written(writes)
    fsdp_share = state["fsdp"].to_local().numel() * 4  # this rank's block
    return out, fsdp_share, 4 * 2**20 // world - world * 4096  # and its rows of "dense"


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_writes_its_own_bytes_into_the_same_files_the_single_writer_makes(world,
                                                                                     tmp_path):
    values = assert_all_ok(run_ranks(_both_writers, world, str(tmp_path), timeout=180))
    names = sorted(os.listdir(tmp_path / "dst"))
    assert names == sorted(os.listdir(tmp_path / "all")) and E.INDEX_NAME in names
    assert names == sorted(os.listdir(tmp_path / "None"))
    for name in names:  # byte for byte
        assert (tmp_path / "all" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes()
        assert (tmp_path / "None" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes()
    total = sum(os.path.getsize(tmp_path / "all" / n) for n in names if n != E.INDEX_NAME)
    # Every 4 KiB block of the files has one writer: where two ranks' runs meet inside a
    # block, the one holding more of it writes it (the other sends it its bytes there).
    blocks = [got["blocks"] for got, _fsdp, _dense in values]
    for a, b in itertools.combinations(range(world), 2):
        assert not blocks[a] & blocks[b], (a, b, sorted(blocks[a] & blocks[b])[:5])
    assert sum(map(len, blocks)) >= total // 4096  # (and the writes were seen)
    for r, (got, fsdp_share, dense_share) in enumerate(values):
        sent_all, wrote_all = got["all"]
        sent_dst, wrote_dst = got["dst"]
        # Only pieces of short runs cross the link (here the Shard(1) rows, the small
        # tensors: ~20 KiB), for dst to assemble them into whole regions, and its bytes in
        # the partial 4 KiB blocks at the ends of its two long runs that another rank owns
        # (its FSDP block, its rows of "dense": under 16 KiB); the FSDP block never.
        assert sent_all < 64 * 2**10, (r, sent_all)
        assert r == 0 or sent_all < sent_dst - fsdp_share + 4 * 4096, (r, sent_all, sent_dst)
        # Each rank writes about its share (its FSDP block and its rows of the replicated
        # "dense", split between its holders), never the checkpoint.
        assert fsdp_share + dense_share <= wrote_all < total / world + 2**20, \
            (r, wrote_all, total)
        if r == 0:
            assert wrote_dst >= total  # the single writer writes every byte ...
        else:  # ... the others send theirs (but no byte of "dense": dst has its own copy)
            assert fsdp_share < sent_dst < fsdp_share + 2**20 and wrote_dst < 2**20, \
                (r, sent_dst, wrote_dst)
        # The default on a directory every rank sees (here one host's disk): every rank
        # writes its own bytes, as with "all".
        sent_auto, wrote_auto = got[None]
        assert sent_auto == sent_all and fsdp_share + dense_share <= wrote_auto < \
            total / world + 2**20, \
            (r, got[None], got["all"])


def _blind_rank(out, writers):
    if dist.get_rank() == 1:  # this rank's view of the directory is another filesystem
        from distributed_ext.export import writers as export_writers

        export_writers._sees = lambda stage, token: False
    # (and 4 MiB every rank holds: split between the writers under "all", dst's own copy
    # once "auto" falls back to one writer -- none of it then crosses the link)
    state = {f"w{dist.get_rank()}": torch.full((1000,), 1.0),
             "dense": torch.arange(2**20, dtype=torch.float32)}
    sent = []
    result = outcome(lambda: sent.append(_counting_sends(
        lambda: dx.export_hf_checkpoint(state, out, writers=writers))))
    return result, sent, dx.all_reduce("after", lambda: 1, sum)


def test_writers_all_on_a_directory_a_rank_does_not_see_is_refused_and_auto_falls_back(
        tmp_path):
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_blind_rank, 3, str(out), "all"))
    for result, _sent, after in values:
        assert result[0] == "raised" and result[1] == "ValueError", result
        assert "writers='all', but rank(s) [1] do not see directory=" in result[2], result
        assert after == 3
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if "dext" in n]
    values = assert_all_ok(run_ranks(_blind_rank, 3, str(out), "auto"))
    assert [v[0][0] for v in values] == ["ok"] * 3
    assert 0 < values[1][1][0] < 2**20  # the fallback: dst writes, rank 1 sends its bytes
    assert sorted(read_checkpoint(out)) == ["dense", "w0", "w1", "w2"]


def test_writers_must_be_auto_all_or_dst(tmp_path):
    with pytest.raises(ValueError, match="writers='some'; pass 'auto'"):
        dx.export_hf_checkpoint({"w": torch.ones(2)}, str(tmp_path / "x"), writers="some")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("shape, block, base", [
    ((1000, 300), E.Block((333, 0), (400, 300)), 77),  # a Shard(0) block: one long run
    ((64, 5000), E.Block((0, 1200), (64, 2500)), 4096 * 3 + 5),  # Shard(1): 64 rows
    ((64, 1024), E.Block((0, 0), (64, 1024)), 8192),  # aligned: no edges at all
])
def test_a_writers_middles_and_edges_cover_its_runs_once(shape, block, base):
    # What a joined writer writes itself (the aligned blocks inside each row of its
    # messages) and what goes to the blocks' owners (edge_table) cover each byte of its runs once,
    # and no aligned block is in both; chunk-split rows included.
    from distributed_ext.export.messages import _rows, edge_table, pack

    runs = E.block_runs(block, shape, 4)
    piece = E.Piece(1, block, block.numel * 4)
    entry = E.Entry("w", torch.float32, shape, [piece], index=0)
    messages = E.plan_messages([(entry, piece)], 24 * 4096)  # rows split mid-run
    edges = pack(edge_table(messages, torch.tensor([base]), 4096)[0], 2**20)
    mine, sent = [], []
    rows = torch.cat([_rows(m) for m in messages]).tolist()
    for row in rows:
        # (the whole 4 KiB blocks inside the row)
        lo, hi = min(row[3], -(base + row[1]) % 4096), (base + row[1] + row[3]) // 4096 * 4096
        hi -= base + row[1]
        if hi > lo:
            mine.append((base + row[1] + lo, hi - lo))
    for m in edges:
        sent += [(base + r[1], r[3]) for r in _rows(m).tolist()]
    assert all(n < 4096 for _o, n in sent) and sum(map(len, edges)) <= 2 * len(rows)
    assert all(o % 4096 == 0 and n % 4096 == 0 for o, n in mine)
    covered = sorted(mine + sent)
    expected = sorted((base + o, n) for o, _a, n in runs.pieces(0, piece.nbytes))
    assert sum(n for _o, n in covered) == piece.nbytes
    # Merged, they are exactly the runs (no gap, no overlap) ...
    merged = _merge_adjacent(covered)
    assert merged == _merge_adjacent(expected)
    # ... and no block written by this rank holds a byte that goes to dst.
    own = {b for o, n in mine for b in range(o // 4096, (o + n) // 4096)}
    assert not own & {b for o, n in sent for b in range(o // 4096, (o + n - 1) // 4096 + 1)}
    if base % 4096 == 0 and shape == block.shape:
        assert not edges


def _merge_adjacent(runs):
    out = []
    for o, n in runs:
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((o, n))
    return out


def test_one_rank_plans_only_what_concerns_it_at_a_simulated_world_of_1024():
    # The plan a sender computes (in one process, from the metadata of 1024 simulated ranks
    # that all hold 100k Shard(0) tensors): every check made, its own pieces kept, memory and
    # work O(keys) -- not O(keys x world).
    import array
    import tracemalloc

    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces
    from distributed_ext.export.messages import edge_table, pack

    world, n, me = 1024, 100_000, 5
    sig = export_entries.Signature("float32", (4096, 64), (("S", 0),), tuple(range(world)),
                                   (world,))
    keys = [f"model.layers.{i}.w" for i in range(n)]
    ids = (array.array("i", [0]) * n).tobytes()
    described = [export_entries.Described(keys, ids, [sig])] * world
    tracemalloc.start()
    holdings = export_holdings.merge_holdings(described, list(range(world)), 0, None)
    # (as planned by default: every rank writing its own bytes)
    entries = export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=me,
                                         spread=True)
    export_pieces.check_keys(entries)
    messages = E.plan_messages(((e, p) for e in entries for p in e.pieces), 16 * 2**20)
    # The edges it would send dst were its pieces long (each entry's data after a header of
    # 4000 bytes: nothing aligned)
    bases = torch.arange(n, dtype=torch.int64) * (4096 * 64 * 4) + 4000
    edges = pack(edge_table(messages, bases, 4096)[0], 2**20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # (each 1 KiB piece inside one 4 KiB block: all of it one edge; 100 packed messages)
    assert sum(len(m) for m in edges) == n and sum(s[3] for m in edges for s in m) == n * 1024
    assert len(edges) == len(messages)
    assert len(entries) == n and [e.key for e in entries[:2]] == keys[:2]
    for e in entries[::997]:
        (p,) = e.pieces
        assert p.rank == me and p.block == E.Block((4 * me, 0), (4, 64)) and p.nbytes == 1024
    assert sum(len(m) for m in messages) == n  # its 100k KiB, packed: 100 messages
    assert len(messages) == n * 1024 // 2**20 + 1
    # (71 MiB measured cold: the 1024 blocks and their runs computed and cached; planning
    # every rank's pieces would take GBs)
    assert peak < 96 * 2**20, peak / 2**20


def test_one_rank_deals_its_shared_blocks_at_a_simulated_world_of_1024():
    # With every rank writing, what one rank plans of the shared blocks at world 1024 with
    # 100k Shard(0) tensors whose runs (132 KB a rank) are long: its own runs' ends (two
    # fragments each) and the ranks they are dealt to -- O(its pieces), never the world's
    # 204.8M fragments (dealt out, each rank plans ~1/1024 of them: RESULTS.md).
    import array
    import tracemalloc

    from distributed_ext.export import edges, prepare
    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces
    from distributed_ext.export.messages import edge_table

    world, n, me, row = 1024, 100_000, 5, 4124
    sig = export_entries.Signature("float32", (32 * world + 3, row // 4), (("S", 0),),
                                   tuple(range(world)), (world,))
    keys = [f"model.layers.{i}.w" for i in range(n)]
    described = [export_entries.Described(keys, (array.array("i", [0]) * n).tobytes(),
                                          [sig])] * world

    class Files:  # 36 tensors a file (5 GB), a header of 120 bytes per tensor
        nbytes = (32 * world + 3) * row
        file_of = torch.arange(n) // 36
        bases = 8 + 120 * 36 + torch.arange(n) % 36 * nbytes
        sizes = [8 + 120 * 36 + 36 * nbytes] * (n // 36) + [8 + 120 * 36 + n % 36 * nbytes]

    tracemalloc.start()
    holdings = export_holdings.merge_holdings(described, list(range(world)), 0, None)
    entries = export_pieces.plan_entries(holdings, None, 0, list(range(world)), keep=me,
                                         spread=True)
    written = [(e, p) for e in entries for p in e.pieces if not prepare._short(e, p)]
    messages = E.plan_messages(written, 16 * 2**20, Files.bases)
    plan = edges.plan_edges(edge_table(messages, Files.bases, 4096)[0], Files, world)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(written) == n and len(plan.rows) == 2 * n  # both ends of each of its runs
    assert int(plan.dealt.sum()) == 2 * n and int(plan.dealt.count_nonzero()) == world
    assert int(plan.dealt.max()) < 4 * 2 * n // world  # spread over the ranks
    # Its rows grouped by the rank each is dealt to, canonical within each group
    to = edges._owners.coordinators(plan.rows, Files.file_of, Files.bases, Files.sizes,
                                    world, 4096)
    assert bool((to[plan.order][1:] >= to[plan.order][:-1]).all())
    assert peak < 160 * 2**20, peak / 2**20  # (Python objects; tables of its own rows)


def _both_writers_2d(base, short_run):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import owners as export_owners

    if short_run is not None:  # runs from this length up are written where they are held
        export_owners.SHORT_RUN = short_run

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(1)
    state = {  # HSDP (replicas of each FSDP shard) and FSDP+TP, world 4
        "hsdp": distribute_tensor(torch.randn(512, 256, generator=g), mesh,
                                  [Replicate(), Shard(0)]),
        "fsdp_tp": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                     [Shard(0), Shard(1)]),
        # 4 MiB HSDP shards, each split between its two holders to write (2 MiB each)
        "hsdp_big": distribute_tensor(torch.randn(4096, 512, generator=g), mesh,
                                      [Replicate(), Shard(0)]),
        # HSDP x TP: replicated TP shards (columns 0-511 on ranks 0 and 2, the rest on 1, 3)
        "hsdp_tp": distribute_tensor(torch.randn(1024, 1024, generator=g), mesh,
                                     [Replicate(), Shard(1)]),
    }
    out = {}
    for writers in ("all", "dst"):
        writes = _recording_writes(lambda w=writers: dx.export_hf_checkpoint(
            state, os.path.join(base, w), writers=w))
        out[writers] = sum(n for _f, _o, n in writes)  # (to the files, not the link)
        out[f"{writers} blocks"] = _blocks_written(writes)
    return out


@pytest.mark.parametrize("short_run", [None, 512])
def test_hsdp_and_fsdp_tp_with_every_rank_writing_match_the_single_writer(short_run, tmp_path):
    values = assert_all_ok(run_ranks(_both_writers_2d, 4, str(tmp_path), short_run,
                                     timeout=180))
    data = (tmp_path / "all" / E.WEIGHTS_NAME).read_bytes()
    assert data == (tmp_path / "dst" / E.WEIGHTS_NAME).read_bytes()
    # Each 256 KiB HSDP block is written once, by one of its two holders (dst for the one it
    # holds, one of ranks 1 and 3 for the other); each 4 MiB one is split between its two
    # holders (2 MiB each: every rank writes); the FSDP+TP blocks' rows are 2 KiB runs:
    # short, which dst assembles, or -- SHORT_RUN lowered to 512 bytes -- each written by
    # its holder (below). All ranks together write the file once, not once per replica.
    assert len(data) <= sum(v["all"] for v in values) < len(data) + 2**20, values
    assert values[0]["all"] < len(data) - 4 * 2**20, values  # dst did not write it all
    assert max(values[r]["all"] for r in (1, 3)) >= 2 * 2**20 + 256 * 2**10, values
    assert min(v["all"] for v in values) >= 2 * 2**20 - 8192, values
    for a, b in itertools.combinations(range(4), 2):  # every 4 KiB block: one writer
        assert not values[a]["all blocks"] & values[b]["all blocks"], (a, b)
    # The FSDP+TP tensor, against the file's own header: rank r holds rows 512 * (r // 2)
    # on, columns 512 * (r % 2) on -- rows of 2 KiB runs, two ranks' in each 4 KiB of the
    # file. Under SHORT_RUN (the default) each 1 MiB region of the file (its whole blocks of
    # the tensor) is written by the rank holding most of its bytes in whole rows, ties
    # taken in turn by the region's index -- ranks 0 and 1 alternate over the first half's
    # regions, 2 and 3 over the second's -- and dst writes the partial blocks at the
    # tensor's ends; with 512,
    # each block is written by the rank holding most of its bytes (ties: dst, then the
    # lower rank).
    head_len = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8 : 8 + head_len])["fsdp_tp"]["data_offsets"]
    base, end = 8 + head_len + lo, 8 + head_len + hi

    def held_in(x: int, y: int) -> dict[int, int]:
        """Bytes each rank holds in the file's [x, y)."""
        out: dict[int, int] = {}
        for row in range(1024):
            for half in range(2):
                a = base + row * 4096 + half * 2048
                n = min(a + 2048, y) - max(a, x)
                if n > 0:
                    r = row // 512 * 2 + half
                    out[r] = out.get(r, 0) + n
        return out

    first, last = -(-base // 4096), end // 4096  # the tensor's whole blocks
    owners = set()
    for blk in range(first, last):
        if short_run:
            by_rank = held_in(blk * 4096, blk * 4096 + 4096)
            owner = max(by_rank, key=lambda r: (by_rank[r], r == 0, -r))
        else:
            # (the DP groups' rows: the second's from the tensor's row 512 on)
            owner, by_rank = _zone_writer(blk, first, last, [base + 512 * 4096], held_in,
                                          2048)
        writers = [r for r in range(4) if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]]
        assert writers == [owner], (blk, by_rank, writers)
        owners.add(owner)
    for blk in {base // 4096, (end - 1) // 4096} - set(range(first, last)):
        writers = [r for r in range(4) if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]]
        assert writers == [0], (blk, writers)  # the ends' partial blocks: dst's
    # Every rank writes a part of it (not dst alone, as it would assemble it with "dst");
    # with 512, the lower rank of each pair (every block a tie).
    assert last - first >= 1000, (base, last - first)
    assert owners == ({0, 2} if short_run else {0, 1, 2, 3}), (base, owners)
    # The HSDP x TP tensor's rows: each column block sent by one of its two holders, its
    # regions written by those two senders (one of each pair, not by the replicas too).
    lo, hi = json.loads(data[8 : 8 + head_len])["hsdp_tp"]["data_offsets"]
    first, last = -(-(8 + head_len + lo) // 4096), (8 + head_len + hi) // 4096
    wrote = {r for r in range(4) for blk in range(first, last)
             if (E.WEIGHTS_NAME, blk) in values[r]["all blocks"]}
    if not short_run:  # (with 512 the rows are long: each block a tie, dst's -- above)
        assert len(wrote) == 2 and wrote & {0, 2} and wrote & {1, 3}, wrote


@pytest.mark.parametrize("spread", [False, True])
def test_replicated_blocks_are_split_between_their_holders_only_where_every_rank_writes(
        spread):
    # One process, the planner alone: a 4 MiB plain tensor 3 ranks hold, a 4 MiB column
    # block of a replicated TP shard (rows of 1 KiB: short), and 1 MiB held twice.
    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces

    whole = E.Block((0, 0), (4096, 256))
    column = E.Block((0, 0), (4096, 256))
    small = E.Block((0, 0), (1024, 256))
    holdings = {
        "dense": export_holdings.Holding(
            "dense", export_entries.Signature("float32", (4096, 256)),
            [(r, whole) for r in range(3)]),
        "tp": export_holdings.Holding(
            "tp", export_entries.Signature("float32", (4096, 512)),
            [(0, column), (1, column), (2, E.Block((0, 256), (4096, 256)))]),
        "small": export_holdings.Holding(
            "small", export_entries.Signature("float32", (1024, 256)),
            [(1, small), (2, small)]),
    }
    entries = export_pieces.plan_entries(holdings, None, 0, [0, 1, 2], spread=spread)
    got = {e.key: [(p.rank, p.block, p.local) for p in e.pieces] for e in entries}
    if not spread:  # dst's own copy where it has one, else one holder
        assert got["dense"] == [(0, whole, None)]
        assert [r for r, _b, _l in got["tp"]] == [0, 2] and [r for r, *_ in got["small"]] in \
            ([1], [2])
        return
    # Every holder writes a third of the plain tensor's rows, from its own copy ...
    assert got["dense"] == [
        (0, E.Block((0, 0), (1366, 256)), (slice(0, 1366),)),
        (1, E.Block((1366, 0), (1365, 256)), (slice(1366, 2731),)),
        (2, E.Block((2731, 0), (1365, 256)), (slice(2731, 4096),))]
    # ... a column block is not split (its rows would be short runs, sent to dst), nor a
    # block under 2 MiB: one holder writes each, the least loaded.
    assert len(got["tp"]) == 2 and got["tp"][1][0] == 2 and got["tp"][0][2] is None
    assert len(got["small"]) == 1 and got["small"][0][2] is None
    for e in entries:  # the pieces tile each tensor
        assert sum(p.nbytes for p in e.pieces) == e.nbytes


@pytest.mark.parametrize("base", [77, 4096 * 5])
def test_a_writers_own_chunks_are_cut_where_the_file_is_aligned(base):
    # A rank's block of 1 MiB + 5 in messages of 64 KiB: cut at the file's 4 KiB boundaries
    # (the first message shorter), only the run's two ends share blocks with other runs.
    from distributed_ext.export.messages import _rows, edge_table

    shape, block = (3000, 1000), E.Block((262, 0), (263, 1000))
    piece = E.Piece(1, block, block.numel * 4)
    entry = E.Entry("w", torch.float32, shape, [piece], index=0)
    bases = torch.tensor([base])
    messages = E.plan_messages([(entry, piece)], 64 * 2**10, bases)
    rows = torch.cat([_rows(m) for m in messages]).tolist()
    assert sum(r[3] for r in rows) == piece.nbytes and max(r[3] for r in rows) <= 64 * 2**10
    start = base + 262 * 4000
    assert [(base + r[1]) % 4096 for r in rows[1:]] == [0] * (len(rows) - 1)  # aligned cuts
    edges = edge_table(messages, bases, 4096)[0]
    expected = [(-start) % 4096, (start + piece.nbytes) % 4096]
    assert [s[3] for s in edges] == [n for n in expected if n]
    # Cut every 64 KiB regardless of the file: a shared block at each cut too
    unaligned = E.plan_messages([(entry, piece)], 64 * 2**10)
    more = edge_table(unaligned, bases, 4096)[0]
    assert base % 4096 == 0 or len(more) > len(edges) + 10


def _fragments(*runs, base=100):
    """A fragment table of entry 0 (its data at file offset ``base``) from ``(file offset,
    nbytes)`` pairs."""
    return torch.tensor([(0, o - base, 0, n) for o, n in runs], dtype=torch.int64).reshape(-1, 4)


def _zone_writer(blk, first, last, groups, held_in, run):
    """Who writes block ``blk`` of a TP tensor whose whole blocks are ``[first, last)``: its
    zone is cut at 1 MiB regions of the file and at the block holding each file offset of
    ``groups`` (where a DP group's rows begin); the rank holding most of the zone's bytes
    (``held_in(x, y)``: per rank), counted in whole rows -- within two runs of the most is a
    tie -- ties taken in turn by the region's index. Also returns the bytes per rank."""
    cuts = {first * 4096, last * 4096} | {g // 4096 * 4096 for g in groups}
    cuts |= set(range(-(-first * 4096 // 2**20) * 2**20, last * 4096, 2**20))
    x = max(c for c in cuts if c <= blk * 4096)
    y = min(c for c in cuts if c > blk * 4096)
    by_rank = held_in(x, y)
    most = max(by_rank.values())
    tied = sorted(r for r, n in by_rank.items() if n > 0 and n >= most - 2 * run)
    return tied[x // 2**20 % len(tied)], by_rank


def _tp_entries(shape, mesh, placements, world, spread=True, keep=None, n=1,
                dtype="float32"):
    """Every rank's plan (``keep``: that rank's) of ``n`` tensors of ``shape`` (pieces, as
    ``writers='all'`` plans them), from the metadata alone."""
    import array

    from distributed_ext.export import entries as export_entries
    from distributed_ext.export import pieces as export_pieces

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
    from distributed_ext.export import zones as export_zones

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

    from distributed_ext.export import zones as export_zones

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
    from distributed_ext.export import zones as export_zones

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
    from distributed_ext.export import pieces as export_pieces

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


def test_a_shared_block_is_owned_by_the_holder_of_most_of_its_bytes():
    # One process, the planner alone: one file of 41960 bytes, a 100-byte header, then one
    # entry; 3 ranks' fragments of its shared blocks (file offsets).
    from distributed_ext.export import owners

    bases, file_of, sizes = torch.tensor([100]), torch.zeros(1, dtype=torch.int64), [41960]
    frags = [
        # rank 0 (dst): the header's block (dst's whatever it holds); half of block 6 (a
        # tie); 100 bytes of the file's last, partial block (1000 bytes)
        _fragments((100, 3996), (6 * 4096, 2048), (40960, 100)),
        # rank 1: 3000 of block 2 (against rank 2's 1096); 1000 of block 4 (against 3096);
        # the other half of block 6
        _fragments((2 * 4096, 3000), (4 * 4096 + 3096, 1000), (6 * 4096 + 2048, 2048)),
        # rank 2: the rest of blocks 2 and 4, and 900 of the last block
        _fragments((2 * 4096 + 3000, 1096), (4 * 4096, 3096), (40960 + 100, 900)),
    ]
    dests = owners.plan_owners(frags, file_of, bases, sizes, 0, 4096)
    assert dests[0].tolist() == [0, 0, 2]  # header: dst's; the tie: dst's; 900 of 1000: 2's
    assert dests[1].tolist() == [1, 2, 0]
    assert dests[2].tolist() == [1, 2, 2]
    # The same tie with dst elsewhere: the lower rank
    assert owners.plan_owners(frags, file_of, bases, sizes, 2, 4096)[1].tolist()[2] == 0
    # What rank 2 receives: rank 0's bytes of the last block, rank 1's of block 4
    receipts = owners.plan_receipts(frags, dests)
    assert receipts[0].tolist() == [[1, 0, 6 * 4096 + 2048 - 100, 2048]]  # the tie
    assert receipts[1].tolist() == [[2, 0, 2 * 4096 + 3000 - 100, 1096]]
    got = receipts[2]
    assert got.tolist() == [[0, 0, 40960 - 100, 100], [1, 0, 4 * 4096 + 3096 - 100, 1000]]
    # ... which it accepts; a receipt that is not a fragment of a block it owns, it refuses.
    nbytes = torch.tensor([41860])
    owners.check_tables(dests[2], got, frags[2], 2, 3, nbytes, file_of, bases, 4096)
    for bad in [
        [[1, 0, 2 * 4096 - 100, 1000]],  # block 2 is rank 1's
        [[2, 0, 40960 - 100, 100]],  # from itself
        [[0, 7, 0, 100]],  # no such entry
        [[0, 0, 41860 - 50, 100]],  # past the entry's end
        [[0, 0, 40960 - 100, 4096]],  # a block or more
        [[0, 0, 4 * 4096 + 4000 - 100, 200]],  # across two blocks
        got.flip(0).tolist(),  # not grouped by sender in rank order
        [[1, 0, 4 * 4096 + 3096 - 100, 500], [1, 0, 4 * 4096 + 3096 - 100, 500]],  # twice
    ]:
        with pytest.raises(ValueError, match="is not a fragment of a block this rank owns"):
            owners.check_tables(dests[2], torch.tensor(bad), frags[2], 2, 3, nbytes, file_of,
                                bases, 4096)
    with pytest.raises(ValueError, match="destination 3 of fragment 1 is not a group rank"):
        owners.check_tables(torch.tensor([1, 3, 2]), got, frags[2], 2, 3, nbytes, file_of,
                            bases, 4096)


def _majority_writes(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(2)
    # Long Shard(0) runs (~100 KB a rank) whose ends fall inside 4 KiB blocks.
    state = {"a": distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.randn(500, 300, generator=g).bfloat16(), mesh,
                                    [Shard(0)]),
             "c": distribute_tensor(torch.randn(1000, 70, generator=g), mesh, [Shard(0)])}
    writes = []
    sent = _counting_sends(lambda: writes.append(_recording_writes(
        lambda: dx.export_hf_checkpoint(state, out, writers="all"))))
    writes = writes[0]
    rows = {k: (v.shape[0], v.to_local().shape[0]) for k, v in state.items()}
    return _blocks_written(writes), sent, rows


def test_every_shared_block_is_written_by_the_holder_of_most_of_its_bytes(tmp_path):
    # World 3, against the file itself: where two ranks' runs meet inside a 4 KiB block,
    # the block's writer is the rank holding more of its bytes (dst where the header is),
    # and what each rank sends is exactly its bytes in blocks others own.
    import json

    world = 3
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_majority_writes, world, str(out), timeout=120))
    data = (out / E.WEIGHTS_NAME).read_bytes()
    head_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + head_len])
    start = 8 + head_len
    held = []  # (first byte, end, rank) of every rank's run in the file
    for key, (nrows, _local) in values[0][2].items():
        lo, hi = header[key]["data_offsets"]
        row = (hi - lo) // nrows
        per = -(-nrows // world)  # torch.chunk's rows per rank
        for r in range(world):
            a, b = min(r * per, nrows), min((r + 1) * per, nrows)
            if b > a:
                held.append((start + lo + a * row, start + lo + b * row, r))
    bytes_in = {}  # block -> {rank: bytes}
    for a, b, r in held:
        for blk in (a // 4096, (b - 1) // 4096):
            lo, hi = max(a, blk * 4096), min(b, (blk + 1) * 4096)
            bytes_in.setdefault(blk, {})[r] = hi - lo
    expected_sent = [0] * world
    checked = 0
    for blk, by_rank in bytes_in.items():
        if len(by_rank) < 2 and blk * 4096 >= start:
            continue
        if blk * 4096 < start:  # the header's block: dst's
            owner = 0
        else:
            owner = max(by_rank, key=lambda r: (by_rank[r], r == 0, -r))
        writers = [r for r in range(world) if ("model.safetensors", blk) in values[r][0]]
        assert writers == [owner], (blk, by_rank, writers)
        for r, n in by_rank.items():
            if r != owner:
                expected_sent[r] += n
        checked += 1
    assert checked >= 6  # (the blocks where ranks meet, between and inside tensors)
    owners_seen = {max(by, key=by.get) for by in bytes_in.values() if len(by) > 1}
    assert owners_seen - {0}, owners_seen  # not every shared block is dst's
    assert [v[1] for v in values] == expected_sent, ([v[1] for v in values], expected_sent)


def _corrupt_table(out, how):
    from distributed_ext.export import edges

    if how == "dests":  # every rank, planning owners, sends rank 1 a destination 5 of 2
        real = edges._owners.plan_dealt

        def corrupt(*args):
            dests, receipts, fault = real(*args)
            if len(dests[1]):
                dests[1][0] = 5
            return dests, receipts, fault

        edges._owners.plan_dealt = corrupt
    elif how == "dealt" and dist.get_rank() == 1:  # rank 1 deals its rows to the wrong ranks
        real_deal = edges._owners.coordinators
        edges._owners.coordinators = lambda *args: (real_deal(*args) + 1) % 2
    elif how == "planning" and dist.get_rank() == 1:  # rank 1 fails planning its blocks
        def broken(*args):
            raise RuntimeError("planning failed here")

        edges._owners.plan_owners = broken
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(300 * 1001, dtype=torch.float32)
                                    .reshape(300, 1001), mesh, [Shard(0)])}
    return _export_then_use_the_group(state, out, 2**20, "all")


@pytest.mark.parametrize("how", ["dests", "dealt", "planning"])
def test_a_malformed_table_of_shared_blocks_is_refused_on_every_rank(tmp_path, how):
    # What the ranks send each other to agree the owners is checked where it arrives: a
    # destination that is no rank, a row sent to a rank its block is not dealt to; a rank
    # whose planning fails still answers. Every rank raises (naming the rank at fault),
    # none is left waiting in a collective, the group is usable after, nothing is left.
    out = tmp_path / "ckpt"
    values = assert_all_ok(run_ranks(_corrupt_table, 2, str(out), how))
    if how == "planning":
        assert values[1][0] == ("raised", "RuntimeError", "planning failed here"), values[1]
        assert values[0][0][:2] == ("raised", "RuntimeError") and \
            "rank 1 failed with RuntimeError: planning failed here" in values[0][0][2], values
    else:
        assert all(v[0][:2] == ("raised", "ValueError") or
                   (v[0][:2] == ("raised", "RuntimeError") and
                    "failed with ValueError" in v[0][2]) for v in values), values
    if how == "dests":
        assert re.search(r"the owners of shared blocks planned by rank [01] are malformed: "
                         r"destination 5 of fragment 0 is not a group rank \(0\.\.1\)",
                         values[1][0][2]), values[1]
    elif how == "dealt":
        assert any("rank 1 sent a malformed fragment: row 0 (entry, offset, nbytes) "
                   in v[0][2] for v in values), values
    assert all(after == 2 for _first, after in values)
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if "dext" in n]


def _dies_while_owners_are_planned(out):
    import signal
    import time

    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import edges

    if dist.get_rank() == 1:  # rank 1 dies between the collectives that plan the owners
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)

        edges._owners.plan_dealt = die
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(300 * 1001, dtype=torch.float32)
                                    .reshape(300, 1001), mesh, [Shard(0)])}
    start = time.monotonic()
    result = outcome(lambda: dx.export_hf_checkpoint(state, out, writers="all"))
    return result, time.monotonic() - start


def test_a_rank_dying_while_the_owners_are_planned_is_named_by_every_survivor(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / E.WEIGHTS_NAME).write_bytes(b"an earlier checkpoint")
    res = run_ranks(_dies_while_owners_are_planned, 3, str(out), pg_timeout=120, timeout=120)
    assert res[1].exit_code == -9
    for r in (0, 2):
        outcome, took = res[r].value
        assert outcome[:2] == ("raised", "RuntimeError") and "rank 1 died" in outcome[2], outcome
        assert took < 10, took
    assert (out / E.WEIGHTS_NAME).read_bytes() == b"an earlier checkpoint"
    assert not [n for n in os.listdir(tmp_path) if "dext" in n]


def _owner_disk_fills(out, layout):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    r = dist.get_rank()
    if r == 2:  # its disk fills once it writes the shared blocks (or TP regions) it owns
        def full(self, data, rows):
            raise OSError(28, "No space left on device")

        E.FileSink.write_edges = full
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(3)
    if layout == "tp":  # rows of 2 KiB a rank: 3 x 4.5 MiB in TP regions, a third rank 2's
        state = {k: distribute_tensor(torch.randn(768, 1536, generator=g), mesh, [Shard(1)])
                 for k in ("a", "b", "c")}
    else:
        state = {k: distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)])
                 for k in ("a", "b", "c")}
    return _export_then_use_the_group(state, out, 2**20, "all")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_an_owner_whose_disk_fills_while_writing_shared_blocks_fails_every_rank(layout,
                                                                                tmp_path):
    # The exchange's rounds go on to the end (no peer waits on the failed rank), then the
    # failure is agreed: every rank raises naming it, the earlier checkpoint stays.
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier checkpoint")
    values = assert_all_ok(run_ranks(_owner_disk_fills, 3, str(out), layout))
    assert values[2][0][:2] == ("raised", "OSError"), values[2]
    for r in (0, 1):
        assert values[r][0][:2] == ("raised", "RuntimeError") and \
            "rank 2 failed with OSError" in values[r][0][2], values[r]
    assert all(after == 3 for _first, after in values)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"an earlier checkpoint"
    assert not [n for n in os.listdir(tmp_path) if "dext" in n]


def _tiny_chunks(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(4)
    state = {k: distribute_tensor(torch.randn(999, 77, generator=g), mesh, [Shard(0)])
             for k in ("a", "b")}
    writes = _recording_writes(
        lambda: dx.export_hf_checkpoint(state, out, chunk_bytes=1000, writers="all"))
    return _blocks_written(writes)


def test_transport_chunks_under_a_block_still_give_each_block_one_writer(tmp_path):
    # chunk_bytes=1000: the link's messages are 1000 bytes, but a rank's own runs are cut
    # in whole blocks, so only their ends are shared (and each shared block has one writer).
    out = tmp_path / "ckpt"
    blocks = assert_all_ok(run_ranks(_tiny_chunks, 3, str(out)))
    for a, b in itertools.combinations(range(3), 2):
        assert not blocks[a] & blocks[b], (a, b)
    data = (out / E.WEIGHTS_NAME).read_bytes()
    assert len(set().union(*blocks)) == -(-len(data) // 4096)  # every block written
    got = read_checkpoint(out)
    g = torch.Generator().manual_seed(4)
    for k in ("a", "b"):
        assert torch.equal(got[k], torch.randn(999, 77, generator=g)), k


def _short_rows_every_rank_writes(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export import owners as export_owners

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
    # (with "dst", the others write nothing).
    wrote_all = [got["all"][1] for got, _full in values]
    wrote_dst = [got["dst"][1] for got, _full in values]
    assert min(wrote_all[1:]) > len(data) // (3 * world), wrote_all
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


@pytest.mark.parametrize("world", [3, 5])
def test_owners_planned_by_the_ranks_blocks_are_dealt_to_equal_one_plan_of_them_all(world):
    # One process: the ranks' fragments (Shard(0) runs of two entries sharing one list of
    # pieces at different alignments, column blocks of many long runs, a file's end), dealt
    # out by block; each rank's plan of what it was dealt, put together, equals the plan of
    # every fragment at once (owners, and receipts row for row in their order), and each
    # rank plans only a part of them.
    from distributed_ext.export import edges, owners, prepare
    from distributed_ext.export.messages import edge_table

    shapes = {"rows": (3001, 700), "long_cols": (40, 60000), "tail": (777, 333)}
    entries, bases, base = [], [], 4000
    for key, shape in shapes.items():
        e = E.Entry(key, torch.float32, shape, index=len(entries))
        for r in range(world):
            if key == "long_cols":
                w = shape[1] // world
                block = E.Block((0, r * w), (shape[0], w if r < world - 1 else shape[1] - r * w))
            else:
                per = -(-shape[0] // world)
                a, b = min(r * per, shape[0]), min((r + 1) * per, shape[0])
                block = E.Block((a, 0), (b - a, shape[1]))
            if block.numel:
                e.pieces.append(E.Piece(r, block, block.numel * 4))
        entries.append(e)
        bases.append(base)
        base += e.nbytes
        if key == "rows":  # shares its list of pieces, as FSDP2's keys do
            entries.append(E.Entry("rows2", torch.float32, shape, e.pieces,
                                   index=len(entries)))
            bases.append(base + 100)
            base += e.nbytes + 100
    bases, file_of, sizes = torch.tensor(bases), torch.zeros(len(entries), dtype=torch.int64), [base]
    nbytes = torch.tensor([e.nbytes for e in entries])
    tables = []
    for r in range(world):
        mine = [(e, p) for e in entries for p in e.pieces
                if p.rank == r and not prepare._short(e, p)]
        own = edge_table(E.plan_messages(mine, 2**20, bases), bases, 4096)[0]
        tables.append(edges.fragment_table(own))
    assert all(len(t) > 2 for t in tables)
    dests = owners.plan_owners(tables, file_of, bases, sizes, 0, 4096)
    receipts = owners.plan_receipts(tables, dests)
    # Dealt out: rank c gets, from each rank, its rows of the blocks dealt to c.
    to = [owners.coordinators(t, file_of, bases, sizes, world, 4096) for t in tables]
    got_dests = [torch.full((len(t),), -9) for t in tables]
    got_receipts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for c in range(world):
        received = [t[to[r] == c][:, [0, 1, 3]] for r, t in enumerate(tables)]
        assert 0 < sum(map(len, received)) < sum(map(len, tables))  # a part of them
        d, rec, fault = owners.plan_dealt(received, c, file_of, bases, sizes, nbytes, 0, 4096)
        assert fault is None
        for r in range(world):
            got_dests[r][to[r] == c] = d[r]
            got_receipts[r].append(rec[r])
    for r in range(world):
        assert torch.equal(got_dests[r], dests[r]), r
        rec = torch.cat(got_receipts[r])
        rec = rec[torch.sort(owners.order_key(rec[:, 1], rec[:, 2]), stable=True).indices]
        rec = rec[torch.sort(rec[:, 0], stable=True).indices]
        assert torch.equal(rec, receipts[r]), r
    assert any(len(t) for t in receipts[1:])  # not every shared block is dst's
    # A row dealt to the wrong rank, or past its entry's end, is refused by the rank it
    # reaches: that sender's fragments all get destination -1.
    wrong = [t[to[r] == 1][:, [0, 1, 3]] for r, t in enumerate(tables)]
    d, _rec, fault = owners.plan_dealt(wrong, 0, file_of, bases, sizes, nbytes, 0, 4096)
    assert fault is not None and fault[0] == 0 and "dealt to this rank" in fault[1]
    assert bool((d[0] == -1).all())
    past = [t[to[r] == 0][:, [0, 1, 3]].clone() for r, t in enumerate(tables)]
    r = next(r for r in range(1, world) if len(past[r]))
    past[r][0, 1] = nbytes[past[r][0, 0]]
    assert owners.plan_dealt(past, 0, file_of, bases, sizes, nbytes, 0, 4096)[2][0] == r
    # Counts every rank announced (from r, for c), checked alike by all: a negative one or
    # a column past its bound is a ValueError naming the rank it was for.
    table = torch.tensor([[1, 2], [3, 4]])
    owners.check_counts(table, [4, 6], "rows for", "x", [10, 11])
    with pytest.raises(ValueError, match=r"announced \[2, 4\] rows for rank 11 .* at most 5"):
        owners.check_counts(table, [4, 5], "rows for", "x", [10, 11])
    with pytest.raises(ValueError, match=r"announced \[1, -3\] rows for rank 10"):
        owners.check_counts(torch.tensor([[1, 2], [-3, 4]]), 100, "rows for", "x", [10, 11])


def _random_layouts(base, seed):
    """A seeded mix of layouts in one checkpoint (1-D or 2-D meshes, Shard(0/1/2) and
    Replicate in any combination, plain tensors, uneven and empty shards, eight dtypes, a
    random file size and chunk size), written with both writers; rank 0 saves torch's own
    ``full_tensor()`` of each key beside them."""
    import random

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    world = dist.get_world_size()
    rng = random.Random(seed)
    dims = rng.choice([(world,), (2, world // 2)] if world == 4 else [(world,)])
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=tuple(f"m{i}" for i in range(len(dims))))
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
              torch.float64, torch.int64, torch.uint8]
    state = {}
    for i in range(rng.randint(6, 10)):
        dtype = rng.choice(dtypes)
        shape = [rng.choice([1, 3, 7, 33, 100, 513, 1024, 1500, 3001])
                 for _ in range(rng.choice([1, 2, 2, 3]))]
        while math.prod(shape) * dtype.itemsize > 4 * 2**20:  # at most 4 MiB a tensor
            j = max(range(len(shape)), key=shape.__getitem__)
            shape[j] = max(1, shape[j] // 2)
        full = torch.randn(shape, generator=g) * 50
        full = full > 0 if dtype == torch.bool else full.to(dtype)
        if rng.random() < 0.2:
            state[f"t{i}"] = full
            continue
        placements = [rng.choice([Replicate()] + [Shard(d) for d in range(len(shape))])
                      for _ in dims]
        state[f"t{i}"] = distribute_tensor(full, mesh, placements)
    # and always a TP tensor of rows under SHORT_RUN, over several regions (zones)
    state["tp"] = distribute_tensor(torch.randn(600, 1536 * world, generator=g), mesh,
                                    [Shard(1)] * len(dims))
    max_shard_size = rng.choice(["200KB", "1MB", "5GB"])
    chunk = rng.choice([None, 5000, 100_000, 2**20])
    for writers in ("all", "dst"):
        dx.export_hf_checkpoint(state, os.path.join(base, writers), writers=writers,
                                max_shard_size=max_shard_size, chunk_bytes=chunk)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(base, "full_tensors.pt"))
    return dims, max_shard_size, chunk


@pytest.mark.parametrize("world, seed", [(2, 3), (3, 1), (4, 7), (4, 8)])
def test_random_layouts_are_written_as_full_tensor_holds_them_by_either_writers(world, seed,
                                                                              tmp_path):
    values = assert_all_ok(run_ranks(_random_layouts, world, str(tmp_path), seed, timeout=240))
    names = sorted(os.listdir(tmp_path / "dst"))
    assert names == sorted(os.listdir(tmp_path / "all")), values[0]
    for name in names:
        assert (tmp_path / "all" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes(), \
            (name, values[0])
    want = torch.load(tmp_path / "full_tensors.pt")
    got = read_checkpoint(tmp_path / "all")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), \
            (k, values[0])


def _subgroup_export(base):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    r, members = dist.get_rank(), [1, 2, 3]
    group = dist.new_group(members)  # (collective: every rank makes it)
    if r not in members:
        return None
    mesh = DeviceMesh("cpu", members)
    g = torch.Generator().manual_seed(0)
    state = {"fsdp": distribute_tensor(torch.randn(1000, 300, generator=g), mesh, [Shard(0)]),
             "tp": distribute_tensor(torch.randn(700, 3 * 1536, generator=g), mesh, [Shard(1)]),
             "rep": distribute_tensor(torch.randn(3000, 700, generator=g), mesh, [Replicate()]),
             "plain": torch.arange(5000.0), f"own{r}": torch.full((777,), float(r))}
    for writers in ("all", "dst"):
        dx.export_hf_checkpoint(state, os.path.join(base, writers), dst=2, group=group,
                                writers=writers, max_shard_size="2MB")
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def test_a_subgroup_whose_dst_is_not_rank_0_writes_as_full_tensor_holds_it(tmp_path):
    # Group ranks (0, 1, 2) are global ranks (1, 2, 3); dst is global rank 2 (group rank 1):
    # every writer, owner and zone is named in the right numbering, or bytes land wrong.
    values = assert_all_ok(run_ranks(_subgroup_export, 4, str(tmp_path), timeout=180))
    assert values[0] is None
    names = sorted(os.listdir(tmp_path / "dst"))
    assert names == sorted(os.listdir(tmp_path / "all")) and len(names) > 2
    for name in names:
        assert (tmp_path / "all" / name).read_bytes() == (tmp_path / "dst" / name).read_bytes()
    got = read_checkpoint(tmp_path / "all")
    assert sorted(got) == ["fsdp", "own1", "own2", "own3", "plain", "rep", "tp"]
    for r in (1, 2, 3):
        assert torch.equal(got[f"own{r}"], values[r][f"own{r}"])
        for k in ("fsdp", "tp", "rep", "plain"):
            assert torch.equal(got[k], values[r][k]), (r, k)


def _fails_first_while_others_write(out, how, victim):
    """``victim`` fails at its first write of its own bytes (a full disk, or a Ctrl-C; dst
    writes its own in a thread beside its receives); the other two write theirs slowly
    (each message a pause): they must stop writing, not finish."""
    import signal
    import time

    r = dist.get_rank()
    calls = []
    real = E.FileSink.write_middles

    def write_middles(self, data, rows):
        calls.append(int(data.numel()))
        if r == victim:
            if how == "interrupt":  # the deferred Ctrl-C: raised in the agreeing round
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise OSError(28, "No space left on device")
        else:
            time.sleep(0.1)
        return real(self, data, rows)

    E.FileSink.write_middles = write_middles
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # 3 x 24 MiB, each rank's block 8 MiB: written in 64 KiB messages, 128 per tensor a rank
    state = {k: distribute_tensor(torch.randn(3072, 2048), mesh, [Shard(0)])
             for k in ("a", "b", "c")}
    try:
        dx.export_hf_checkpoint(state, out, chunk_bytes=2**16, writers="all")
        outcome = ("ok",)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included
        outcome = ("raised", type(exc).__name__, str(exc))
    return outcome, len(calls), dx.all_reduce("after", lambda: 1, sum)


@pytest.mark.parametrize("how, victim", [("disk full", 1), ("interrupt", 1), ("disk full", 0)])
def test_a_rank_failing_in_its_own_writes_stops_its_peers_own_writes(how, victim, tmp_path):
    # Each rank's own writes are waited on by no peer; the failure is agreed in the round
    # after them. Without the stop flag the other two would write all 384 of their
    # messages (38 s of pauses) before raising; they stop within a few.
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier checkpoint")
    values = assert_all_ok(run_ranks(_fails_first_while_others_write, 3, str(out), how,
                                     victim, timeout=120))
    cause = "KeyboardInterrupt" if how == "interrupt" else "OSError"
    assert values[victim][0][:2] == ("raised", cause), values[victim]
    for r in {0, 1, 2} - {victim}:
        outcome, calls, after = values[r]
        assert outcome[:2] == ("raised", "RuntimeError") and \
            f"rank {victim} failed with {cause}" in outcome[2], outcome
        assert calls < 40, (r, calls)  # (one flag read per 50 ms: a few messages at most)
    assert all(after == 3 for _outcome, _calls, after in values)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"an earlier checkpoint"
    assert not [n for n in os.listdir(tmp_path) if "dext" in n]
