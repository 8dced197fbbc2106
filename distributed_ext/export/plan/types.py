"""The plan's shared types, at the bottom of the export: a tensor as the checkpoint holds it
(:class:`Entry`) and the blocks it is assembled from (:class:`Piece`). Every layer above
(the plan, the files, the transport, the rounds) speaks in these."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distributed_ext.export.plan.blocks import Block, Runs, _piece_runs


@dataclass(frozen=True, slots=True)
class Transform:
    """A written tensor computed row block by row block from another (a quantized weight,
    its per-row or per-block scales, from the weight transformers would write):
    ``fn(rows, first)`` turns that tensor's rows ``first .. first + len(rows)`` (every column)
    into the written tensor's rows ``first // step * out_rows ..``, ``out_rows`` written rows
    per ``step`` source rows. A block of the source must hold whole rows and start and end on
    a multiple of ``step`` (a packed pair of rows); ``what`` names the module and the format
    in a refusal."""

    fn: Callable[[torch.Tensor, int], torch.Tensor]
    step: int
    out_rows: int
    what: str
    source_dtype: torch.dtype  # the tensor the rows are of (as transformers would write it)
    source_shape: tuple[int, ...]

    def rows_of(self, rows: torch.Tensor, first: int,
                empty: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """``fn`` of ``rows`` (source rows ``first ..``), computed ``TRANSFORM_BYTES`` of them
        at a time (a GPU's: ``DEVICE_TRANSFORM_BYTES``) into one output: the arithmetic's
        temporaries (several float32 copies, in ModelOpt's) stay those of a few MiB however
        many rows are asked for. (Computing a message's rows in one call where ``fn`` holds
        no temporaries -- the FP8 table -- was measured and not kept: each output then a
        fresh allocation, glibc's heap grew a sender's peak RSS about threefold:
        docs/measurements.md.) ``empty(nbytes)``: the
        output's bytes (uint8, on the host), where the caller wants them: at the address a
        direct write takes without a bounce copy (on a disk, a quantized weight's bytes are
        90 % of what a rank writes); where that address is not a multiple of the output's
        element size, the output goes where torch puts it instead. A ``fn`` with a
        ``rows_into(rows, first, empty)`` (not None) -- one that holds no temporaries, the
        FP8 table -- computes every row at once straight into ``empty``'s bytes: no output
        of its own, no copy (an output each before)."""
        into = getattr(self.fn, "rows_into", None)
        if into is not None and empty is not None and rows.device.type == "cpu":
            return into(rows, first, empty)
        n = rows.shape[0]
        row_bytes = rows[:1].numel() * rows.element_size()
        at_once = TRANSFORM_BYTES if rows.is_cpu else DEVICE_TRANSFORM_BYTES
        chunk = max(self.step, at_once // max(row_bytes, 1) // self.step * self.step)
        # Cut where the source's own multiples of ``chunk`` fall (wherever ``first`` is), so
        # that two tensors computed from the same rows ask ``fn`` for the same row ranges.
        cuts = [0, *range(-first % chunk or chunk, n, chunk), n]
        if len(cuts) == 2 and empty is None:
            return self.fn(rows, first)
        out: torch.Tensor | None = None
        for a, b in zip(cuts, cuts[1:]):
            part = self.fn(rows[a:b], first + a)
            if out is None:
                shape = (n // self.step * self.out_rows, *part.shape[1:])
                raw = None
                if empty is not None and part.device.type == "cpu":
                    raw = empty(math.prod(shape) * part.element_size())
                if raw is None or raw.data_ptr() % part.element_size():
                    out = torch.empty(shape, dtype=part.dtype, device=part.device)
                else:
                    out = raw.view(part.dtype).view(shape)
            at = a // self.step * self.out_rows
            out[at : at + part.shape[0]] = part
        assert out is not None
        return out


# Source bytes a transform computes at once (Transform.rows_of): of host rows; of a GPU's
# (ModelOpt's arithmetic there: a few float32 temporaries of them on the device, ~40 MiB at
# most, for a quarter of the calls -- each a few hundred microseconds of its Python).
TRANSFORM_BYTES = 2**20
DEVICE_TRANSFORM_BYTES = 4 * 2**20


@dataclass(slots=True)
class Piece:
    """A block of a written tensor that ``rank`` sends (in plan order).

    ``block`` is in the written tensor's coordinates. The bytes come from the in-memory tensor
    ``source`` (empty: its entry's ``source``)'s local block on ``rank``: all of it
    (``local`` None), or ``local`` (slices in the local block's coordinates) with its dims
    taken in ``perm`` order. Pieces of a whole in-memory tensor name no source: one list of
    them serves every entry of a signature (immutable once planned).
    """

    rank: int  # group rank
    block: Block
    nbytes: int  # the block's bytes
    source: str = ""
    local: tuple[slice, ...] | None = None
    perm: tuple[int, ...] | None = None
    _runs: Runs | None = field(default=None, repr=False, compare=False)
    # Its entry is computed (``Entry.transform``): the block of the in-memory tensor it is
    # computed from (``local``/``perm`` read that block, ``block`` is in the written tensor).
    src: Block | None = None

    def runs(self, entry: Entry) -> Runs:
        """The block's contiguous runs in the full tensor (:func:`block_runs`), computed once."""
        if self._runs is None:
            self._runs = _piece_runs(self.block, entry.shape, entry.dtype.itemsize)
        return self._runs


@dataclass(slots=True)
class Entry:
    """A tensor as the checkpoint holds it, and the pieces it is assembled from."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)  # shared between entries: never mutate
    index: int = 0  # its position in the plan (how sinks and row tables name it)
    source: str = ""  # the in-memory tensor its pieces read, where they do not name one
    # writers="all": its runs are short and interleaved (a Shard(1)/TP layout, replicated
    # or not), so each region of it is written by the sender of most of its bytes
    # (:mod:`plan.tp_regions`); every rank then knows every sender's piece of it
    zoned: bool = False
    # Computed from its source's rows where they live (a quantized weight): see Transform
    transform: Transform | None = None
    nbytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
