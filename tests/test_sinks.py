"""The sinks: row tables written exactly into files (direct or not) and checked in memory,
and a Shard(1) layout's short runs assembled into regions and written direct."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks

import distributed_ext as dx
from distributed_ext import export as E
from distributed_ext.export.files import regions as export_regions
from distributed_ext.export.files import sinks as export_sinks

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


def _short_runs_export(out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    # Shard(1) of 2048 columns over 4 ranks: every row's run is 2 KiB (under a 4 KiB block).
    state = {f"w{i}": distribute_tensor(torch.randn(2048, 2048, generator=g), mesh, [Shard(1)])
             for i in range(4)}
    written = []
    real_commit = E.FileSink.commit

    def commit(self):
        real_commit(self)
        written.append((self.direct_bytes, self.total, self.files[0].direct_capable))

    E.FileSink.commit = commit
    dx.export_hf_checkpoint(state, out, writers="dst")
    return written, {k: v.full_tensor() for k, v in state.items()}


def test_short_runs_of_a_shard1_layout_are_assembled_and_written_direct(tmp_path):
    out = str(tmp_path / "ckpt")
    values = assert_all_ok(run_ranks(_short_runs_export, 4, out, timeout=240))
    ((direct, total, can),), full = values[0]
    assert direct > 0.99 * total if can else direct == 0, (direct, total, can)
    got = safetensors_torch.load_file(os.path.join(out, E.WEIGHTS_NAME))
    for key, tensor in full.items():
        assert torch.equal(got[key], tensor), key


def _random_rows(entries, seed, max_run=3000):
    """Every byte of ``entries`` as rows ``(index, offset, at, n)`` over one message, in a
    shuffled order (so that runs cross regions, files and each other's order)."""
    g = torch.Generator().manual_seed(seed)
    rows, at = [], 0
    for e in entries:
        off = 0
        while off < e.nbytes:
            n = min(e.nbytes - off, int(torch.randint(1, max_run, (1,), generator=g)))
            rows.append((e.index, off, at, n))
            off, at = off + n, at + n
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order], at


@pytest.mark.parametrize("direct", [False, True])
def test_file_sink_writes_a_shuffled_row_table_exactly(tmp_path, monkeypatch, direct):
    # Small regions, so that a few KiB of tensors span many of them and runs cross their
    # ends; two files; rows in random order and long runs among the short ones.
    monkeypatch.setattr(export_regions, "REGION_BYTES", 4096)
    monkeypatch.setattr(export_sinks, "SMALL_RUN", 2048)
    if not direct:
        monkeypatch.setattr(export_sinks._direct_io, "on_ram_filesystem", lambda path: True)
    shapes = [(1000,), (3, 777), (), (0, 4), (5000,), (17,)]
    entries = [E.Entry(f"t{i}", torch.float32, s, index=i) for i, s in enumerate(shapes)]
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i))
               for i, s in enumerate(shapes)]
    rows, total = _random_rows(entries, seed=1)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors] + [
        torch.empty(0, dtype=torch.uint8)])
    # ``data`` holds the entries back to back; the rows name their bytes in that layout.
    starts = list(itertools.accumulate([0] + [e.nbytes for e in entries[:-1]]))
    table = torch.tensor([(i, off, starts[i] + off, n) for i, off, _at, n in rows],
                         dtype=torch.int64)
    assert data.numel() == total
    sink = E.FileSink(str(tmp_path / "ckpt"), [entries[:3], entries[3:]])
    for part in table.split(7):  # several batches, as messages arrive
        sink.write_batch(data, part.contiguous())
    sink.commit()
    got = {}
    for name in sorted(os.listdir(tmp_path / "ckpt")):
        if name.endswith(".safetensors"):
            got.update(safetensors_torch.load_file(str(tmp_path / "ckpt" / name)))
    assert sorted(got) == sorted(e.key for e in entries)
    for e, t in zip(entries, tensors):
        assert torch.equal(got[e.key], t), e.key


def test_memory_sink_checks_every_row_against_its_entry():
    entries = [E.Entry("a", torch.float32, (4,), index=0), E.Entry("b", torch.int8, (3,), index=1)]
    sink = E.MemorySink(entries)
    data = torch.arange(19, dtype=torch.uint8)
    sink.write_batch(data, torch.tensor([[1, 0, 16, 3], [0, 0, 0, 16]], dtype=torch.int64))
    assert sink.tensors["b"].tolist() == [16, 17, 18]
    assert sink.tensors["a"].view(torch.uint8).tolist() == list(range(16))
    with pytest.raises(ValueError, match="'b': bytes \\[1, 4\\) lie outside its 3 bytes"):
        sink.write_batch(data, torch.tensor([[1, 1, 0, 3]], dtype=torch.int64))


def test_mapped_sink_writes_long_rows_with_pwrite_and_short_ones_mapped(ram_path, monkeypatch):
    # On a RAM filesystem every rank writes every row whole (``mapped``): rows from 2 KiB on
    # with one pwrite each, the shorter ones copied into the mapping; bytes exact either way.
    from distributed_ext import _direct_io

    monkeypatch.setattr(export_sinks, "MAPPED_LONG_RUN", 2048)
    shapes = [(1000,), (3, 777), (), (0, 4), (5000,), (17,)]
    entries = [E.Entry(f"t{i}", torch.float32, s, index=i) for i, s in enumerate(shapes)]
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i))
               for i, s in enumerate(shapes)]
    rows, total = _random_rows(entries, seed=2, max_run=4000)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    starts = list(itertools.accumulate([0] + [e.nbytes for e in entries[:-1]]))
    table = torch.tensor([(i, off, starts[i] + off, n) for i, off, _at, n in rows],
                         dtype=torch.int64)
    long = int(table[:, 3][table[:, 3] >= 2048].sum())
    assert 0 < long < total  # (both ways are taken)
    out = os.path.join(ram_path, "ckpt")
    sink = E.FileSink(out, [entries[:3], entries[3:]])
    sink.mapped = True
    before = _direct_io.mapped_bytes()
    for part in table.split(5):
        sink.write_middles(data, part.contiguous())
    assert _direct_io.mapped_bytes() - before == total - long
    with pytest.raises(ValueError, match="reaches past"):
        sink.write_middles(data, torch.tensor([[5, 0, 0, 4000]], dtype=torch.int64))
    sink.commit()
    got = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            got.update(safetensors_torch.load_file(os.path.join(out, name)))
    assert sorted(got) == sorted(e.key for e in entries)
    for e, t in zip(entries, tensors):
        assert torch.equal(got[e.key], t), e.key
