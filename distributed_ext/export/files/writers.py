"""Who writes the checkpoint's files: dst alone, or every rank its own bytes.

``writers="all"``: dst makes the stage and its files (headers written, sizes set); every
rank opens them and writes the bytes of its own pieces at their final offsets, so that
almost nothing crosses the link -- a rank's Shard(0) block of a row-major tensor is one run
of the file. Replicated blocks are written once, split by rows between their holders (from 2
MiB; :func:`~plan.pieces.plan_entries` with ``spread``), each from its own
copy. Every 4 KiB block of a file has exactly one writer: a rank writes the whole aligned
blocks inside its runs (direct where the filesystem takes it), and a block that two runs
share -- where one rank's run ends and another's begins (a rank's own messages are cut where
the file is aligned) -- is written by the rank that holds most of its bytes (dst where the
block also holds the header or short runs), to which the others send their few bytes there
(under 4 KiB at each end of a run: :mod:`plan.block_owners` decides,
:mod:`transport.shared_blocks` moves them). So no two ranks (nor two clients of a network
filesystem) ever write one page, and dst is not the sink of every rank's edges. Every rank
fsyncs what it wrote; dst publishes once all have.

The rows of a ``Shard(1)``/TP layout (runs under
:data:`~plan.block_owners.SHORT_RUN`, 64 KiB, interleaved with the other TP
ranks' in the file) are written by region (:mod:`plan.tp_regions`): each 1 MiB region of such a tensor
by the rank holding most of its bytes (TP ranks of equal columns in turn), which assembles
it from its own rows and those the others send it and writes it once, direct where it can;
the partial blocks at the tensor's ends go to dst. Replicated TP rows (HSDP x TP) likewise,
each column block from one of its holders. Written where held instead, every rank would
write its own few blocks between the others', a syscall per run, most bytes fragments to
plan and send one by one: slower than dst alone; by region, faster than dst alone, each
rank writing half and sending half its bytes (docs/measurements.md). Other short runs (small tensors)
still go to dst, which assembles them likewise.

That needs a directory every rank sees as dst does: dst writes a probe file with a random
token into the stage, every rank reads it back, and the answers are agreed. ``"all"`` on a
directory some rank does not see is a ValueError on every rank naming those ranks.
``"auto"`` picks ``"all"`` where every rank sees the directory, else ``"dst"``. On one host
the ranks share its disk, and "all" was still faster than "dst" on ext4 and tmpfs at world
2 and 4 -- the filesystem being the bound (two processes writing halves of one tmpfs file
are not faster than one: the kernel takes the file's lock for each write) -- while dst
holds a fraction of the memory and almost nothing crosses the link (docs/measurements.md).
Across hosts "all" is the one that scales (``benchmarks/RESULTS.md``).

On a RAM filesystem (tmpfs, ramfs; every rank finds the stage on one, agreed in the same
status round) none of the above travels: each rank writes every byte it holds into the
files itself, its short runs copied into a shared mapping of them (:data:`MAP_RAM_FILES`;
``DirectFile.write_mapped``), its long ones with one ``pwrite`` each
(``sinks.MAPPED_LONG_RUN``). There the page cache is the storage, so two ranks filling one
page is two copies into the same memory, not two writes racing for a disk block; short
runs mapped cost a copy each, not a syscall and a turn on the file's lock; long runs
written fill fresh pages in the kernel's write path, not a fault per 4 KiB page.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import torch.distributed as dist

from distributed_ext import _agree, _direct_io
from distributed_ext.collectives import broadcast_from

WRITERS = ("auto", "all", "dst")
PROBE_NAME = ".dext-probe"
# With every rank writing into a RAM filesystem (tmpfs, ramfs: every rank sees it as one),
# each writes every byte it holds, short runs and shared blocks included, through a shared
# mapping of the files (:meth:`~distributed_ext._direct_io.DirectFile.write_mapped`): no
# bytes cross the link at all. What it saves, against the blocks' and regions' exchange
# below: world 4, torch's FSDP x TP recipe, 1 GiB, /dev/shm (benchmarks/RESULTS.md).
MAP_RAM_FILES = True


def check_writers(writers: Any, what: str) -> str:
    """``writers`` if it is one of :data:`WRITERS`; ValueError naming the argument else."""
    if not isinstance(writers, str) or writers not in WRITERS:
        raise ValueError(f"{what}: writers={writers!r}; pass 'auto' (every rank writes its own "
                         "bytes where every rank sees the directory, else dst), 'all' or 'dst'")
    return writers


def _sees(stage: str, token: str) -> bool:
    """Whether this rank reads dst's probe in ``stage`` (the same directory, not a namesake)."""
    try:
        with open(os.path.join(stage, PROBE_NAME), encoding="utf-8") as f:
            return f.read() == token
    except OSError:
        return False


def resolve_writers(writers: str, stage: str | None, ctx: _agree.GroupContext, dst_rank: int,
                    group: dist.ProcessGroup | None, what: str, directory: Any
                    ) -> tuple[str, str, bool]:
    """``("all" | "dst", dst's stage path, mapped)``, the same on every rank (a broadcast of
    dst's stage and probe token, then one status round of who sees it and on what).
    ``mapped``: every rank writes the files through a shared mapping (:data:`MAP_RAM_FILES`:
    "all", and every rank found the stage on a RAM filesystem).

    ``stage``: dst's stage directory (None elsewhere). Raises ValueError on every rank when
    ``writers == "all"`` and some rank does not see it.
    """
    dst_global = ctx.ranks[dst_rank]

    def probe() -> tuple[str, str]:
        assert stage is not None
        token = uuid.uuid4().hex
        with open(os.path.join(stage, PROBE_NAME), "w", encoding="utf-8") as f:
            f.write(token)
        return stage, token

    where, token = broadcast_from(f"{what} (stage)", probe, dst_global, group)
    try:
        # One status round: each rank's answer travels in its record's fields.
        answers = [s.fields for s in _agree.agree(
            what, ctx, lambda: (int(_sees(where, token)),
                                int(_direct_io.on_ram_filesystem(os.path.join(where, "x")))),
            stage="who sees the directory")]
    finally:
        if stage is not None:  # never published with the checkpoint
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(stage, PROBE_NAME))
    blind = [ctx.ranks[r] for r, fields in enumerate(answers) if not fields[0]]
    if not blind:
        return "all", where, MAP_RAM_FILES and all(fields[1] for fields in answers)
    if writers == "all":
        raise ValueError(
            f"{what}: writers='all', but rank(s) {blind} do not see directory={directory!r} "
            f"as dst (rank {dst_global}) does (another filesystem or mount under that path); "
            "pass writers='dst' (dst writes every byte) or a directory on a filesystem every "
            "rank shares")
    return "dst", where, False
