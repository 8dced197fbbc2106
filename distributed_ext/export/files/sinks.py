"""Where dst puts the bytes: shard files written at their offsets (short runs assembled into
regions, long ones direct), or full CPU tensors in memory."""

from __future__ import annotations

import array
import collections
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from distributed_ext import _direct_io, _native
from distributed_ext.export.files.publish import (
    _STAGE_TAG,
    ExportLock,
    Stage,
    _config_texts,
    _fsync_path,
    _remove,
    _write_file,
)
from distributed_ext.export.files.regions import Regions
from distributed_ext.export.plan.messages import (
    ROW_AT,
    ROW_ENTRY,
    ROW_NBYTES,
    ROW_OFFSET,
    aligned_middles,
)
from distributed_ext.export.plan.quantized import Quantized
from distributed_ext.export.plan.safetensors import INDEX_NAME, WEIGHTS_NAME, safetensors_header
from distributed_ext.export.plan.types import Entry

# Runs shorter than this are written in one native call per file and message (a direct write
# of them would gain nothing: at most a block or two of them is aligned).
SMALL_RUN = 64 * 2**10


# On a RAM filesystem (the files mapped: :attr:`FileSink.mapped`), rows of at least this many
# bytes are written with one ``pwrite`` each, the shorter ones copied into the mapping. The
# kernel fills fresh pages in its write path, where a mapped copy of them takes a fault per
# 4 KiB page (and the mapping's setup and TLB teardown): the quantized FP8 export on tmpfs
# was faster so than all mapped (docs/measurements.md). Short rows (a TP layout's 2 KiB) stay mapped:
# a syscall each would cost more than their copy.
MAPPED_LONG_RUN = 256 * 2**10


# Shard files a sink keeps open at once (each holds two descriptors); the rest are reopened
# when written to, so 10,000 shards need no more than the common 1024-descriptor limit.
OPEN_FILES = 32


class FileSink:
    """A checkpoint's files, written into a :class:`~files.publish.Stage`
    at their offsets and published whole by :meth:`commit` (a crash at any instant leaves the
    earlier checkpoint or the new one, never a mix; ``config.json`` is published with the
    weights). Short runs are assembled into aligned regions (one write each, direct where the
    filesystem takes it), long ones written as they come; at most ``OPEN_FILES`` are open.
    """

    def __init__(self, directory: str, files: list[list[Entry]], model: nn.Module | None = None,
                 join: str | None = None, quantized: Quantized | None = None) -> None:
        """``join``: the stage another rank (dst) made, whose files this rank writes its own
        bytes into (``writers="all"``); it neither creates, nor publishes, nor removes them.
        ``quantized``: a ModelOpt-quantized model's JSON files (:mod:`plan.quantized`)."""
        # The configs: serialized by dst, which writes them (a joined writer never does).
        self.texts = _config_texts(model, quantized) if join is None else {}
        # A joined writer writes only the aligned blocks inside its runs (write_middles) and
        # the shared blocks it owns (write_edges), and makes durable only the files it wrote.
        self.joined = join is not None
        self._join = join
        # Every rank writes every byte it holds through a shared mapping of the files (a RAM
        # filesystem, every rank writing: :func:`~files.writers.resolve_writers`); set once
        # agreed, before anything is written.
        self.mapped = False
        self._written: set[_direct_io.DirectFile] = set()
        n = len(files)
        self.names = [WEIGHTS_NAME] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.stage = None if join is not None else Stage(
            directory, (*self.names, *((INDEX_NAME,) if n > 1 else ()), *self.texts))
        where = self.stage.path if self.stage is not None else join
        self.files: list[_direct_io.DirectFile] = []
        # Per entry index: its file's number and its data's offset in that file.
        count = sum(len(group) for group in files)
        file_of, base_of = array.array("q", [0]) * count, array.array("q", [0]) * count
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[_direct_io.DirectFile, int] = \
            collections.OrderedDict()  # open files -> writers using each now
        self.heads: dict[Any, bytes] = {}
        # Short runs gathered into regions; a joined writer's start empty (dst wrote the
        # headers: their bytes are not its to write).
        self._regions = Regions({} if self.joined else self.heads, self._opened, self._written)
        try:
            for number, (name, group) in enumerate(zip(self.names, files)):
                head, offsets = safetensors_header(group)
                size = len(head) + sum(e.nbytes for e in group)
                file = _direct_io.DirectFile(os.path.join(where, name), size,
                                             create=join is None)
                self.files.append(file)
                if join is None:
                    file.write(0, torch.frombuffer(bytearray(head), dtype=torch.uint8))
                self.heads[file] = head  # the first region's assembly starts from it
                file.close()  # reopened when written to: a bounded number open at once
                for e in group:
                    file_of[e.index], base_of[e.index] = number, offsets[e.key]
                    self.weight_map[e.key] = name
                    self.total += e.nbytes
        except BaseException:
            self.abort()  # no temporary file outlives a failed start
            raise
        self._file_of = torch.frombuffer(file_of, dtype=torch.int64) if count else \
            torch.empty(0, dtype=torch.int64)
        self._base_of = torch.frombuffer(base_of, dtype=torch.int64) if count else \
            torch.empty(0, dtype=torch.int64)

    @contextlib.contextmanager
    def _opened(self, file: _direct_io.DirectFile) -> Iterator[None]:
        """``file`` open for the block; the least recently used idle one is closed when
        ``OPEN_FILES`` are open (writers from two threads: dst's own pieces, received)."""
        with self._lock:
            users = self._open.pop(file, None)
            if users is None:
                while len(self._open) >= OPEN_FILES:
                    idle = next((f for f, u in self._open.items() if u == 0), None)
                    if idle is None:
                        break
                    del self._open[idle]
                    idle.close()
                file.reopen()
                users = 0
            self._open[file] = users + 1  # most recently used: last
        try:
            yield
        finally:
            with self._lock:
                self._open[file] -= 1

    @property
    def takes_queue(self) -> bool:
        """Whether its long runs are written direct, so that a writer may queue them to a
        native thread (:meth:`write_batch` and :meth:`write_middles` take ``queue``:
        :class:`~distributed_ext._direct_io.WriteQueue`). Not on a RAM filesystem: there
        every write is a copy in the caller's thread, and a writing thread of its own
        overlaps it with the staging (:func:`~transport.transfer._write_staged_ahead`)."""
        return not self.mapped and bool(self.files) and self.files[0].direct_capable

    def write_batch(self, data: torch.Tensor, rows: torch.Tensor,
                    queue: _direct_io.WriteQueue | None = None) -> None:
        """Writes ``data[at : at + n]`` at ``offset`` of each row's entry (a :func:`_rows`
        table): runs under ``SMALL_RUN`` bytes are assembled into their file's regions (a
        few tensor operations and one native copy per region, however many runs), larger
        ones each through :meth:`DirectFile.write` (direct where it can; with ``queue``,
        their direct parts queued there, ``data`` kept alive by the caller until it is
        waited for)."""
        assert not self.joined, "a joined writer writes middles and edges only"
        self._write_rows(data, rows, queue)

    def _write_rows(self, data: torch.Tensor, rows: torch.Tensor,
                    queue: _direct_io.WriteQueue | None = None) -> None:
        """:meth:`write_batch` (also a joined writer's shared blocks: :meth:`write_edges`)."""
        if not len(rows):
            return
        idx = rows[:, ROW_ENTRY]
        offset = self._base_of[idx] + rows[:, ROW_OFFSET]
        fid = self._file_of[idx]
        at, n = rows[:, ROW_AT], rows[:, ROW_NBYTES]
        small = n < SMALL_RUN
        if not bool(small.all()):
            for i in (~small).nonzero().flatten().tolist():
                a = int(at[i])
                self._write_run(self.files[int(fid[i])], int(offset[i]), data[a : a + int(n[i])],
                                queue)
            offset, fid, at, n = offset[small], fid[small], at[small], n[small]
            if not len(n):
                return
        src = at + data.data_ptr()  # data is held by the caller until this returns
        first, last = int(fid.min()), int(fid.max())
        if first == last:  # a message's rows: mostly in one file
            self._regions.assemble(self.files[first], src, offset, n)
            return
        for number in torch.unique(fid).tolist():
            mine = fid == number
            self._regions.assemble(self.files[number], src[mine], offset[mine], n[mine])

    def write_middles(self, data: torch.Tensor, rows: torch.Tensor,
                      queue: _direct_io.WriteQueue | None = None) -> None:
        """Writes only the whole aligned blocks inside each row (a :func:`_rows` table) of
        the runs a rank writes itself (``writers="all"``); the partial blocks at a row's
        ends are their owners' (:meth:`write_edges`; they get their bytes:
        :func:`~plan.messages.edge_table`). A long row's middle is one
        write, direct where the filesystem takes it; the middles of rows under
        ``SMALL_RUN`` (a piece's last message; with a lower ``owners.SHORT_RUN``, the
        rows of a ``Shard(1)``/TP layout between other ranks' runs) go through the page
        cache in one native call per file -- a direct write each would cost a device round
        trip per few blocks. ``queue``: as :meth:`write_batch`."""
        if not len(rows):
            return
        if self.mapped:
            self._write_mapped(data, rows)
            return
        idx = rows[:, ROW_ENTRY]
        fid, offset = self._file_of[idx], self._base_of[idx] + rows[:, ROW_OFFSET]
        at, n = rows[:, ROW_AT], rows[:, ROW_NBYTES]
        lo, hi = aligned_middles(offset, n, _direct_io.ALIGN)
        some = hi > lo
        small = some & (n < SMALL_RUN)
        if bool(small.any()):
            # data is held by the caller until this returns
            table = torch.stack((at[small] + lo[small] + data.data_ptr(),
                                 offset[small] + lo[small], (hi - lo)[small]), 1)
            self._write_segments(fid[small], table)
        for i in (some & ~small).nonzero().flatten().tolist():
            a, b, start = int(lo[i]), int(hi[i]), int(at[i])
            self._write_run(self.files[int(fid[i])], int(offset[i]) + a,
                            data[start + a : start + b], queue)

    def _write_mapped(self, data: torch.Tensor, rows: torch.Tensor) -> None:
        """:meth:`write_middles` where the files are mapped (:attr:`mapped`): every row
        whole, shared blocks included (on a RAM filesystem two ranks filling one page fill
        the same memory), rows of ``MAPPED_LONG_RUN`` bytes or more with one ``pwrite``
        each, the others one native copy per file into its mapping (rows of a TP layout's 2
        KiB included: no syscall per run, and the ranks filling one file do not take turns
        on its lock). Rows are checked against ``data``; the file checks its own bounds."""
        idx = rows[:, ROW_ENTRY]
        fid, offset = self._file_of[idx], self._base_of[idx] + rows[:, ROW_OFFSET]
        at, n = rows[:, ROW_AT], rows[:, ROW_NBYTES]
        if bool(((at < 0) | (at + n > data.numel())).any()):
            raise ValueError(f"a message's rows reach past its {data.numel()} bytes")
        long = n >= MAPPED_LONG_RUN
        if bool(long.any()):
            for i in long.nonzero().flatten().tolist():
                file, start, where, size = (self.files[int(fid[i])], int(at[i]),
                                            int(offset[i]), int(n[i]))
                if where < 0 or where + size > file.size:  # (as the mapping checks its own)
                    raise ValueError(f"a row of {size} bytes at offset {where} reaches past "
                                     f"{file.path}'s {file.size} bytes")
                self._write_run(file, where, data[start : start + size])
            short = ~long
            fid, offset, at, n = fid[short], offset[short], at[short], n[short]
            if not len(n):
                return
        # data is held by the caller until this returns
        self._write_segments(fid, torch.stack((at + data.data_ptr(), offset, n), 1),
                             mapped=True)

    def _write_run(self, file: _direct_io.DirectFile, offset: int, data: torch.Tensor,
                   queue: _direct_io.WriteQueue | None = None) -> None:
        """One long run's bytes at ``offset`` of ``file`` (direct where it can; queued to
        ``queue`` if given), the file opened for it and counted as written (:meth:`finish`
        makes it durable, once the queue is waited for)."""
        self._written.add(file)
        with self._opened(file):
            file.write(offset, data, queue)

    def _write_segments(self, fid: torch.Tensor, table: torch.Tensor,
                        mapped: bool = False) -> None:
        """Writes a table of ``(src_ptr, file offset, nbytes)`` rows (``fid``: each row's
        file number) through the page cache, or ``mapped`` into a shared mapping of each
        file, one native call per file."""
        first, last = int(fid.min()), int(fid.max())
        for number in [first] if first == last else torch.unique(fid).tolist():
            file = self.files[number]
            self._written.add(file)
            write = file.write_mapped if mapped else file.write_segments
            with self._opened(file):
                write(table if first == last else table[fid == number])

    def write_edges(self, data: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes the bytes of the blocks this rank owns that several runs share (rows of
        under a block each) and of the TP rows' regions it owns (:mod:`plan.tp_regions`: rows under
        ``SHORT_RUN``), all short: assembled into their regions, each written whole (direct
        where the filesystem takes it) once complete, else through the page cache at the
        end -- a region that holds others' blocks too (:meth:`write_batch`)."""
        self._write_rows(data, rows)

    @property
    def bases(self) -> torch.Tensor:
        """Per entry index, the file offset of its data (int64)."""
        return self._base_of

    @property
    def file_of(self) -> torch.Tensor:
        """Per entry index, the number of its file (int64)."""
        return self._file_of

    @property
    def sizes(self) -> list[int]:
        """Per file number, its size in bytes."""
        return [f.size for f in self.files]

    def address_shift(self, index: int, offset: int) -> int:
        """Where a receive buffer for bytes at ``offset`` of entry ``index`` should start
        (mod ``ALIGN``) for its bytes to be written direct without a copy."""
        return (int(self._base_of[index]) + offset) % _direct_io.ALIGN

    @property
    def direct_bytes(self) -> int:
        return sum(f.direct_bytes for f in self.files)

    def close(self) -> None:
        with self._lock:
            for file in self.files:
                file.close()
            self._open.clear()

    @property
    def published(self) -> bool:
        return self.stage is not None and self.stage.published

    def abort(self) -> None:
        """Removes the stage; the directory is as it was (unless already published). A
        joined sink removes dst's stage too: it is aborted only before the commit round
        (nothing of the stage is published yet), and dst may be the rank that died and
        cannot (the first to get there removes it; the others find it gone)."""
        self.close()
        if self.stage is not None:
            self.stage.abort()
        elif self._join is not None and _STAGE_TAG in os.path.basename(self._join):
            _remove(self._join)  # (only ever a stage: never the user's directory)
            ExportLock.remove_if_free(os.path.dirname(self._join))  # (dst's, if it died)

    def finish(self) -> None:
        """Writes what regions still hold and makes this rank's bytes durable (dst: every
        file, each holds its header; a joined writer: those it wrote to)."""
        self._regions.flush()
        self.close()
        for file in self.files:
            if not self.joined or file in self._written:
                _fsync_path(file.path)

    def commit(self) -> None:
        """Makes the stage durable and publishes it (see the class docstring); dst only,
        once every writer has finished."""
        assert self.stage is not None, "a joined sink does not publish"
        self.finish()
        published = list(self.names)
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            _write_file(os.path.join(self.stage.path, INDEX_NAME), json.dumps(index, indent=2))
            published.append(INDEX_NAME)
        for name, text in self.texts.items():
            _write_file(os.path.join(self.stage.path, name), text)
            published.append(name)
        self.stage.publish(published, INDEX_NAME if len(self.names) > 1 else WEIGHTS_NAME)


class MemorySink:
    """Full CPU tensors on dst, filled in place."""

    def __init__(self, entries: list[Entry], model: nn.Module | None = None) -> None:
        assert all(e.index == i for i, e in enumerate(entries)), "entries out of plan order"
        self.keys = [e.key for e in entries]
        self.tensors = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in entries}
        # Per entry index: where its bytes start and how many it has (a table's rows index
        # these; the tensors above own the memory).
        self._ptr = torch.tensor([t.data_ptr() for t in self.tensors.values()],
                                 dtype=torch.int64)
        self._size = torch.tensor([e.nbytes for e in entries], dtype=torch.int64)

    def write_batch(self, data: torch.Tensor, rows: torch.Tensor) -> None:
        """Copies ``data[at : at + n]`` to ``offset`` of each row's entry (a :func:`_rows`
        table), in one native pass (bounds checked here: the rows come from the plan)."""
        if not len(rows):
            return
        idx, offset, at, n = rows.unbind(1)
        bad = (offset < 0) | (offset + n > self._size[idx]) | (at + n > data.numel())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            k, o, m = int(idx[i]), int(offset[i]), int(n[i])
            raise ValueError(f"{self.keys[k]!r}: bytes [{o}, {o + m}) lie outside its "
                             f"{int(self._size[k])} bytes")
        _native.unpack_segments(data, torch.stack((self._ptr[idx] + offset, at, n), 1))

    def address_shift(self, index: int, offset: int) -> int:
        """Any address will do: the bytes are copied into place."""
        return 0

    def abort(self) -> None:
        """Nothing to undo: the tensors are dropped with the sink."""
