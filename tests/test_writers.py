"""writers="all" on real gloo ranks: every rank writes its own bytes into the files the single
writer makes (byte for byte), each 4 KiB block by one rank -- the holder of most of its
bytes (shared blocks: :mod:`plan.block_owners`, :mod:`transport.shared_blocks`; TP rows by
region: :mod:`plan.tp_regions`) -- and the planners' pure functions in one process, up to a
simulated world of 1024."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, outcome, run_ranks
from hf_models import read_checkpoint
from test_export import (  # (skips where transformers is missing, as that module does)
    _counting_sends,
)

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export.plan import holdings as export_holdings

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

# -- writers="all": every rank writes its own bytes --------------------------------------------


def _written_bytes() -> int:
    """Bytes this process passed to write calls so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _recording_writes(fn):
    """Runs ``fn()``; the ``(file name, offset, nbytes)`` of every write this rank made to a
    checkpoint file (pwrite, direct or not, the native batched writes and those queued to
    the native writer thread)."""
    from distributed_ext import _direct_io, _native

    writes, real_pwrite, real_segments = [], _direct_io._pwrite_fully, _native.pwrite_segments
    real_submit = _direct_io.WriteQueue.submit

    def name(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def pwrite(fd, view, offset):
        writes.append((name(fd), offset, len(view)))
        return real_pwrite(fd, view, offset)

    def segments(fd, table):
        rows = table.tolist() if isinstance(table, torch.Tensor) else table
        writes.extend((name(fd), offset, n) for _src, offset, n in rows)
        return real_segments(fd, table)

    def submit(queue, file, offset, data):
        writes.append((os.path.basename(file.path), offset, data.numel()))
        return real_submit(queue, file, offset, data)

    _direct_io._pwrite_fully, _native.pwrite_segments = pwrite, segments
    _direct_io.WriteQueue.submit = submit
    try:
        fn()
    finally:
        _direct_io._pwrite_fully, _native.pwrite_segments = real_pwrite, real_segments
        _direct_io.WriteQueue.submit = real_submit
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
        from distributed_ext.export.files import writers as export_writers

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

    from distributed_ext.export.plan import entries as export_entries
    from distributed_ext.export.plan import pieces as export_pieces
    from distributed_ext.export.plan.messages import edge_table, pack

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


def _both_writers_2d(base, short_run):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from distributed_ext.export.plan import block_owners as export_owners

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
    # ranks by turns: the first at or after the block's number, mod the world).
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
            owner = max(by_rank, key=lambda r: (by_rank[r], r == 0, -((r - blk) % 4)))
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
    # with 512 every block is a tie: dst's in the first half, by turns in the second.
    assert last - first >= 1000, (base, last - first)
    assert owners == ({0, 2, 3} if short_run else {0, 1, 2, 3}), (base, owners)
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
    from distributed_ext.export.plan import entries as export_entries
    from distributed_ext.export.plan import pieces as export_pieces

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
    from distributed_ext.export.plan.messages import _rows, edge_table

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


def _random_layouts(base, seed, ram):
    """A seeded mix of layouts in one checkpoint (1-D or 2-D meshes, Shard(0/1/2) and
    Replicate in any combination, plain tensors, uneven and empty shards, eight dtypes, a
    random file size and chunk size), written with both writers, and by every rank into
    ``ram`` (a RAM filesystem: the files mapped, nothing over the link; moved beside the
    others as "ram"); rank 0 saves torch's own ``full_tensor()`` of each key beside them."""
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
    mapped = os.path.join(ram, "ram")
    sent = _counting_sends(lambda: dx.export_hf_checkpoint(
        state, mapped, writers="all", max_shard_size=max_shard_size, chunk_bytes=chunk))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(base, "full_tensors.pt"))
        shutil.move(mapped, os.path.join(base, "ram"))
    return dims, max_shard_size, chunk, sent


@pytest.mark.parametrize("world, seed", [(2, 3), (3, 1), (4, 7), (4, 8)])
def test_random_layouts_are_written_as_full_tensor_holds_them_by_either_writers(world, seed,
                                                                              tmp_path, ram_path):
    values = assert_all_ok(run_ranks(_random_layouts, world, str(tmp_path), seed, ram_path,
                                     timeout=240))
    names = sorted(os.listdir(tmp_path / "dst"))
    assert names == sorted(os.listdir(tmp_path / "all")), values[0]
    assert names == sorted(os.listdir(tmp_path / "ram")), values[0]
    for name in names:
        want = (tmp_path / "dst" / name).read_bytes()
        assert (tmp_path / "all" / name).read_bytes() == want, (name, values[0])
        assert (tmp_path / "ram" / name).read_bytes() == want, ("mapped", name, values[0])
    # Every rank wrote every byte it holds into the mapped files: none crossed the link.
    assert [v[3] for v in values] == [0] * world, values
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

    def write_middles(self, data, rows, **kw):
        calls.append(int(data.numel()))
        if r == victim:
            if how == "interrupt":  # the deferred Ctrl-C: raised in the agreeing round
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise OSError(28, "No space left on device")
        else:
            time.sleep(0.1)
        return real(self, data, rows, **kw)

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
