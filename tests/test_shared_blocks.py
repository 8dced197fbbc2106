"""The shared blocks of the files (``writers="all"``): each 4 KiB block that two ranks' runs
share owned by the holder of most of its bytes (plan/block_owners.py) and its fragments
moved there (transport/shared_blocks.py) -- planned in one process at a simulated world of
1024, and written on real gloo ranks, with malformed tables, deaths and full disks."""

from __future__ import annotations

import itertools
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
from distributed_ext.export.plan import holdings as export_holdings

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")
from test_writers import (  # noqa: E402
    _blocks_written,
    _fragments,
    _merge_adjacent,
    _recording_writes,
)


@pytest.mark.parametrize("shape, block, base", [
    ((1000, 300), E.Block((333, 0), (400, 300)), 77),  # a Shard(0) block: one long run
    ((64, 5000), E.Block((0, 1200), (64, 2500)), 4096 * 3 + 5),  # Shard(1): 64 rows
    ((64, 1024), E.Block((0, 0), (64, 1024)), 8192),  # aligned: no edges at all
])
def test_a_writers_middles_and_edges_cover_its_runs_once(shape, block, base):
    # What a joined writer writes itself (the aligned blocks inside each row of its
    # messages) and what goes to the blocks' owners (edge_table) cover each byte of its runs once,
    # and no aligned block is in both; chunk-split rows included.
    from distributed_ext.export.plan.messages import _rows, edge_table, pack

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


def test_one_rank_deals_its_shared_blocks_at_a_simulated_world_of_1024():
    # With every rank writing, what one rank plans of the shared blocks at world 1024 with
    # 100k Shard(0) tensors whose runs (132 KB a rank) are long: its own runs' ends (two
    # fragments each) and the ranks they are dealt to -- O(its pieces), never the world's
    # 204.8M fragments (dealt out, each rank plans ~1/1024 of them: RESULTS.md).
    import array
    import tracemalloc

    from distributed_ext.export.plan import entries as export_entries
    from distributed_ext.export.plan import pieces as export_pieces
    from distributed_ext.export.plan.messages import edge_table
    from distributed_ext.export.transport import prepare
    from distributed_ext.export.transport import shared_blocks as edges

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


def test_a_shared_block_is_owned_by_the_holder_of_most_of_its_bytes():
    # One process, the planner alone: one file of 41960 bytes, a 100-byte header, then one
    # entry; 3 ranks' fragments of its shared blocks (file offsets).
    from distributed_ext.export.plan import block_owners as owners

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
    from distributed_ext.export.transport import shared_blocks as edges

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
        # Rank 0 names rank 1: from the agreed round, or, where rank 1 planned some of rank
        # 0's fragments, on their answer's arrival.
        assert (values[0][0][:2] == ("raised", "RuntimeError") and
                "rank 1 failed with RuntimeError: planning failed here" in values[0][0][2]) or \
            (values[0][0][:2] == ("raised", "ValueError") and
             "rank 1 failed to plan the owners of the shared blocks dealt to it" in
             values[0][0][2]), values
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

    from distributed_ext.export.transport import shared_blocks as edges

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


@pytest.mark.parametrize("world", [3, 5])
def test_owners_planned_by_the_ranks_blocks_are_dealt_to_equal_one_plan_of_them_all(world):
    # One process: the ranks' fragments (Shard(0) runs of two entries sharing one list of
    # pieces at different alignments, column blocks of many long runs, a file's end), dealt
    # out by block; each rank's plan of what it was dealt, put together, equals the plan of
    # every fragment at once (owners, and receipts row for row in their order), and each
    # rank plans only a part of them.
    from distributed_ext.export.plan import block_owners as owners
    from distributed_ext.export.plan.messages import edge_table
    from distributed_ext.export.transport import prepare
    from distributed_ext.export.transport import shared_blocks as edges

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
