"""The export's pure plan in one process: blocks that tile a tensor, runs as arithmetic,
the header safetensors writes, entries refused by key, and each rank's plan equal to the
whole plan."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from harness import assert_all_ok, run_ranks

from distributed_ext import export as E

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


@pytest.mark.parametrize("sizes, chunk, expected", [
    ([1024] * 5, 4096, [[1024] * 4, [1024]]),  # small pieces packed, up to a chunk
    ([3 * 2**20, 512, 512], 16 * 2**20, [[3 * 2**20], [512, 512]]),  # over PACK_BYTES: alone
    ([10_000, 100, 0, 100], 4096, [[4096], [4096], [1808], [100, 100]]),  # large: in chunks
    ([0], 4096, []),
])
def test_plan_messages_packs_small_pieces_and_never_plans_an_empty_message(sizes, chunk,
                                                                          expected):
    items = []
    for i, n in enumerate(sizes):
        e = E.Entry(f"k{i}", torch.uint8, (n,))
        p = E.Piece(1, E.Block((0,), (n,)), n, e.key)
        e.pieces.append(p)
        items.append((e, p))
    messages = E.plan_messages(items, chunk)
    assert [[seg[3] for seg in m] for m in messages] == expected
    assert all(m for m in messages)
    # Every byte of every piece exactly once, in order.
    flat = [(seg[0].key, seg[2], seg[3]) for m in messages for seg in m]
    for key in {k for k, _s, _n in flat}:
        spans = [(s, n) for k, s, n in flat if k == key]
        assert [s for s, _n in spans] == list(itertools.accumulate(
            [0] + [n for _s, n in spans[:-1]]))


@pytest.mark.parametrize("blocks, shape, exact", [
    ([((0,), (6,)), ((6,), (4,))], (10,), True),
    ([((0,), (6,)), ((4,), (4,))], (10,), False),  # the counts add up (10), yet overlap
    ([((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (4, 3))], (4, 6), True),  # not a grid
    ([((0, 0), (2, 3)), ((1, 0), (2, 3)), ((0, 3), (4, 3))], (5, 6), False),
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], (4, 4), True),
    ([((0,), (5,)), ((6,), (5,))], (10,), False),  # outside the tensor
])
def test_blocks_must_tile_the_tensor_exactly(blocks, shape, exact):
    assert E._tiles_exactly([E.Block(o, s) for o, s in blocks], shape) is exact


def test_runs_are_arithmetic_and_every_segment_maps_to_the_right_bytes():
    import random
    import tracemalloc

    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        offset = tuple(rng.randint(0, s - 1) for s in shape)
        size = tuple(rng.randint(1, s - o) for s, o in zip(shape, offset))
        itemsize = rng.choice([1, 2, 4])
        block = E.Block(offset, size)
        runs = E.block_runs(block, shape, itemsize)
        # The reference: the block's elements in its row-major order, by torch's indexing.
        want = torch.arange(math.prod(shape)).reshape(shape)[
            tuple(slice(o, o + n) for o, n in zip(offset, size))].reshape(-1)
        nbytes = block.numel * itemsize
        cuts = sorted(rng.sample(range(1, nbytes), min(3, nbytes - 1))) + [nbytes]
        seen, start = [], 0
        for cut in cuts:  # as messages split it
            for where, at, m in runs.pieces(start, cut - start, start):
                seen += [(at + k, where + k) for k in range(m)]
            # ... and as a table (the same rows, computed with tensors)
            assert runs.table(start, cut - start, start + 7).tolist() == \
                [[w, a + 7, m] for w, a, m in runs.pieces(start, cut - start, start)]
            start = cut
        assert sorted(a for a, _w in seen) == list(range(nbytes))
        for at, where in seen:
            assert where // itemsize == want[at // itemsize] and where % itemsize == at % itemsize
    # An expert-TP block of 65536 runs is a few integers, not a list of them.
    tracemalloc.start()
    runs = E.block_runs(E.Block((0, 0, 512), (64, 1024, 512)), (64, 1024, 2048), 2)
    _current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(runs) == 65536 and peak < 16 * 1024, peak


def test_the_header_is_the_json_safetensors_writes():
    # Quotes, backslashes, non-ASCII, a scalar, an empty tensor: the text json.dumps makes
    # of the same header dict, which safetensors parses back.
    specs = [("a.b", torch.float32, (3, 4)), ('we"ird\\kéy', torch.bfloat16, ()),
             ("ünï", torch.int8, (0, 5)), ("x" * 300, torch.float64, (1,))]
    entries = [E.Entry(k, d, s, index=i) for i, (k, d, s) in enumerate(specs)]
    head, offsets = E.safetensors_header(entries)
    meta, pos = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        meta[e.key] = {"dtype": E.SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    text = json.dumps(meta, separators=(",", ":"))
    assert head[8:].rstrip(b" ").decode() == text
    assert int.from_bytes(head[:8], "little") == len(head) - 8 and len(head) % 8 == 0
    assert offsets["a.b"] == len(head)


def test_whole_block_tensors_come_first_and_the_data_starts_at_a_block(tmp_path):
    # Tensors of whole 4 KiB blocks first, the odd-sized (and empty) ones after them, each
    # group in order; the header padded so that the data starts at a block boundary; the
    # file reads back as safetensors with every tensor at its offsets.
    from safetensors import safe_open

    specs = [("scale", torch.float32, ()), ("w1", torch.bfloat16, (4, 1024)),
             ("norm", torch.bfloat16, (300,)), ("empty", torch.float32, (0,)),
             ("w2", torch.float32, (2, 1024))]
    entries = [E.Entry(k, d, s, index=i) for i, (k, d, s) in enumerate(specs)]
    head, offsets = E.safetensors_header(entries)
    assert len(head) % 4096 == 0 and int.from_bytes(head[:8], "little") == len(head) - 8
    assert [offsets[k] - len(head) for k in ("w1", "w2", "scale", "norm", "empty")] == \
        [0, 8192, 16384, 16388, 16988]
    g = torch.Generator().manual_seed(0)
    values = {k: torch.randn(s, generator=g).to(d) for k, d, s in specs}
    data = bytearray(head) + bytearray(16988)
    for e in entries:
        raw = values[e.key].reshape(-1).view(torch.uint8).numpy().tobytes()
        data[offsets[e.key] : offsets[e.key] + len(raw)] = raw
    (tmp_path / "m.safetensors").write_bytes(bytes(data))
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(values)
        for k, v in values.items():
            assert torch.equal(f.get_tensor(k), v), k


def _described_refusals():
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    good = DTensor.from_local(torch.ones(4), mesh, [Shard(0)])
    cases = {
        "shard shape": DTensor.from_local(torch.ones(3), mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size([4]), stride=(1,)),
        "negated shard": DTensor.from_local(torch.ones(4, dtype=torch.complex64).conj().imag,
                                            mesh, [Shard(0)]),
        "sparse": torch.ones(3).to_sparse(),
        "meta": torch.empty(3, device="meta"),
        "not a tensor": 3.0,
        "dtype": torch.ones(2, dtype=torch.complex128),
    }
    out = {}
    for name, bad in cases.items():
        # After entries of the same signature, so that a check made once per signature
        # cannot let a later entry through.
        state = {"a": good, "b": torch.ones(3), "bad": bad}
        try:
            E.describe_state(state)
            out[name] = ("ok",)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[name] = (type(exc).__name__, str(exc))
    local: dict = {}
    described = E.describe_state({"a": good, "b": torch.ones(3)}, None, local)
    return out, described.sig_ids, local["a"] is good._local_tensor, local["b"].tolist()


def test_describe_refuses_each_entry_it_cannot_write_naming_its_key():
    (out, ids, same, b), = assert_all_ok(run_ranks(_described_refusals, 1))
    expected = {
        "shard shape": ("ValueError", "its local shard has shape (3,), but its placements say (4,)"),
        "negated shard": ("ValueError", "lazily negated view"),
        "sparse": ("TypeError", "sparse_coo or meta tensor"),
        "meta": ("TypeError", "meta tensor"),
        "not a tensor": ("TypeError", "is a float, not a tensor"),
        "dtype": ("TypeError", "complex128, which safetensors cannot store"),
    }
    for name, (kind, text) in expected.items():
        assert out[name][0] == kind and text in out[name][1] and "'bad'" in out[name][1], \
            (name, out[name])
    assert len(ids) == 2 * 4 and same and b == [1.0, 1.0, 1.0]


def test_planning_every_rank_at_once_equals_planning_each_rank_alone():
    # dst plans every sender's stream in one pass; each sender plans its own: the same
    # messages, or a sender's bytes would land at the wrong offsets.
    g = torch.Generator().manual_seed(3)
    entries = []
    for i in range(200):
        e = E.Entry(f"k{i}", torch.uint8, (0,), index=i)
        for r in range(3):
            n = int(torch.randint(0, 9000, (1,), generator=g))
            e.pieces.append(E.Piece(r, E.Block((0,), (n,)), n, e.key))
        entries.append(e)
    pairs = [(e, p) for e in entries for p in e.pieces]
    from distributed_ext.export.plan.messages import plan_streams

    together = plan_streams(iter(pairs), 4096, 3)
    for r in range(3):
        alone = E.plan_messages([(e, p) for e, p in pairs if p.rank == r], 4096)
        assert together[r] == alone and alone, r


def test_a_transform_computes_rows_a_few_mib_at_a_time_at_the_sources_own_cuts():
    from distributed_ext.export.plan.types import TRANSFORM_BYTES, Transform

    calls = []

    def double(rows, first):  # one written int8 row per source row pair: doubled
        calls.append((first, rows.shape[0]))
        return (rows[::2] * 2).to(torch.int8)

    cols = 1024  # 4 KiB rows of float32
    rows = torch.arange(3 * TRANSFORM_BYTES // (4 * cols) * cols, dtype=torch.float32) % 50
    rows = rows.reshape(-1, cols)
    first = 6  # (cuts fall on the source's own multiples of the chunk)
    t = Transform(double, 2, 1, "test", torch.float32, tuple(rows.shape))
    out = t.rows_of(rows, first)
    assert torch.equal(out, (rows[::2] * 2).to(torch.int8))
    chunk = TRANSFORM_BYTES // (4 * cols)
    assert len(calls) == 4 and all(n <= chunk for _f, n in calls), calls
    assert all((f + n) % chunk == 0 for f, n in calls[:-1]), calls
    assert sum(n for _f, n in calls) == rows.shape[0] and calls[0][0] == first, calls


@pytest.mark.parametrize("shift", [0, 1, 4000])
def test_a_transform_computes_its_rows_at_the_address_a_direct_write_wants(shift):
    # A rank's quantized rows are most of what it writes: computed where the file offset's
    # alignment wants them, a direct write takes them without the bounce copy.
    from distributed_ext._direct_io import ALIGN, aligned_empty
    from distributed_ext.export.plan.types import Transform

    def halve(rows, first):
        return (rows // 2).to(torch.int8)

    for n in (3, 700):  # one call of fn, and several
        rows = (torch.arange(n * 1024, dtype=torch.float32) % 90).reshape(n, 1024)
        t = Transform(halve, 1, 1, "test", torch.float32, tuple(rows.shape))
        out = t.rows_of(rows, 5, lambda nbytes: aligned_empty(nbytes, shift))
        assert out.data_ptr() % ALIGN == shift, (n, out.data_ptr() % ALIGN)
        assert torch.equal(out, (rows // 2).to(torch.int8))
    wide = Transform(lambda rows, first: rows * 2, 1, 1, "test", torch.float32, (3, 8))
    # (a float32 cannot start at an odd address: computed where torch puts it)
    got = wide.rows_of(torch.ones(3, 8), 0, lambda nbytes: aligned_empty(nbytes, 1))
    assert torch.equal(got, torch.full((3, 8), 2.0))


def test_a_transform_whose_fn_computes_into_given_bytes_computes_every_row_at_once():
    # (the FP8 table holds no temporaries: no output of its own per 1 MiB of rows, no copy)
    from distributed_ext._direct_io import aligned_empty
    from distributed_ext.export.plan.types import Transform

    class Halve:
        calls: list[tuple[int, int]] = []

        def __call__(self, rows, first):
            raise AssertionError("computed in pieces, not into the bytes given")

        def rows_into(self, rows, first, empty):
            self.calls.append((first, rows.shape[0]))
            out = empty(rows.numel()).view(torch.int8).view(rows.shape)
            out.copy_((rows // 2).to(torch.int8))
            return out

    rows = (torch.arange(700 * 1024, dtype=torch.float32) % 90).reshape(700, 1024)
    fn = Halve()
    t = Transform(fn, 1, 1, "test", torch.float32, tuple(rows.shape))
    out = t.rows_of(rows, 5, lambda nbytes: aligned_empty(nbytes, 100))
    assert fn.calls == [(5, 700)] and out.data_ptr() % 4096 == 100
    assert torch.equal(out, (rows // 2).to(torch.int8))


def test_a_computed_message_is_staged_where_its_direct_write_wants_it():
    from distributed_ext._direct_io import ALIGN
    from distributed_ext.export.plan.blocks import Block
    from distributed_ext.export.plan.types import Entry, Piece, Transform
    from distributed_ext.export.transport.stager import _Stager

    source = (torch.arange(64 * 512, dtype=torch.float32) % 100).reshape(64, 512)
    t = Transform(lambda rows, first: rows.to(torch.int8), 1, 1, "test",
                  torch.float32, (64, 512))
    entry = Entry("w", torch.int8, (64, 512), transform=t, source="w")
    piece = Piece(0, Block((0, 0), (64, 512)), 64 * 512, "w", src=Block((0, 0), (64, 512)))
    stager = _Stager({"w": source}, 2**20, torch.device("cpu"), None)
    for start, n, shift in ((0, 64 * 512, 3), (1024, 4096, 2048), (700, 100, 0)):
        data, _keep = stager.stage([(entry, piece, start, n)], 0, shift)
        assert data.data_ptr() % ALIGN == shift, (start, shift)
        want = source.to(torch.int8).reshape(-1)[start : start + n]
        assert torch.equal(data.view(torch.int8), want), (start, shift)


def test_messages_written_direct_are_staged_in_slots_of_huge_pages():
    # A direct write goes to the device in one segment per physically contiguous range:
    # from 4 KiB pages a 1 MB write is hundreds (measured: the same bytes written ~1.7x
    # slower). Written direct, a computed message is computed into a slot of huge pages, and
    # packed small pieces are packed into one; a piece's own memory is written from there.
    from test_direct_io import huge_pages_granted, huge_pages_of

    from distributed_ext._direct_io import ALIGN, HUGE_PAGE
    from distributed_ext.export.plan.blocks import Block
    from distributed_ext.export.plan.types import Entry, Piece, Transform
    from distributed_ext.export.transport.stager import _Stager

    source = (torch.arange(512 * 1024, dtype=torch.float32) % 100).reshape(512, 1024)
    own = torch.randn(1024, 1024)
    small = (torch.arange(100, dtype=torch.float32), torch.arange(50, dtype=torch.float32))
    t = Transform(lambda rows, first: rows.to(torch.int8), 1, 1, "test",
                  torch.float32, (512, 1024))
    computed = Entry("w", torch.int8, (512, 1024), transform=t, source="w")
    cpiece = Piece(0, Block((0, 0), (512, 1024)), 512 * 1024, "w",
                   src=Block((0, 0), (512, 1024)))
    plain = Entry("own", torch.float32, (1024, 1024), source="own")
    opiece = Piece(0, Block((0, 0), (1024, 1024)), 4 * 2**20, "own")
    smalls = [(Entry(k, torch.float32, (v.numel(),), source=k),
               Piece(0, Block((0,), (v.numel(),)), v.nbytes, k)) for k, v in zip("ab", small)]
    state = {"w": source, "own": own, "a": small[0], "b": small[1]}
    stager = _Stager(state, 4 * 2**20, torch.device("cpu"), None)
    messages = [[(computed, cpiece, 4096, 300_000)], [(plain, opiece, 0, 4 * 2**20)],
                [(e, p, 0, p.nbytes) for e, p in smalls]]
    stager.reserve(messages)
    stager.write_direct()
    slots = stager.huge_slots
    assert slots is not None and slots.data_ptr() % HUGE_PAGE == 0
    assert slots.shape[1] % HUGE_PAGE == 0 and slots.shape[1] >= 4 * 2**20 + HUGE_PAGE
    wants = [source.to(torch.int8).reshape(-1)[4096 : 4096 + 300_000].view(torch.uint8),
             own.reshape(-1).view(torch.uint8), torch.cat(small).view(torch.uint8)]
    for k, (message, want) in enumerate(zip(messages, wants)):
        slot = slots[k % 3]
        data, _keep = stager.stage(message, k % 3, 512 * k)
        assert torch.equal(data, want), k
        if k == 1:  # (its own memory)
            assert data.data_ptr() == own.data_ptr()
            continue
        assert data.data_ptr() % ALIGN == 512 * k, k
        assert slot.data_ptr() <= data.data_ptr() < slot.data_ptr() + slot.numel(), k
    if huge_pages_granted():
        assert huge_pages_of(slots) >= 2048, huge_pages_of(slots)
    # Not written direct (a RAM filesystem, a link): the slots are torch's, the computed
    # message a buffer of its own.
    plain_stager = _Stager(state, 4 * 2**20, torch.device("cpu"), None)
    plain_stager.reserve(messages)
    data, _keep = plain_stager.stage(messages[0], 0, 0)
    assert torch.equal(data, wants[0]) and plain_stager.huge_slots is None
