"""A sharded model's full state on one rank: as a Hugging Face checkpoint, or as a dict.

The flow, on every rank of the group:

1. Metadata round (``all_reduce``): each rank describes its entries -- key, dtype, global
   shape, and the block of the full tensor it holds (a DTensor's local shard and its global
   offset, or the whole tensor for a plain one). A bad entry (a ``Partial`` placement, a dtype
   safetensors cannot store) raises on every rank before any byte moves.
2. Plan, computed alike on every rank from that metadata: for each key, which rank sends which
   block (replicas once: dst's own copy if it has one, else the least-loaded holder's; a
   model's recorded :class:`~distributed_ext.DistributionPlan` is checked against what the
   ranks hold), where every
   byte lands (file and offset, or offset in the full tensor), and an agreed error for keys
   whose ranks disagree on dtype or shape, or whose blocks do not cover the tensor.
3. Preparing round: dst opens temporary files in the target directory (or allocates the full
   tensors); a failure raises on every rank.
4. Data: each sender streams its blocks, in plan order, in pieces of at most ``chunk_bytes``;
   dst writes each piece to its place as it arrives (``os.pwrite`` per contiguous run, with
   ``O_DIRECT`` where the filesystem takes it: :mod:`distributed_ext._direct_io`), while a
   second thread writes dst's own blocks, which never cross the link. Waits are watched
   (:mod:`distributed_ext._watch`).
5. Final round: any failure (a full disk, a dead peer, an interrupt) makes every rank raise,
   and dst removes its temporary files; else dst renames them into place, writes the index,
   ``config.json`` and ``generation_config.json``, and removes stale shards of an earlier
   checkpoint, as ``save_pretrained`` does.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import _agree, _direct_io, _staging, _watch, runtime
from distributed_ext.collectives import all_reduce
from distributed_ext.plan import DistributionPlan, recorded_plan

__all__ = ["export_hf_checkpoint", "gather_full_state"]

# What safetensors stores (its dtype names); anything else is refused before bytes move.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}

EXPORT_CHUNK_BYTES = 16 * 2**20
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# -- input -----------------------------------------------------------------------------------


def _dtensor_type() -> type | None:
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def resolve_state(model_or_state: nn.Module | dict) -> tuple[dict[str, torch.Tensor], nn.Module | None]:
    """The entries to export, keyed as ``save_pretrained`` writes them, and the model if any.

    For a module: its ``state_dict()``, less tied weights (the keys of ``_tied_weights_keys``
    that alias their source), so that ``from_pretrained`` re-ties them.
    """
    if isinstance(model_or_state, nn.Module):
        model = model_or_state
        # keep_vars: a tied parameter is then the same object under both keys.
        state = dict(model.state_dict(keep_vars=True))
        tied = getattr(model, "_tied_weights_keys", None) or {}
        targets = list(tied.keys()) if isinstance(tied, dict) else list(tied)
        for key in targets:
            if key in state and any(_same_tensor(state[key], v)
                                    for k, v in state.items() if k != key):
                del state[key]
        return state, model
    if isinstance(model_or_state, dict):
        return dict(model_or_state), None
    raise TypeError(f"model_or_state must be an nn.Module or a dict of tensors, got "
                    f"{type(model_or_state).__name__}")


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two entries are one tensor (the same object, or the same view of one memory)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(a, dtensor) and isinstance(b, dtensor):
        a, b = a.to_local(), b.to_local()
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.numel() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


@dataclass(frozen=True)
class Block:
    """The block of a full tensor one rank holds: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def describe_entry(key: str, t: Any) -> dict[str, Any]:
    """This rank's metadata for one entry; TypeError/ValueError naming the key if unsupported."""
    dtensor = _dtensor_type()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state[{key!r}] is a {type(t).__name__}, not a tensor; a checkpoint "
                        "holds tensors only -- drop it or store it in the config")
    if t.dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"state[{key!r}] has dtype {t.dtype}, which safetensors cannot store; "
                        "convert it with .to(...) first")
    if dtensor is not None and isinstance(t, dtensor):
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in t.placements):
            raise ValueError(f"state[{key!r}] is a DTensor with a Partial placement "
                             f"({t.placements}): its values are unreduced sums; call "
                             ".redistribute(placements=[Replicate()]) or .full_tensor() first")
        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
        if tuple(local.shape) != tuple(shape):
            raise ValueError(f"state[{key!r}]: its local shard has shape {tuple(local.shape)}, "
                             f"but its placements say {tuple(shape)}")
        return {"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "offset": list(offset), "block": list(shape),
                "dtensor": True}
    if t.layout != torch.strided or t.is_meta:
        raise TypeError(f"state[{key!r}] is a {t.layout} or meta tensor; export dense, "
                        "materialized tensors")
    return {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "offset": [0] * t.dim(), "block": list(t.shape)}


# -- plan ------------------------------------------------------------------------------------


@dataclass
class Piece:
    """A block of ``key`` that ``rank`` sends (in plan order)."""

    key: str
    rank: int  # group rank
    block: Block
    _runs: list[tuple[int, int]] | None = field(default=None, repr=False, compare=False)

    def runs(self, entry: Entry) -> list[tuple[int, int]]:
        """The block's contiguous runs in the full tensor (:func:`block_runs`), computed once."""
        if self._runs is None:
            self._runs = block_runs(self.block, entry.shape, entry.dtype.itemsize)
        return self._runs


@dataclass
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_entries(described: list[list[dict[str, Any]]], dst_rank: int,
                 ranks: list[int], recorded: DistributionPlan | None = None) -> list[Entry]:
    """The export plan from every rank's metadata (the same on every rank); ValueError if the
    ranks disagree about a key or its blocks do not cover the tensor.

    A block several ranks hold (a replica) is sent once: by dst when it holds one, so that it
    never crosses the link, else by the holder that has the fewest bytes to send so far, so
    that replicas (an expert shard's ``edp`` copies, HSDP's replicated shards) spread the
    sending over their holders.

    ``recorded``: the model's :class:`DistributionPlan`, if it records one. Then the group must
    be the plan's world, and a plain (non-DTensor) entry must be held as the plan says: by
    every rank (the dense part, and anything replicated) or by ``edp`` ranks (an expert shard);
    any other holding means a rank's model is not the one the plan describes, and a
    checkpoint written from it would miss or mix weights.
    """
    world = len(described)
    if recorded is not None and recorded.world_size != world:
        raise ValueError(
            f"the model records {recorded} but the export's group has {world} rank(s): every "
            f"rank that holds a part of the model must take part (pass group=None, or a group "
            f"of the plan's {recorded.world_size} ranks)")
    order: list[str] = []
    seen: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in [dst_rank] + [r for r in range(world) if r != dst_rank]:
        for meta in described[r]:
            if meta["key"] not in seen:
                seen[meta["key"]] = []
                order.append(meta["key"])
            seen[meta["key"]].append((r, meta))
    load = [0] * world  # bytes each rank sends so far
    entries = []
    for key in order:
        holders = sorted(seen[key], key=lambda rm: rm[0])
        kinds = {(m["dtype"], tuple(m["shape"])) for _r, m in holders}
        if len(kinds) > 1:
            listing = "; ".join(f"rank {ranks[r]}: {m['dtype']} {tuple(m['shape'])}"
                                for r, m in holders)
            raise ValueError(f"state[{key!r}] differs between ranks ({listing}); every rank "
                             "that holds a key must hold the same dtype and shape")
        dtype_name, shape = kinds.pop()
        if recorded is not None and not any(m.get("dtensor") for _r, m in holders):
            allowed = sorted({world, recorded.edp})
            if len(holders) not in allowed:
                raise ValueError(
                    f"state[{key!r}] is held by {len(holders)} rank(s) "
                    f"({[ranks[r] for r, _m in holders]}), but the model records {recorded}: "
                    f"a plain tensor is held by {' or '.join(map(str, allowed))} ranks "
                    "(every rank, or an expert shard's edp replicas); record the plan the "
                    "model was distributed with")
        entry = Entry(key, _DTYPE_BY_NAME[dtype_name], shape)
        blocks: dict[Block, list[int]] = {}
        for r, m in holders:
            block = Block(tuple(m["offset"]), tuple(m["block"]))
            if block.numel:
                blocks.setdefault(block, []).append(r)
        for block, owners in blocks.items():
            if dst_rank in owners:
                sender = dst_rank  # replicas never cross the link
            else:
                sender = min(owners, key=lambda r: (load[r], r))
                load[sender] += block.numel * entry.dtype.itemsize
            entry.pieces.append(Piece(key, sender, block))
        covered = sum(p.block.numel for p in entry.pieces)
        if covered != math.prod(shape):
            raise ValueError(f"state[{key!r}]: the ranks' blocks cover {covered} of "
                             f"{math.prod(shape)} elements (overlapping or missing shards)")
        entries.append(entry)
    return entries


def agree_plan(plans: list[tuple | None], ranks: list[int]) -> DistributionPlan | None:
    """The plan the ranks' models record (as tuples), the same on all; ValueError if not."""
    if len(set(plans)) > 1:
        listing = "; ".join(f"rank {g}: {DistributionPlan(*p) if p else 'none'}"
                            for g, p in zip(ranks, plans))
        raise ValueError(f"the ranks' models record different distribution plans ({listing}); "
                         "record one plan on every rank's model")
    return DistributionPlan(*plans[0]) if plans[0] is not None else None


def block_runs(block: Block, shape: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """``(byte offset in the full tensor, nbytes)`` of each contiguous run of ``block``, in
    the block's own row-major order (the order its local bytes have)."""
    ndim = len(shape)
    if ndim == 0:
        return [(0, itemsize)]
    # Dims after j are whole: one run spans block.shape[j] * prod(shape[j+1:]) elements.
    j = ndim - 1
    while j > 0 and block.shape[j] == shape[j] and block.offset[j] == 0:
        j -= 1
    inner = math.prod(shape[j + 1:])
    run = block.shape[j] * inner * itemsize
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    runs = []
    outer = block.shape[:j]
    for index in _indices(outer):
        start = sum((block.offset[d] + index[d]) * strides[d] for d in range(j))
        start += block.offset[j] * strides[j]
        runs.append((start * itemsize, run))
    return runs


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (k,) for i in out for k in range(n)]
    return out


# -- sinks: where dst puts the bytes ----------------------------------------------------------


def parse_shard_size(value: int | str) -> int:
    """``5GB`` / ``500MiB`` / ``1000`` -> bytes (HF's units: KB/MB/GB decimal, KiB/MiB/GiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"max_shard_size must be positive, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", value.upper())
        if m:
            units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
            n = int(float(m.group(1)) * units[m.group(2)])
            if n > 0:
                return n
    raise ValueError(f"max_shard_size={value!r}: pass a positive int of bytes or a size such "
                     "as '5GB' or '500MiB'")


def layout_files(entries: list[Entry], max_shard: int) -> list[list[Entry]]:
    """Keys into files in order, a new file when the next would pass ``max_shard`` (as HF)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def safetensors_header(entries: list[Entry]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``entries`` (in order) and each key's data offset in the file."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, pos = {}, 0
    for e in entries:
        meta[e.key] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [pos, pos + e.nbytes]}
        offsets[e.key] = pos
        pos += e.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return head, {k: v + len(head) for k, v in offsets.items()}


class FileSink:
    """Temporary safetensors files in the target directory, renamed into place on commit."""

    def __init__(self, directory: str, files: list[list[Entry]]) -> None:
        self.directory = directory
        self.created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        n = len(files)
        self.names = [WEIGHTS_NAME] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.tmp = [os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
                    for name in self.names]
        self.files: list[_direct_io.DirectFile] = []
        # key -> (its file, its data's offset in the file)
        self.where: dict[str, tuple[_direct_io.DirectFile, int]] = {}
        self.weight_map: dict[str, str] = {}
        self.total = 0
        try:
            for name, path, group in zip(self.names, self.tmp, files):
                head, offsets = safetensors_header(group)
                size = len(head) + sum(e.nbytes for e in group)
                file = _direct_io.DirectFile(path, size)
                self.files.append(file)
                file.write(0, torch.frombuffer(bytearray(head), dtype=torch.uint8))
                for e in group:
                    self.where[e.key] = (file, offsets[e.key])
                    self.weight_map[e.key] = name
                    self.total += e.nbytes
        except BaseException:
            self.abort()  # no temporary file outlives a failed start
            raise

    def write(self, key: str, offset: int, data: torch.Tensor) -> None:
        file, base = self.where[key]
        file.write(base + offset, data)

    def address_shift(self, key: str, offset: int) -> int:
        """Where a receive buffer for bytes at ``offset`` of ``key`` should start (mod
        ``ALIGN``) for its bytes to be written direct without a copy."""
        _file, base = self.where[key]
        return (base + offset) % _direct_io.ALIGN

    @property
    def direct_bytes(self) -> int:
        return sum(f.direct_bytes for f in self.files)

    def close(self) -> None:
        for file in self.files:
            file.close()
        self.files = []

    def abort(self) -> None:
        """Removes the temporary files (and the directory if this export created it)."""
        self.close()
        for path in self.tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)  # only if still empty

    def commit(self, model: nn.Module | None) -> None:
        for file in self.files:
            file.sync()
        self.close()
        for path, name in zip(self.tmp, self.names):
            os.replace(path, os.path.join(self.directory, name))
        keep = set(self.names)
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            _write_text(os.path.join(self.directory, INDEX_NAME), json.dumps(index, indent=2))
            keep.add(INDEX_NAME)
        for name in os.listdir(self.directory):  # stale shards of an earlier checkpoint
            if (_SHARD_RE.match(name) or name == INDEX_NAME) and name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))
        config = getattr(model, "config", None) if model is not None else None
        if config is not None and hasattr(config, "to_json_string"):
            _write_text(os.path.join(self.directory, "config.json"),
                        config.to_json_string(use_diff=True))
        generation = getattr(model, "generation_config", None) if model is not None else None
        if generation is not None and hasattr(generation, "to_json_string"):
            _write_text(os.path.join(self.directory, "generation_config.json"),
                        generation.to_json_string(use_diff=True))


def _write_text(path: str, text: str) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class MemorySink:
    """Full CPU tensors on dst, filled in place."""

    def __init__(self, entries: list[Entry]) -> None:
        self.tensors = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in entries}
        self.flat = {k: t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
                     for k, t in self.tensors.items()}

    def write(self, key: str, offset: int, data: torch.Tensor) -> None:
        self.flat[key][offset : offset + data.numel()].copy_(data)

    def address_shift(self, key: str, offset: int) -> int:
        """Any address will do: the bytes are copied into place."""
        return 0

    def abort(self) -> None:
        """Nothing to undo: the tensors are dropped with the sink."""


# -- data ------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t``: a DTensor's local shard, else ``t`` itself."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _local_bytes(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t`` (a DTensor's local shard) as flat uint8 bytes, on the device
    it lives on: a view where the block is contiguous, else one contiguous copy of the block
    (never of the full tensor)."""
    return _local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def _scatter(sink: Any, entry: Entry, piece: Piece, start: int, data: torch.Tensor) -> None:
    """Writes ``data``, bytes ``[start, start + n)`` of the piece's local bytes, to its runs."""
    cursor, end = 0, start + data.numel()
    for offset, n in piece.runs(entry):
        lo, hi = max(start, cursor), min(end, cursor + n)
        if lo < hi:
            sink.write(entry.key, offset + (lo - cursor), data[lo - start : hi - start])
        cursor += n
        if cursor >= end:
            break


class _PinnedSlots:
    """``count`` pinned host chunks, for GPU bytes on their way to the link or the disk.

    Leased from :mod:`distributed_ext._staging` (pinned memory has one owner) and returned
    by :meth:`release`; a slot may be used until then, and only by one transfer at a time.
    """

    def __init__(self, count: int, chunk: int) -> None:
        self.size = chunk + 2 * _direct_io.ALIGN
        self.lease = _staging.acquire(count * self.size)

    def view(self, slot: int, n: int, shift: int = 0) -> torch.Tensor:
        """``n`` bytes of slot ``slot``, starting at an address ``shift`` (mod ``ALIGN``), so
        that a direct write of them to a file offset with that shift needs no copy."""
        base = self.lease.tensor[slot * self.size : (slot + 1) * self.size]
        return _direct_io.place(base, n, shift)

    def release(self) -> None:
        self.lease.release()


def _placement(sink: Any, entry: Entry, piece: Piece, start: int) -> int:
    """The address shift at which bytes ``start..`` of a piece go to the sink without a copy
    (their file offset's, where the piece is one run of a file), else 0."""
    runs = piece.runs(entry)
    return sink.address_shift(entry.key, runs[0][0] + start) if len(runs) == 1 else 0


def _write_local(sink: Any, entry: Entry, piece: Piece, data: torch.Tensor, chunk: int,
                 pinned: _PinnedSlots | None, slot: int) -> None:
    """Writes a piece's local bytes to the sink: from host memory as they are; from a GPU
    chunk by chunk through pinned slot ``slot`` (never the whole block on the host)."""
    if data.device.type == "cpu":
        _scatter(sink, entry, piece, 0, data)
        return
    assert pinned is not None
    for s in range(0, data.numel(), chunk):
        n = min(chunk, data.numel() - s)
        host = pinned.view(slot, n, _placement(sink, entry, piece, s))
        host.copy_(data[s : s + n])  # D2H into pinned memory; returns once it is there
        _scatter(sink, entry, piece, s, host)


def _needs_pinned(state: dict[str, torch.Tensor], pieces: list[tuple[Entry, Piece]]) -> bool:
    """Whether any of these pieces' bytes live on a GPU (only then is pinned memory taken)."""
    return any(_local(state[e.key]).device.type != "cpu" for e, _p in pieces)


# Buffers of transfers that were posted when a peer failed: the transport may still read or
# write them, so they are never freed (the group is unusable by then anyway).
_ABANDONED: list[Any] = []


def _transfer(state: dict[str, torch.Tensor], entries: list[Entry], sink: Any,
              ctx: _agree.GroupContext, dst_rank: int, chunk: int, what: str) -> None:
    """Moves every piece to dst's sink: dst's own directly, the others' over the link.

    The link carries host chunks on a CPU backend (gloo) and device chunks on NCCL; bytes
    that live elsewhere than the link wants cross over chunk by chunk: a GPU shard through
    pinned slots to gloo, a host shard through device slots to NCCL, and on dst a received
    device chunk through a pinned slot to the sink. No block is ever copied whole.
    """
    me = ctx.rank
    on_device = ctx.device.type == "cuda"  # NCCL: what crosses the link is device memory
    by_rank: dict[int, list[tuple[Entry, Piece]]] = {}
    for e in entries:
        for p in e.pieces:
            by_rank.setdefault(p.rank, []).append((e, p))
    mine = by_rank.get(me, [])

    gpu_shards = _needs_pinned(state, mine)  # any of this rank's pieces on a GPU
    if gpu_shards:
        # Our threads copy on their own (default) streams: whatever the caller's streams
        # still compute into the shards lands first.
        torch.cuda.synchronize()

    def body(_worker: Any) -> None:
        if on_device:
            torch.cuda.set_device(ctx.device)  # a new thread starts on GPU 0
        if me != dst_rank:
            _send(mine)
        else:
            _receive()

    def _send(items: list[tuple[Entry, Piece]]) -> None:
        # A sender that fails mid-stream (a shard that cannot be read) keeps the stream's
        # shape -- zeros for the rest, never committed -- so dst is not left waiting; the
        # failure is raised once every byte has been sent, and agreed in the final round.
        failure: BaseException | None = None
        zeros: torch.Tensor | None = None
        in_flight: collections.deque = collections.deque()  # two sends, each with its slot
        # Staging where the bytes live elsewhere than the link: 3 slots for 2 sends in flight.
        pinned = _PinnedSlots(3, chunk) if gpu_shards and not on_device else None
        dev_slots: torch.Tensor | None = None
        posted = 0
        done = False

        def wait_oldest() -> None:
            work = in_flight.popleft()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - names the receiver
                _ABANDONED.append((in_flight, pinned, dev_slots))
                raise _watch.PeerFailure(ctx.ranks[dst_rank], exc) from exc

        try:
            for e, p in items:
                nbytes = p.block.numel * e.dtype.itemsize
                data = None
                if failure is None:
                    try:
                        data = _local_bytes(state[e.key])
                    except BaseException as exc:  # noqa: BLE001
                        failure = exc
                for s in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - s)
                    if len(in_flight) == 2:
                        wait_oldest()  # its slot is free again
                    slot = posted % 3
                    if data is None:
                        if zeros is None:
                            zeros = torch.zeros(chunk, dtype=torch.uint8, device=ctx.device)
                        piece = zeros[:n]
                    elif data.device.type == ctx.device.type:
                        piece = data[s : s + n]  # sent from where it lives
                    elif on_device:  # a host shard to NCCL: through a device slot
                        if dev_slots is None:
                            dev_slots = torch.empty((3, chunk), dtype=torch.uint8,
                                                    device=ctx.device)
                        piece = dev_slots[slot, :n]
                        # Stream-ordered after the send that last read this slot (its
                        # wait() made the current stream wait for it).
                        piece.copy_(data[s : s + n])
                    else:  # a GPU shard to gloo: through a pinned slot
                        assert pinned is not None
                        piece = pinned.view(slot, n)
                        piece.copy_(data[s : s + n])
                    in_flight.append(dist.isend(piece, ctx.ranks[dst_rank], group=ctx.group))
                    posted += 1
            while in_flight:
                wait_oldest()
            if on_device:
                torch.cuda.current_stream(ctx.device).synchronize()  # every send has left
            done = True
        finally:
            if pinned is not None and done:
                pinned.release()
        if failure is not None:
            raise _watch.LocalFailure(failure)

    def _receive() -> None:
        failures: list[BaseException] = []  # the first is raised; appended from two threads

        def write(e: Entry, p: Piece, off: int, data: torch.Tensor) -> None:
            # A sink that fails (a full disk) stops writing, but dst keeps receiving, so no
            # sender is left blocked; the failure is raised once everything has arrived.
            if not failures:
                try:
                    _scatter(sink, e, p, off, data)
                except BaseException as exc:  # noqa: BLE001
                    failures.append(exc)

        # Pinned slots: 0 for the own-blocks thread (GPU shards), 1 for received device chunks.
        pinned = _PinnedSlots(2, chunk) if gpu_shards or on_device else None

        def write_own() -> None:
            if on_device:
                torch.cuda.set_device(ctx.device)
            for e, p in mine:
                if failures:
                    return
                try:
                    _write_local(sink, e, p, _local_bytes(state[e.key]), chunk, pinned, 0)
                except BaseException as exc:  # noqa: BLE001 - raised after the others arrive
                    failures.append(exc)

        # Two receives in flight per sender, each written as it lands, while a second thread
        # writes dst's own blocks: the link, the disk and the senders all keep busy.
        plans: dict[int, collections.deque] = {}
        for r, items in by_rank.items():
            if r == me:
                continue
            plans[r] = collections.deque(
                (e, p, off, min(chunk, p.block.numel * e.dtype.itemsize - off))
                for e, p in items for off in range(0, p.block.numel * e.dtype.itemsize, chunk))
        if on_device:
            free = {r: list(torch.empty((2, chunk), dtype=torch.uint8, device=ctx.device))
                    for r in plans}
        else:
            free = {r: [torch.empty(chunk + 2 * _direct_io.ALIGN, dtype=torch.uint8)
                        for _ in range(2)] for r in plans}
        pending: dict[int, collections.deque] = {r: collections.deque() for r in plans}

        def post(r: int) -> None:
            while plans[r] and free[r]:
                e, p, off, n = plans[r].popleft()
                raw = free[r].pop()
                if on_device:
                    buf = raw[:n]
                else:
                    # Placed as aligned as its place in the file: written direct, no copy.
                    buf = _direct_io.place(raw, n, _placement(sink, e, p, off))
                work = dist.irecv(buf, ctx.ranks[r], group=ctx.group)
                pending[r].append((work, raw, buf, e, p, off))

        for r in plans:
            post(r)
        own = threading.Thread(target=write_own, name=f"distributed_ext {what} (own blocks)",
                               daemon=True)
        own.start()
        clean = False
        try:
            while any(pending.values()):
                for r in plans:
                    if not pending[r]:
                        continue
                    work, raw, buf, e, p, off = pending[r].popleft()
                    try:
                        work.wait()
                    except BaseException as exc:  # noqa: BLE001 - names the sender
                        # Receives still posted keep writing into their buffers: keep them.
                        _ABANDONED.append((pending, free, pinned))
                        raise _watch.PeerFailure(ctx.ranks[r], exc) from exc
                    if on_device:
                        assert pinned is not None
                        host = pinned.view(1, buf.numel(), _placement(sink, e, p, off))
                        host.copy_(buf)  # stream-ordered after the receive; host waits
                        write(e, p, off, host)
                    else:
                        write(e, p, off, buf)
                    free[r].append(raw)
                    post(r)
            clean = True
        finally:
            own.join()  # its writes end before anything closes the sink's files
            if pinned is not None and clean:
                pinned.release()
        if failures:
            raise _watch.LocalFailure(failures[0])

    _watch.run_watched(body, ctx.ranks, what)


def _export(model_or_state: nn.Module | dict, dst: int, group: dist.ProcessGroup | None,
            make_sink: Callable[[list[Entry]], Any], chunk_bytes: int | None, what: str
            ) -> tuple[Any, nn.Module | None]:
    """The rounds of the module docstring; returns (dst's committed-to-be sink, the model)."""
    state, model = resolve_state(model_or_state)
    chunk = EXPORT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk <= 0:
        raise ValueError(f"{what}: chunk_bytes must be positive, got {chunk_bytes}")

    recorded = recorded_plan(model) if model is not None else None

    def describe() -> dict[str, Any]:
        return {"plan": None if recorded is None else astuple(recorded),
                "entries": [describe_entry(k, v) for k, v in state.items()]}

    if not runtime.is_initialized():
        entries = plan_entries([describe()["entries"]], 0, [0], recorded)
        sink = make_sink(entries)
        pinned = None
        try:
            items = [(e, p) for e in entries for p in e.pieces]
            pinned = _PinnedSlots(1, chunk) if _needs_pinned(state, items) else None
            for e, p in items:
                _write_local(sink, e, p, _local_bytes(state[e.key]), chunk, pinned, 0)
        except BaseException:
            sink.abort()
            raise
        finally:
            if pinned is not None:
                pinned.release()
        return sink, model
    ctx = _agree.resolve_group(group, what)
    dst_rank = ctx.group_rank_of(dst)
    if dst_rank is None:
        raise ValueError(f"{what}: dst={dst} is not a member of the group (global ranks "
                         f"{ctx.ranks})")
    with _watch.DeferredInterrupts() as deferred:
        described = all_reduce(f"{what}: metadata", describe, list, group)
        # From here on every rank computes the same from the same metadata: an error below is
        # raised by every rank alike.
        entries = plan_entries([d["entries"] for d in described], dst_rank, ctx.ranks,
                               agree_plan([d["plan"] for d in described], ctx.ranks))
        sink = None
        try:
            interrupted = deferred.take()  # one that landed in the metadata round fails here
            if interrupted is not None:
                raise interrupted
            if ctx.rank == dst_rank:
                sink = make_sink(entries)
            prepared = _agree.Status()
        except BaseException as exc:  # noqa: BLE001 - carried to every rank
            prepared = _agree.Status.failed(exc)
        _agree.raise_first_failure(f"{what} (preparing)", _agree.exchange(prepared, ctx, what),
                                   ctx, prepared)
        failure: BaseException | None = None
        try:
            _transfer(state, entries, sink, ctx, dst_rank, chunk, what)
        except _watch.PeerFailure as exc:
            if sink is not None:
                sink.abort()
            raise _agree.peer_failure_error(what, exc) from exc.cause
        except BaseException as exc:  # noqa: BLE001 - a full disk on dst: agreed below
            failure = exc
        failure = failure or deferred.take()
        final = _agree.Status() if failure is None else _agree.Status.failed(failure)
        try:
            _agree.raise_first_failure(f"{what} (transfer)", _agree.exchange(final, ctx, what),
                                       ctx, final)
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
    return sink, model


def export_hf_checkpoint(model_or_state: nn.Module | dict, directory: str | os.PathLike[str],
                         dst: int = 0, group: dist.ProcessGroup | None = None, *,
                         max_shard_size: int | str = "5GB",
                         chunk_bytes: int | None = None) -> None:
    """Writes a sharded model's full state as ONE Hugging Face checkpoint on global rank ``dst``.

    Collective over ``group``. ``model_or_state`` is an ``nn.Module`` (its ``state_dict()``,
    tied weights written once as ``save_pretrained`` does; ``config.json`` and
    ``generation_config.json`` from its ``config``/``generation_config``) or a state dict.
    DTensors (FSDP2 ``fully_shard`` with uneven or empty shards, ``Shard(d)``, ``Replicate``,
    2-D meshes) are assembled from their local shards; a plain tensor every rank holds is
    written once from one rank (dst's own copy if it has one) and its copies never cross the
    link; a key only some ranks hold comes from one that holds it (replicas spread over their
    holders). A model that records a :class:`~distributed_ext.DistributionPlan` is checked
    against it: the group must be the plan's world, and every plain tensor held by every rank
    (the dense part under ``dense="replicate"``: written from dst's copy, none crosses the
    link) or by an expert shard's ``edp`` replicas; anything else raises ValueError on every
    rank before any byte moves.

    Output: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_size`` each plus ``model.safetensors.index.json``, readable by
    ``safetensors.safe_open`` and ``from_pretrained``.

    Memory: dst never holds the model. Each file's header is computed from the metadata the
    ranks exchange, and bytes are written to their place as they arrive: dst holds two
    transport chunks per sender (``chunk_bytes``, default 16 MiB), two 8 MiB bounce buffers
    for direct writes, and metadata; its own blocks' bytes are written from its own tensors.
    The files bypass the page cache (``O_DIRECT``) where the filesystem allows, so the
    checkpoint takes no kernel memory either, and is on the disk when the call returns
    (elsewhere the page cache holds it until ``fsync``, before the rename). A sender holds
    nothing beyond its shards where they are contiguous (else one contiguous copy of one
    block at a time, on the block's own device).

    GPU-resident shards never cross whole: on NCCL they are sent from device memory chunk by
    chunk and dst receives into two device chunks per sender, staged through a pinned chunk
    to the files; on gloo a sender stages them through three pinned chunks, and dst writes its
    own through one. Device memory: at most two chunks per sender on dst, three on a sender
    whose shards are on the host under NCCL; no rank gathers a full parameter on its GPU.
    Pinned memory: at most three chunks (leased from the package's one pinned pool).

    Failure: a bad entry (a ``Partial`` DTensor, a dtype safetensors cannot store, ranks that
    disagree on a key's dtype or shape) raises on every rank before any byte moves; a failure
    during the transfer (a full disk, a dead peer, Ctrl-C) makes every rank raise. Files are
    written under temporary names in ``directory`` and renamed into place only when every
    byte has landed, so no partial or mixed checkpoint is ever visible; stale shards of an
    earlier checkpoint there are removed on success, as ``save_pretrained`` does.

    Args:
        model_or_state: The (sharded) model, or a state dict, on every rank of ``group``.
        directory: Where dst writes (created if missing).
        dst: The global rank that writes.
        group: The process group (default: the world).
        max_shard_size: The largest file, in bytes or as ``"5GB"``/``"500MiB"``.
        chunk_bytes: Transport piece size (default 16 MiB).
    """
    what = "export_hf_checkpoint"
    max_shard = parse_shard_size(max_shard_size)
    path = os.fspath(directory)

    def make_sink(entries: list[Entry]) -> FileSink:
        return FileSink(path, layout_files(entries, max_shard))

    sink, model = _export(model_or_state, dst, group, make_sink, chunk_bytes, what)
    if sink is not None:
        sink.commit(model)
    if runtime.is_initialized():
        runtime.barrier(group)  # the checkpoint is in place before any rank returns


def gather_full_state(model_or_state: nn.Module | dict, dst: int = 0,
                      group: dist.ProcessGroup | None = None) -> dict | None:
    """The full state of a sharded model (or state dict) as CPU tensors on ``dst``; None elsewhere.

    Collective; the same inputs, keys, assembly and failure rules as
    :func:`export_hf_checkpoint` (tied weights once). Memory on dst: the full state once (the
    returned CPU tensors, filled in place) plus two transport chunks per sender (and the
    pinned and device chunks of :func:`export_hf_checkpoint` for GPU-resident shards);
    nothing else.
    """
    what = "gather_full_state"
    sink, _model = _export(model_or_state, dst, group, MemorySink, None, what)
    return None if sink is None else sink.tensors
