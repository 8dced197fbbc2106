"""DirectFile: bytes land where they are written, direct where the filesystem allows it."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import threading
import warnings
import weakref

import pytest
import torch

from distributed_ext import _direct_io
from distributed_ext._direct_io import ALIGN, DirectFile, aligned_empty


def _pieces(size: int, seed: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces that tile ``[0, size)``, of every alignment, shuffled."""
    rng = random.Random(seed)
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(60)),
                   *(rng.randrange(size // ALIGN) * ALIGN for _ in range(20))})
    pieces = list(zip(cuts, [b - a for a, b in zip(cuts, cuts[1:])]))
    rng.shuffle(pieces)
    return pieces


def _write_pieces(file: DirectFile, data: torch.Tensor, pieces: list[tuple[int, int]],
                  threads: int) -> None:
    def run(mine: list[tuple[int, int]]) -> None:
        for offset, n in mine:
            # Half from unaligned memory (bounced), half from memory aligned like the file.
            if offset % 2:
                src = data[offset : offset + n].clone()
            else:
                src = aligned_empty(n, shift=offset % ALIGN)
                src.copy_(data[offset : offset + n])
            file.write(offset, src)

    workers = [threading.Thread(target=run, args=(pieces[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_of_every_alignment_in_any_order_land_in_place(tmp_path, threads):
    size = 3 * _direct_io.BOUNCE_BYTES + 12345  # pieces larger than a bounce buffer too
    data = torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(threads))
    path = str(tmp_path / "f")
    file = DirectFile(path, size)
    try:
        _write_pieces(file, data, _pieces(size, threads), threads)
        file.sync()
        direct = file.direct_fd is not None
        written_direct = file.direct_bytes
    finally:
        file.close()
    with open(path, "rb") as f:
        assert f.read() == data.numpy().tobytes()
    if direct:  # the filesystem takes O_DIRECT: most bytes went that way
        assert written_direct > size // 2, (written_direct, size)
    else:
        assert written_direct == 0


def test_the_file_is_created_exclusively_at_its_final_size(tmp_path):
    path = str(tmp_path / "f")
    file = DirectFile(path, 10_000)
    file.close()
    assert os.path.getsize(path) == 10_000
    with pytest.raises(FileExistsError):
        DirectFile(path, 10)


def test_a_filesystem_that_refuses_the_alignment_falls_back_to_the_page_cache(tmp_path,
                                                                              monkeypatch):
    real = _direct_io._pwrite_fully
    refused = []

    def picky(fd, view, offset):
        if fd == file.direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, view, offset)

    size = 5 * ALIGN + 77
    data = torch.arange(size, dtype=torch.int64).to(torch.uint8)
    path = str(tmp_path / "f")
    file = DirectFile(path, size)
    monkeypatch.setattr(_direct_io, "_pwrite_fully", picky)
    try:
        if file.direct_fd is None:
            pytest.skip("this filesystem refuses O_DIRECT at open: nothing to fall back from")
        file.write(0, data[: 2 * ALIGN + 5].clone())
        file.write(2 * ALIGN + 5, data[2 * ALIGN + 5 :].clone())
        file.sync()
    finally:
        file.close()
    assert len(refused) == 1  # refused once, then never tried again
    with open(path, "rb") as f:
        assert f.read() == data.numpy().tobytes()


def test_aligned_empty_places_its_address():
    for shift in (0, 1, 512, ALIGN - 1):
        t = aligned_empty(1000, shift)
        assert t.numel() == 1000 and t.data_ptr() % ALIGN == shift % ALIGN


def huge_pages_granted() -> bool:
    """Whether this kernel grants transparent huge pages to memory advised so."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages_of(t: torch.Tensor) -> int:
    """kB of transparent huge pages in the mapping that holds ``t``'s first byte (0 where
    no mapping holds it any more)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if not head.endswith(":"):  # a mapping's first line: its address range
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= t.data_ptr() < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("shift", [0, 1, 2048])
def test_huge_empty_is_memory_of_its_own_in_huge_pages_freed_with_its_last_view(shift):
    # A direct write from huge pages goes to the device in few segments.
    t = _direct_io.huge_empty(5 * 2**20, shift)
    assert t.dtype == torch.uint8 and t.numel() == 5 * 2**20
    assert t.data_ptr() % ALIGN == shift
    # (its mapping may have merged with a neighbour that has huge pages already: counted as
    # a difference)
    before = huge_pages_of(t)
    t.fill_(7)
    assert int(t.sum()) == 7 * 5 * 2**20
    if huge_pages_granted():  # (where the kernel grants none, 4 KiB pages: still correct)
        assert huge_pages_of(t) - before >= 4096, (before, huge_pages_of(t))
    view = t[2**20 : 2**20 + 10]
    address = view.data_ptr()
    del t
    assert torch.equal(view, torch.full((10,), 7, dtype=torch.uint8))  # still mapped
    with open("/proc/self/maps") as f:
        assert any(int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
                   for line in f)
    del view
    with open("/proc/self/maps") as f:  # unmapped with its last view
        assert not any(int(line.split("-")[0], 16) <= address
                       < int(line.split()[0].split("-")[1], 16) for line in f)


def test_a_ram_filesystem_gets_no_o_direct():
    # There the page cache is the storage: O_DIRECT (accepted by recent kernels) only copies.
    import uuid

    from distributed_ext import _direct_io

    with open("/proc/mounts") as f:
        ram = [m.split()[1] for m in f if m.split()[2] == "tmpfs"]
    where = next((m for m in ram if os.path.isdir(m) and os.access(m, os.W_OK)), None)
    if where is None:
        pytest.skip("no writable tmpfs mount on this machine")
    path = os.path.join(where, f"dext-test-{uuid.uuid4().hex}")
    assert _direct_io.on_ram_filesystem(path)
    file = DirectFile(path, 2 * ALIGN)
    try:
        assert file.direct_fd is None and not file.direct_capable
        file.write(0, aligned_empty(2 * ALIGN).fill_(7))
        # Closed and reopened (as a sink that bounds its open files does): still not direct.
        file.close()
        file.reopen()
        assert file.direct_fd is None
        file.write(0, aligned_empty(2 * ALIGN).fill_(7))
        assert file.direct_bytes == 0
    finally:
        file.close()
        os.unlink(path)


def test_one_bounce_buffer_per_writing_thread_whatever_the_number_of_files(tmp_path):
    # A checkpoint of 200 shard files is written by a thread or two: each thread bounces
    # through one 8 MiB buffer (and one writer thread), not one per file it writes (as it
    # did: 8 MiB more for every file written).
    from harness import read_rss

    data = torch.randint(0, 256, (_direct_io.BOUNCE_BYTES + 5000,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(7))
    src = data[1:]  # unaligned: bounced wherever the file goes direct
    files = [DirectFile(str(tmp_path / f"f{i}"), src.numel() + ALIGN) for i in range(16)]
    if files[0].direct_fd is None:
        for f in files:
            f.close()
        pytest.skip("this filesystem takes no O_DIRECT: nothing is bounced")
    files[0].write(ALIGN, src)  # the thread's buffer, made once
    before = read_rss()
    buffers = set()
    for f in files:
        f.write(ALIGN, src)
        buffers.add(_direct_io._LOCAL.buf.data_ptr())
    grown = read_rss() - before
    for f in files:
        f.sync()
        f.close()
    assert len(buffers) == 1 and grown < 4 * _direct_io.BOUNCE_BYTES, (buffers, grown)
    with open(tmp_path / "f15", "rb") as f:
        assert f.read()[ALIGN:] == src.numpy().tobytes()


def test_mapped_writes_of_several_processes_fill_one_file_byte_for_byte(ram_path):
    # Three writers' interleaved short runs (pages shared between them) and one long run,
    # through shared mappings of one file on a RAM filesystem, as writers="all" does there.
    import multiprocessing as mp

    path = os.path.join(ram_path, "mapped")
    size = 3 * 2**20 + 123
    DirectFile(path, size).close()
    want = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(0))
    run = 1000  # runs of 1000 bytes, rank r holds every third one
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_every_third_run, args=(path, size, want, run, r))
             for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    with open(path, "rb") as f:
        got = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    assert got.numel() == size and torch.equal(got, want)


def _write_every_third_run(path, size, want, run, r):
    f = DirectFile(path, size, create=False)
    rows = [(want.data_ptr() + o, o, min(run, size - o)) for o in range(r * run, size, 3 * run)]
    f.write_mapped(rows[: len(rows) // 2])  # two calls: two mappings, each of its own span
    f.write_mapped(torch.tensor(rows[len(rows) // 2 :], dtype=torch.int64))
    f.close()
    os._exit(0)


def test_a_mapped_write_outside_the_file_is_refused_before_any_byte_moves(tmp_path):
    from distributed_ext import _native

    f = DirectFile(str(tmp_path / "f"), 10_000)
    data = torch.arange(200, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"row 1 writes bytes \[9900, 10100\) outside the "
                                         r"file's 10000 bytes"):
        f.write_mapped([(data.data_ptr(), 0, 100), (data.data_ptr(), 9900, 200)])
    assert (tmp_path / "f").read_bytes() == bytes(10_000)  # nothing written
    before = _direct_io.mapped_bytes()
    f.write_mapped([(data.data_ptr(), 9800, 200)])  # counted for the benchmarks' figures
    assert _direct_io.mapped_bytes() - before == 200
    assert (tmp_path / "f").read_bytes()[9800:] == bytes(range(200))
    # a file shorter than the writers agreed (changed behind our back): an errno, no SIGBUS
    os.truncate(tmp_path / "f", 100)
    with pytest.raises(OSError) as info:
        f.write_mapped([(data.data_ptr(), 5000, 100)])
    assert info.value.errno == errno.EINVAL
    with pytest.raises(ValueError, match="null pointer"):
        _native.map_write_segments(f.map_fd, [(0, 0, 10)], 100)
    f.close()
    assert f.map_fd == -1


# -- WriteQueue: direct writes done by a native thread -------------------------------------------


def test_queued_writes_of_every_alignment_land_in_place_and_the_files_may_close_meanwhile(
        tmp_path):
    size = 2 * _direct_io.BOUNCE_BYTES + 5 * ALIGN  # jobs larger than the bounce buffer too
    data = torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5))
    paths = [str(tmp_path / f"f{i}") for i in range(2)]
    files = [DirectFile(p, size) for p in paths]
    if files[0].direct_fd is None:
        for f in files:
            f.close()
        pytest.skip(f"{tmp_path} takes no O_DIRECT: nothing is queued there")
    queue = _direct_io.WriteQueue()
    kept = []  # the queued bytes stay alive until waited for
    try:
        # Whole aligned blocks, from aligned memory (direct as they are) and from memory
        # one byte off (through the queue's bounce buffer), in pieces of every size.
        cuts = [0, ALIGN, 3 * ALIGN, _direct_io.BOUNCE_BYTES + 2 * ALIGN, size]
        for i, file in enumerate(files):
            for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
                src = aligned_empty(b - a, shift=(i + j) % 2)
                src.copy_(data[a:b])
                kept.append(src)
                queue.submit(file, a, src)
            file.close()  # its descriptors were duplicated per write
        queue.wait()
        assert queue.last == 2 * (len(cuts) - 1)
    finally:
        queue.close()
    for path, file in zip(paths, files):
        assert file.direct_bytes == size
        with open(path, "rb") as f:
            assert f.read() == data.numpy().tobytes()


def test_a_failed_queued_write_is_raised_naming_its_file_and_nothing_after_it_is_written(
        tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    files = [DirectFile(good, 4 * ALIGN), DirectFile(bad, 4 * ALIGN)]
    if files[0].direct_fd is None:
        for f in files:
            f.close()
        pytest.skip(f"{tmp_path} takes no O_DIRECT: nothing is queued there")
    src = aligned_empty(ALIGN).fill_(7)
    queue = _direct_io.WriteQueue()
    try:
        # The bad file's descriptors replaced by one open for reading only: EBADF.
        read_only = os.open(bad, os.O_RDONLY)
        for fd in (files[1].direct_fd, files[1].fd):
            os.dup2(read_only, fd)
        os.close(read_only)
        first = queue.submit(files[0], 0, src)
        queue.submit(files[1], 0, src)
        last = queue.submit(files[0], ALIGN, src)
        queue.wait(first)  # the good write before the failure: no error
        with pytest.raises(OSError) as info:
            queue.wait(last)
        assert info.value.errno == errno.EBADF and info.value.filename == bad
    finally:
        queue.close()
        for f in files:
            f.close()
    with open(good, "rb") as f:  # the write after the failed one wrote nothing
        assert f.read() == bytes([7]) * ALIGN + bytes(3 * ALIGN)


@pytest.fixture
def direct_file(tmp_path):
    """``direct_file(size)``: a new DirectFile ``tmp_path / "f"`` that writes direct (the test
    skipped where the filesystem takes no O_DIRECT), closed after the test."""
    made: list[DirectFile] = []

    def make(size: int) -> DirectFile:
        made.append(DirectFile(str(tmp_path / "f"), size))
        if made[-1].direct_fd is None:
            pytest.skip(f"{tmp_path} takes no O_DIRECT: nothing is written direct there")
        return made[-1]

    yield make
    for file in made:
        file.close()


def test_a_queued_write_is_refused_before_it_is_queued_where_it_is_not_whole_blocks(
        direct_file):
    file = direct_file(4 * ALIGN)
    queue = _direct_io.WriteQueue()
    try:
        src = aligned_empty(2 * ALIGN)
        for offset, data in ((1, src[:ALIGN]), (0, src[: ALIGN + 1]), (0, src[:0])):
            with pytest.raises(ValueError, match="whole aligned blocks"):
                queue.submit(file, offset, data)
        assert queue.last == 0
        with pytest.raises(OSError) as info:  # a descriptor that is not open: not queued
            queue._queue.submit(2**20 - 1, file.fd, src.data_ptr(), ALIGN, 0)
        assert info.value.errno == errno.EBADF
        queue.wait(1)  # (nothing was queued: returns at once)
    finally:
        queue.close()
    queue.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        queue._queue.submit(0, 0, src.data_ptr(), ALIGN, 0)


def test_the_queue_holds_each_writes_bytes_until_a_wait_covers_it(direct_file):
    file = direct_file(2 * ALIGN)
    queue = _direct_io.WriteQueue()
    try:
        src = aligned_empty(ALIGN).fill_(3)
        held = weakref.ref(src)
        ticket = queue.submit(file, ALIGN, src)
        del src  # the caller's reference gone: the queue's keeps the bytes
        assert held() is not None
        queue.wait(ticket)
        assert held() is None  # released once a wait covered it
    finally:
        queue.close()
    with open(file.path, "rb") as f:
        assert f.read() == bytes(ALIGN) + bytes([3]) * ALIGN


def _unpinnable_page() -> torch.Tensor | None:
    """One page of memory that can be read but that the kernel will not pin for a direct
    write (the vDSO's data page, ``[vvar]``: VM_PFNMAP), as a uint8 tensor; None where the
    process has none."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[vvar]"):
                start = int(line.split("-")[0], 16)
                view = memoryview((ctypes.c_char * ALIGN).from_address(start)).cast("B")
                with warnings.catch_warnings():  # (read only, never written)
                    warnings.simplefilter("ignore")
                    return torch.frombuffer(view, dtype=torch.uint8)
    return None


@pytest.mark.parametrize("queued", [False, True])
def test_memory_the_kernel_will_not_pin_is_written_through_the_page_cache(direct_file, queued):
    page = _unpinnable_page()
    if page is None:
        pytest.skip("this process maps no [vvar] page: no unpinnable memory to write from")
    file = direct_file(2 * ALIGN)
    path = file.path
    with pytest.raises(OSError) as info:  # what the kernel says to a direct write of it
        os.pwrite(file.direct_fd, _direct_io._memoryview(page), 0)
    assert info.value.errno == errno.EFAULT
    with pytest.warns(RuntimeWarning, match="EFAULT") as said:  # (named, said once)
        if queued:
            queue = _direct_io.WriteQueue()
            try:
                queue.submit(file, ALIGN, page)
                queue.wait()
                queue.wait()
            finally:
                queue.close()
        else:
            file.write(ALIGN, page)
    assert len(said) == 1 and path in str(said[0].message)
    assert file.direct_fd_usable  # (the file stays direct for the other writes)
    with open(path, "rb") as f:
        written = f.read()
    assert written[:ALIGN] == bytes(ALIGN) and any(written[ALIGN:])  # the page, not zeros


def test_a_queued_write_from_memory_not_mapped_fails_named_and_unsaid(direct_file):
    file = direct_file(2 * ALIGN)
    path = file.path
    queue = _direct_io.WriteQueue()
    try:
        gone = mmap.mmap(-1, ALIGN)  # a page, unmapped again before the write
        anchor = ctypes.c_char.from_buffer(gone)
        address = ctypes.addressof(anchor)
        del anchor
        gone.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no "written through the page cache" here)
            ticket = queue._queue.submit(file.direct_fd, file.fd, address, ALIGN, 0)
            queue._jobs.append((ticket, path, None))
            queue.last = ticket
            with pytest.raises(OSError) as info:  # the page cache cannot read it either
                queue.wait()
        assert info.value.errno == errno.EFAULT and info.value.filename == path
    finally:
        queue.close()
