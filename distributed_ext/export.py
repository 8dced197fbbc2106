"""A sharded model's full state on one rank: as a Hugging Face checkpoint, or as a dict.

The flow, on every rank of the group:

1. Metadata round (``all_reduce``): each rank describes its in-memory entries as compact
   tables -- its keys, and per key an index into a few distinct signatures (dtype, global
   shape, and for a DTensor its placements and mesh). A bad entry (a ``Partial`` placement,
   a dtype safetensors cannot store) raises on every rank before any byte moves.
2. Plan, computed alike on every rank from that metadata: who holds which block of each
   in-memory tensor (a DTensor's blocks computed locally from its shape, mesh and
   placements), the tensors to write (for a model, the hub's layout that ``save_pretrained``
   writes: :mod:`distributed_ext._keys`, each written tensor a set of boxes of in-memory
   tensors), and for each, which rank sends which block (replicas once: dst's own copy if it
   has one, else the least-loaded holder's; a model's recorded
   :class:`~distributed_ext.DistributionPlan` is checked against what the ranks hold), and
   an agreed error for keys whose ranks disagree on dtype or shape, whose blocks do not cover
   the tensor, or whose conversion cannot be streamed.
3. Preparing round: dst opens temporary files in the target directory (or allocates the full
   tensors); a failure raises on every rank.
4. Data: each rank's pieces travel as the messages of :func:`plan_messages` -- large pieces
   in ``chunk_bytes`` pieces from their own memory, small ones packed by the compiled core --
   and dst writes each message to its places as it arrives (small runs in one native call per
   file, large ones with ``O_DIRECT`` where the filesystem takes it:
   :mod:`distributed_ext._direct_io`), while a second thread writes dst's own pieces, which
   never cross the link. Waits are watched (:mod:`distributed_ext._watch`).
5. Final round: any failure (a full disk, a dead peer, an interrupt) makes every rank raise,
   and dst removes its temporary files; else dst renames them into place, writes the index,
   ``config.json`` and ``generation_config.json``, and removes stale shards of an earlier
   checkpoint, as ``save_pretrained`` does.

The checkpoint's layout and the families tested: ``docs/checkpoint.md``.
"""

from __future__ import annotations

import array
import collections
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import _agree, _direct_io, _keys, _native, _staging, _watch, runtime
from distributed_ext.collectives import _require_group_if_launched, all_reduce
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
# The largest header safetensors' reader takes (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# Runs shorter than this are written in one native call per file and message (a direct write
# of them would gain nothing: at most a block or two of them is aligned).
SMALL_RUN = 64 * 2**10
# The most small pieces one message packs (less than a chunk: the stages then overlap).
PACK_BYTES = 2**20
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# -- input -----------------------------------------------------------------------------------


def _dtensor_type() -> type | None:
    """torch's DTensor class if its module is loaded (a state with DTensors has loaded it)."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None)
    return _DTENSOR


_DTENSOR: type | None = None


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector for the block (reference counting still frees
    everything without cycles). Why: an export allocates a few small objects per tensor, and
    each collection that this triggers walks every object the process holds -- a model's
    100k DTensors and modules -- which made an export of many small tensors 2.5x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def resolve_state(model_or_state: nn.Module | dict) -> tuple[dict[str, torch.Tensor], nn.Module | None]:
    """The in-memory entries to export, and the model if any.

    For a module: its ``state_dict()``, less the keys ``save_pretrained`` leaves out: tied
    weights (the keys of ``_tied_weights_keys`` that alias their source), so that
    ``from_pretrained`` re-ties them, and ``_keys_to_ignore_on_save``. The keys are the
    model's in-memory names; :mod:`distributed_ext._keys` maps them to the hub's.
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
        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
            state.pop(key, None)
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


@dataclass(frozen=True, slots=True)
class Block:
    """A block of a tensor: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    numel: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))


# -- what each rank holds: described locally, exchanged as compact tables ------------------


@dataclass(frozen=True)
class Signature:
    """What every holder of an in-memory key must agree on: dtype, global shape and, for a
    DTensor, its placements (``("S", dim)`` / ``("R",)``) and mesh (global ranks, shape)."""

    dtype: str
    shape: tuple[int, ...]
    placements: tuple[tuple, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None

    def show(self) -> str:
        where = "" if self.placements is None else f" {self.placements} on mesh {self.mesh_shape}"
        return f"{self.dtype} {self.shape}{where}"


@dataclass
class Described:
    """One rank's entries: its keys in state order, each with an index into ``signatures``
    (a few distinct ones for a whole model). This, not a record per entry, is what the
    ranks exchange -- and in the metadata round only its :meth:`summary`: where every rank
    holds the same keys (FSDP2, a replicated model) the keys never cross the link."""

    keys: list[str] | None
    sig_ids: bytes | None  # array('i') of one index per key
    signatures: list[Signature]
    plan: tuple | None = None
    args: Any = None  # the call's _Args, agreed in the same round
    digest: bytes = b""  # of keys and sig_ids (a summary's, which has neither)

    def summary(self) -> Described:
        """This without its keys and ids, with their digest: a few hundred bytes whatever
        the number of keys."""
        assert self.keys is not None and self.sig_ids is not None
        h = hashlib.blake2b(digest_size=16)
        h.update(len(self.keys).to_bytes(8, "little"))
        h.update("\0".join(self.keys).encode("utf-8", "surrogatepass"))
        h.update(self.sig_ids)
        return Described(None, None, self.signatures, self.plan, self.args, h.digest())


def resolve_described(summaries: list[Described], mine: Described, what: str,
                      group: dist.ProcessGroup | None) -> list[Described]:
    """Every rank's Described from the ranks' summaries (the same on every rank): where all
    digests are equal, each rank's keys are this rank's own (nothing more is sent); else
    the keys and ids are exchanged in one more agreed round, which every rank joins (every
    rank sees the same digests)."""
    if all(d.digest == summaries[0].digest for d in summaries):
        tables = [(mine.keys, mine.sig_ids)] * len(summaries)
    else:
        tables = all_reduce(f"{what}: keys", lambda: (mine.keys, mine.sig_ids), list, group)
    return [Described(keys, ids, d.signatures, d.plan, d.args, d.digest)
            for d, (keys, ids) in zip(summaries, tables)]


def _placement_code(key: str, p: Any) -> tuple:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Partial):
        raise ValueError(f"state[{key!r}] is a DTensor with a Partial placement ({p}): its "
                         "values are unreduced sums; call .redistribute(placements="
                         "[Replicate()]) or .full_tensor() first")
    if type(p) is Shard:  # not _StridedShard: its rows are not one range per rank
        return ("S", p.dim)
    if isinstance(p, Replicate):
        return ("R",)
    raise ValueError(f"state[{key!r}] is a DTensor with placement {p!r}, which the export "
                     "cannot place exactly; call .redistribute(placements=[Shard(0)]) or "
                     ".full_tensor() first")


def describe_state(state: dict[str, Any], plan: tuple | None = None,
                   local: dict[str, torch.Tensor] | None = None) -> Described:
    """This rank's entries as compact tables; TypeError/ValueError naming the key of an
    entry the export cannot write (not a tensor, a dtype safetensors cannot store, a
    ``Partial`` or ``_StridedShard`` DTensor, a local shard of another shape than its
    placements say, a sparse or meta tensor). ``local``: filled with each key's local block
    (a DTensor's shard, else the tensor), which the transfer reads.

    Per entry this is a few attribute reads and one dict lookup (a model has 100k tensors):
    everything a signature determines (dtype, placements, the expected local shape) is
    checked once per signature.
    """
    dtensor = _dtensor_type()
    # (dtype, shape, placements, id(mesh)) -> (signature index, this rank's local shape)
    sigs: dict[Any, tuple[int, torch.Size | None]] = {}
    table: list[Signature] = []
    ids = array.array("i")
    blocks = {} if local is None else local
    strided = torch.strided
    for key, t in state.items():
        kind = type(t)
        if kind is dtensor:  # (exactly: a subclass takes the checked path below)
            spec = t._spec
            block = t._local_tensor
            meta = spec.tensor_meta  # dtype and shape without a call into the dispatcher
            sig_key = (meta.dtype, meta.shape, spec.placements, id(spec.mesh)) \
                if meta is not None else (t.dtype, t.shape, spec.placements, id(spec.mesh))
            got = sigs.get(sig_key)
            if got is None:
                got = sigs[sig_key] = _describe_dtensor(key, t, table)
            if block.is_conj() or block.is_neg() or (got[1] is not None
                                                     and block.shape != got[1]):
                _refuse_block(key, block, got[1])
        elif kind is torch.Tensor or kind is nn.Parameter:
            block = t
            got = sigs.get((t.dtype, t.shape))
            if got is None:
                got = sigs[(t.dtype, t.shape)] = _describe_plain(key, t, table)
            if block.layout is not strided or block.is_meta or block.is_conj() or block.is_neg():
                _refuse_block(key, block, None)
        else:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state[{key!r}] is a {type(t).__name__}, not a tensor; a "
                                "checkpoint holds tensors only -- drop it or store it in "
                                "the config")
            block = _local(t)
            if dtensor is not None and isinstance(t, dtensor):
                spec = t._spec
                sig_key = (t.dtype, t.shape, spec.placements, id(spec.mesh))
                got = sigs.get(sig_key)
                if got is None:
                    got = sigs[sig_key] = _describe_dtensor(key, t, table)
            else:
                got = sigs.get((t.dtype, t.shape))
                if got is None:
                    got = sigs[(t.dtype, t.shape)] = _describe_plain(key, t, table)
                if block.layout is not strided or block.is_meta:
                    _refuse_block(key, block, None)
            if block.is_conj() or block.is_neg() or (got[1] is not None
                                                     and block.shape != got[1]):
                _refuse_block(key, block, got[1])
        ids.append(got[0])
        blocks[key] = block
    return Described(list(state), ids.tobytes(), table, plan)


def _check_dtype(key: str, t: torch.Tensor) -> None:
    if t.dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"state[{key!r}] has dtype {t.dtype}, which safetensors cannot "
                        "store; convert it with .to(...) first")


def _describe_dtensor(key: str, t: Any, table: list[Signature]
                      ) -> tuple[int, torch.Size | None]:
    """A DTensor signature seen for the first time: checked, added to ``table``; returns its
    index and this rank's expected local shape (None where this rank holds none)."""
    _check_dtype(key, t)
    spec = t._spec
    mesh = spec.mesh
    codes = tuple(_placement_code(key, p) for p in spec.placements)
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    sig = Signature(_dtype_name(t.dtype), tuple(spec.shape), codes, ranks, tuple(mesh.mesh.shape))
    expected = _dtensor_blocks(sig).get(_my_global_rank(), (None, None))[1]
    table.append(sig)
    return len(table) - 1, None if expected is None else torch.Size(expected)


def _describe_plain(key: str, t: torch.Tensor, table: list[Signature]) -> tuple[int, None]:
    """A plain tensor's signature seen for the first time: checked, added to ``table``."""
    _check_dtype(key, t)
    table.append(Signature(_dtype_name(t.dtype), tuple(t.shape)))
    return len(table) - 1, None


def _refuse_block(key: str, block: torch.Tensor, expected: tuple[int, ...] | None) -> None:
    """Raises for a local block the export cannot read as it is (called only for one)."""
    if block.layout != torch.strided or block.is_meta:
        raise TypeError(f"state[{key!r}] is a {block.layout} or meta tensor; export "
                        "dense, materialized tensors")
    if block.is_conj() or block.is_neg():
        raise ValueError(f"state[{key!r}] is a lazily "
                         f"{'conjugated' if block.is_conj() else 'negated'} view: its memory "
                         "holds other values than it reads as; call .resolve_conj() / "
                         ".resolve_neg() on it first")
    raise ValueError(f"state[{key!r}]: its local shard has shape {tuple(block.shape)}, but "
                     f"its placements say {None if expected is None else tuple(expected)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _my_global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@functools.lru_cache(maxsize=4096)
def _dtensor_blocks(sig: Signature) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every mesh rank's block of a DTensor (global rank -> (offset, shape)), computed from its
    global shape, mesh and placements alone -- the same on every rank, nothing exchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    assert sig.placements is not None and sig.mesh_ranks is not None and sig.mesh_shape
    placements = [Shard(c[1]) if c[0] == "S" else Replicate() for c in sig.placements]
    out = {}
    for i, g in enumerate(sig.mesh_ranks):
        coord, rest = [], i
        for n in reversed(sig.mesh_shape):
            rest, c = divmod(rest, n)
            coord.append(c)
        shape, offset = _compute_local_shape_and_global_offset(
            sig.shape, sig.mesh_shape, list(reversed(coord)), placements)
        out[g] = (tuple(offset), tuple(shape))
    return out


# -- plan ------------------------------------------------------------------------------------


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

    def runs(self, entry: Entry) -> Runs:
        """The block's contiguous runs in the full tensor (:func:`block_runs`), computed once."""
        if self._runs is None:
            self._runs = _piece_runs(self.block, entry.shape, entry.dtype.itemsize)
        return self._runs


def _piece_runs(b: Block, shape: tuple[int, ...], itemsize: int) -> Runs:
    """A block's runs in a tensor of ``shape`` (shared between pieces: immutable)."""
    if b.shape[1:] == shape[1:] and b.shape:
        # Whole rows (a Shard(0) block, a whole tensor): one run, nothing to search.
        row = b.numel // b.shape[0] * itemsize if b.shape[0] else 0
        return Runs(b.offset[0] * row, b.numel * itemsize)
    return _cached_runs(b, shape, itemsize)


@dataclass(slots=True)
class Entry:
    """A tensor as the checkpoint holds it, and the pieces it is assembled from."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)  # shared between entries: never mutate
    index: int = 0  # its position in the plan (how sinks and row tables name it)
    source: str = ""  # the in-memory tensor its pieces read, where they do not name one
    nbytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Holding:
    """How the ranks hold an in-memory key: its signature and each holder's block (one
    object may serve every key of a signature; ``key`` is then the first of them)."""

    key: str
    sig: Signature
    blocks: list[tuple[int, Block]]  # (group rank, block), in rank order


def merge_holdings(described: list[Described], ranks: list[int], dst_rank: int,
                   recorded: DistributionPlan | None) -> dict[str, Holding]:
    """Who holds which in-memory key, and which block of it (the same on every rank);
    ValueError if holders disagree on a key's dtype, shape or placements, a DTensor's mesh is
    not the group's ranks, or a plain tensor is held against the recorded plan."""
    world = len(described)
    if recorded is not None and recorded.world_size != world:
        raise ValueError(
            f"the model records {recorded} but the export's group has {world} rank(s): every "
            f"rank that holds a part of the model must take part (pass group=None, or a group "
            f"of the plan's {recorded.world_size} ranks)")
    first = described[dst_rank]
    # The common case: every rank holds the same keys with the same signatures (an FSDP2
    # model, a replicated state): one comparison per rank instead of one per key and rank.
    same = all(d.keys == first.keys and d.sig_ids == first.sig_ids
               and d.signatures == first.signatures for d in described)
    holders: dict[str, list[tuple[int, Signature]]] = {}
    if same:
        sigs = array.array("i")
        sigs.frombytes(first.sig_ids)
        table = first.signatures
        # One holding per signature, shared by its keys (checked once, with the first key).
        shared: dict[int, Holding] = {}
        out = {}
        for key, i in zip(first.keys, sigs):
            holding = shared.get(i)
            if holding is None:
                sig = table[i]
                holding = shared[i] = _holding(key, [(r, sig) for r in range(world)], sig,
                                               ranks, world, recorded)
            out[key] = holding
        return out
    for r in [dst_rank] + [r for r in range(world) if r != dst_rank]:
        d = described[r]
        sigs = array.array("i")
        sigs.frombytes(d.sig_ids)
        for key, i in zip(d.keys, sigs):
            holders.setdefault(key, []).append((r, d.signatures[i]))
    out = {}
    for key, held in holders.items():
        held.sort(key=lambda rs: rs[0])
        kinds = {s for _r, s in held}
        if len(kinds) > 1:
            listing = "; ".join(f"rank {ranks[r]}: {s.show()}" for r, s in held)
            raise ValueError(f"state[{key!r}] differs between ranks ({listing}); every rank "
                             "that holds a key must hold the same dtype, shape and placements")
        out[key] = _holding(key, held, held[0][1], ranks, world, recorded)
    return out


def _holding(key: str, held: list[tuple[int, Signature]], sig: Signature, ranks: list[int],
             world: int, recorded: DistributionPlan | None) -> Holding:
    if sig.placements is None:
        if recorded is not None:
            allowed = sorted({world, recorded.edp})
            if len(held) not in allowed:
                raise ValueError(
                    f"state[{key!r}] is held by {len(held)} rank(s) "
                    f"({[ranks[r] for r, _s in held]}), but the model records {recorded}: "
                    f"a plain tensor is held by {' or '.join(map(str, allowed))} ranks "
                    "(every rank, or an expert shard's edp replicas); record the plan the "
                    "model was distributed with")
        whole = Block((0,) * len(sig.shape), sig.shape)
        return Holding(key, sig, [(r, whole) for r, _s in held])
    blocks = _dtensor_blocks(sig)
    if len(held) != len(blocks) or any(ranks[r] not in blocks for r, _s in held):
        raise ValueError(
            f"state[{key!r}] is a DTensor on a mesh of global ranks {sorted(blocks)}, but "
            f"ranks {[ranks[r] for r, _s in held]} of the export's group (global ranks "
            f"{ranks}) hold it; export over the group its mesh spans")
    return Holding(key, sig, _group_blocks(sig, tuple(ranks)))


@functools.lru_cache(maxsize=4096)
def _group_blocks(sig: Signature, ranks: tuple[int, ...]) -> list[tuple[int, Block]]:
    """A DTensor's blocks by group rank, in rank order: one list per signature, shared by
    every key of that signature (read-only)."""
    blocks = _dtensor_blocks(sig)
    group_rank = {g: r for r, g in enumerate(ranks)}
    return [(group_rank[g], Block(*blocks[g])) for g in sorted(blocks, key=group_rank.get)]


def plan_entries(holdings: dict[str, Holding], written: list[_keys.Written] | None,
                 dst_rank: int, ranks: list[int], keep: int | None = None) -> list[Entry]:
    """The export plan (the same on every rank): for each written tensor, which rank sends
    which block of it and from where; ValueError if a written tensor cannot be streamed or
    its blocks do not cover it. ``written`` None: every in-memory tensor as it is.

    A block several ranks hold (a replica) is sent once: by dst when it holds one, so that it
    never crosses the link, else by the holder that has the fewest bytes to send so far, so
    that replicas (an expert shard's ``edp`` copies, HSDP's replicated shards) spread the
    sending over their holders.

    ``keep``: make only this group rank's pieces (a sender needs no other's); every check
    and every choice is still made for all of them, so the kept pieces are the same.
    """
    load = [0] * len(ranks)  # bytes each rank sends so far
    entries = []
    # A whole in-memory tensor's distinct blocks and their owners: computed once per list of
    # blocks, which every key of one DTensor signature shares.
    distinct: dict[int, list] = {}
    if written is None:  # a state dict: every tensor written whole, under its own key
        for key, holding in holdings.items():
            entry = Entry(key, _DTYPE_BY_NAME[holding.sig.dtype], holding.sig.shape,
                          index=len(entries))
            _add_whole(entry, key, holding, distinct, dst_rank, load, keep, share=True)
            entries.append(entry)
        return entries
    for w in written:
        if w.unstreamable is not None:
            raise ValueError(
                f"{w.key!r}: transformers writes it through {w.unstreamable}, which cannot be "
                "streamed from the shards as blocks; call gather_full_state(model, "
                "hub_keys=False) and then save_pretrained on rank 0 with that state")
        entry = Entry(w.key, w.dtype, w.shape, index=len(entries))
        itemsize = w.dtype.itemsize
        covered = 0
        for part in w.parts:
            holding = holdings[part.source]
            _distinct_blocks(part.source, holding, distinct)  # they tile it exactly
            if _is_whole(part, holding.sig.shape):
                covered += _add_whole(entry, part.source, holding, distinct, dst_rank, load,
                                      keep, share=len(w.parts) == 1)
                continue
            blocks: dict[Block, list[tuple[int, Block, list[int], list[int]]]] = {}
            for r, held in holding.blocks:
                meet = _overlap(part, held)
                if meet is not None:
                    blocks.setdefault(_intersect(part, *meet), []).append((r, held, *meet))
            for wb, owners in blocks.items():
                sender = _choose_sender([o[0] for o in owners], dst_rank, load)
                _r, held, lo, hi = next(o for o in owners if o[0] == sender)
                if sender != dst_rank:
                    load[sender] += wb.numel * itemsize
                covered += wb.numel
                if keep is None or sender == keep:
                    local, perm = _local_view(part, held, lo, hi)
                    entry.pieces.append(Piece(sender, wb, wb.numel * itemsize, part.source,
                                              local, perm))
        _check_covered(entry, covered)
        entries.append(entry)
    return entries


def _add_whole(entry: Entry, source: str, holding: Holding,
               distinct: dict[int, list], dst_rank: int, load: list[int],
               keep: int | None = None, share: bool = False) -> int:
    """Adds the pieces of a written tensor that is in-memory tensor ``source`` as it is (one
    per distinct block; ``keep``: only that rank's); returns the elements they cover (all of
    them: the blocks were checked to tile the tensor). ``share``: the entry has no other
    pieces, so it may take its signature's one list of pieces (no object per entry)."""
    got = _distinct_blocks(entry.key, holding, distinct)
    groups_list, fixed, covered = got[0], got[1], got[2]
    itemsize = entry.dtype.itemsize
    if fixed is not None:
        # No replica (FSDP2): every key of the signature has the same senders, blocks,
        # runs and bytes per sender; computed at its first key, then only counted.
        shared = got[3].get((itemsize, keep))
        if shared is None:
            runs = [_piece_runs(wb, entry.shape, itemsize) for _s, wb in fixed]
            pieces = [Piece(sender, wb, wb.numel * itemsize, _runs=wb_runs)
                      for (sender, wb), wb_runs in zip(fixed, runs)
                      if keep is None or sender == keep]
            sends = [(sender, wb.numel * itemsize) for sender, wb in fixed
                     if sender != dst_rank and wb.numel]
            shared = got[3][(itemsize, keep)] = (pieces, sends)
        pieces, sends = shared
        for sender, nbytes in sends:
            load[sender] += nbytes
        if share:
            entry.pieces, entry.source = pieces, source
        else:
            entry.pieces.extend(Piece(p.rank, p.block, p.nbytes, source, _runs=p._runs)
                                for p in pieces)
        return covered
    for wb, owners in groups_list:
        sender = _choose_sender(owners, dst_rank, load)
        if sender != dst_rank:
            load[sender] += wb.numel * itemsize
        if keep is None or sender == keep:
            entry.pieces.append(Piece(sender, wb, wb.numel * itemsize, source))
    return covered


def _distinct_blocks(key: str, holding: Holding, distinct: dict[int, list]) -> list:
    """A holding's distinct non-empty blocks and their owners (replicas grouped), computed
    once per list of blocks (every key of a signature shares one); ValueError naming ``key``
    unless they tile the tensor exactly -- every element in exactly one distinct block."""
    got = distinct.get(id(holding.blocks))
    if got is None:
        groups: dict[Block, list[int]] = {}
        for r, held in holding.blocks:
            if held.numel:
                groups.setdefault(held, []).append(r)
        # No replica among the blocks (FSDP2): each block's sender is its one owner, fixed
        # for every key of the signature, and what each rank sends is a constant per key.
        fixed = None
        if all(len(owners) == 1 for owners in groups.values()):
            fixed = [(owners[0], wb) for wb, owners in groups.items()]
        covered = sum(wb.numel for wb in groups)
        exact = _tiles_exactly(list(groups), holding.sig.shape)
        # [blocks and owners, fixed senders, elements covered, the fixed blocks' pieces and
        # what each sender sends, by (itemsize, kept rank) (made at the first key), the list
        # itself (kept with its id, so that the id is not reused), whether they tile it]
        got = distinct[id(holding.blocks)] = [list(groups.items()), fixed, covered, {},
                                              holding.blocks, exact]
    if not got[5]:
        listing = "; ".join(f"rank(s) {owners}: offset {b.offset} shape {b.shape}"
                            for b, owners in got[0][:8])
        raise ValueError(f"state[{key!r}]: the ranks' blocks of its {holding.sig.shape} "
                         f"elements overlap or leave gaps ({listing}{'; ...' if len(got[0]) > 8 else ''}); "
                         "every element must be held by exactly one block (or by identical "
                         "replicas of it)")
    return got


def _tiles_exactly(blocks: list[Block], shape: tuple[int, ...]) -> bool:
    """Whether distinct boxes tile a tensor of ``shape``: each inside it, pairwise disjoint,
    their volumes summing to its volume. The layouts torch's placements make are grids (per
    dim, intervals that partition the dim; every combination a block): checked in
    O(blocks); anything else pairwise."""
    if sum(b.numel for b in blocks) != math.prod(shape):
        return False
    if not shape:
        return len(blocks) == 1
    for b in blocks:
        if any(o < 0 or o + n > d for o, n, d in zip(b.offset, b.shape, shape)):
            return False
    per_dim = [sorted({(b.offset[d], b.offset[d] + b.shape[d]) for b in blocks})
               for d in range(len(shape))]
    partitions = all(
        iv[0][0] == 0 and iv[-1][1] == shape[d]
        and all(a[1] == b[0] for a, b in zip(iv, iv[1:])) for d, iv in enumerate(per_dim))
    if partitions and math.prod(len(iv) for iv in per_dim) == len(blocks):
        return True  # distinct blocks, each a grid cell, as many as cells: the grid itself
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            if all(ao < bo + bn and bo < ao + an
                   for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape)):
                return False
    return True


def check_keys(entries: list[Entry]) -> None:
    """ValueError naming the first key a safetensors reader would reject: ``__metadata__``
    (the header's own), or a string that is not valid UTF-8 (a lone surrogate)."""
    for e in entries:
        if e.key == "__metadata__":
            raise ValueError("state['__metadata__']: safetensors reserves this key for the "
                             "file's metadata; rename the tensor")
        try:
            e.key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"state[{e.key!r}]: the key is not valid UTF-8 ({exc.reason} at "
                             f"{exc.start}), which safetensors readers reject; rename the "
                             "tensor") from None


def _check_covered(entry: Entry, covered: int) -> None:
    if covered != math.prod(entry.shape):
        raise ValueError(f"state[{entry.key!r}]: the ranks' blocks cover {covered} of "
                         f"{math.prod(entry.shape)} elements (overlapping or missing shards)")


def _choose_sender(owners: list[int], dst_rank: int, load: list[int]) -> int:
    """Who sends a block: its one owner; dst if it holds a replica (it never crosses the
    link); else the replica holder with the fewest bytes to send so far."""
    if len(owners) == 1:
        return owners[0]
    if dst_rank in owners:
        return dst_rank
    return min(owners, key=lambda r: (load[r], r))


def _is_whole(part: _keys.Part, src_shape: tuple[int, ...]) -> bool:
    """Whether a part is its in-memory tensor as it is (the written tensor is that tensor)."""
    nd = len(src_shape)
    return (part.shape == src_shape and part.src_dims == tuple(range(nd))
            and not any(part.at) and not any(part.src_start))


def _overlap(part: _keys.Part, held: Block) -> tuple[list[int], list[int]] | None:
    """Where a part's box and a holder's block of its in-memory tensor meet: the first and
    one-past-last index per in-memory dim, or None if they do not."""
    lo, hi = [], []
    for d in range(len(held.shape)):
        a = max(part.src_start[d], held.offset[d])
        b = min(part.src_stop(d), held.offset[d] + held.shape[d])
        if a >= b:
            return None
        lo.append(a)
        hi.append(b)
    return lo, hi


def _intersect(part: _keys.Part, lo: list[int], hi: list[int]) -> Block:
    """The block of the written tensor that an overlap (:func:`_overlap`) supplies."""
    offset, shape = [], []
    for j, d in enumerate(part.src_dims):
        if d < 0:
            offset.append(part.at[j])
            shape.append(1)
        else:
            offset.append(part.at[j] + lo[d] - part.src_start[d])
            shape.append(hi[d] - lo[d])
    return Block(tuple(offset), tuple(shape))


def _local_view(part: _keys.Part, held: Block, lo: list[int], hi: list[int]
                ) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """Slices of the holder's local block (an overlap in its coordinates) and the dim order
    that give a piece's bytes."""
    local = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, held.offset))
    order = [d for d in part.src_dims if d >= 0]
    perm = order + [d for d in range(len(held.shape)) if d not in order]
    return local, tuple(perm)


def agree_plan(plans: list[tuple | None], ranks: list[int]) -> DistributionPlan | None:
    """The plan the ranks' models record (as tuples), the same on all; ValueError if not."""
    if len(set(plans)) > 1:
        listing = "; ".join(f"rank {g}: {DistributionPlan(*p) if p else 'none'}"
                            for g, p in zip(ranks, plans))
        raise ValueError(f"the ranks' models record different distribution plans ({listing}); "
                         "record one plan on every rank's model")
    return DistributionPlan(*plans[0]) if plans[0] is not None else None


@dataclass(frozen=True, slots=True)
class Runs:
    """The contiguous runs a block occupies in its full tensor, in the block's own row-major
    order (the order its local bytes have), held as arithmetic, not as a list: run ``i``
    (mixed radix over ``counts``) starts at byte ``base + sum(i_d * strides[d])`` and is
    ``run`` bytes long. A Shard(1) block of an expert-TP tensor has hundreds of thousands of
    runs; this is a few integers whatever their number."""

    base: int
    run: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    def __len__(self) -> int:
        return math.prod(self.counts)

    def start_of(self, i: int) -> int:
        """Where run ``i`` starts in the full tensor (bytes)."""
        offset = self.base
        for count, stride in zip(reversed(self.counts), reversed(self.strides)):
            i, k = divmod(i, count)
            offset += k * stride
        return offset

    def pieces(self, start: int, n: int, at: int = 0) -> list[tuple[int, int, int]]:
        """``(offset in the full tensor, offset in the message, nbytes)`` of the bytes
        ``[start, start + n)`` of the block, which sit at ``at`` of a message."""
        if not self.counts:
            return [(self.base + start, at, n)]
        out = []
        i, skip = divmod(start, self.run)
        while n > 0:
            m = min(self.run - skip, n)
            out.append((self.start_of(i) + skip, at, m))
            at += m
            n -= m
            skip = 0
            i += 1
        return out


def block_runs(block: Block, shape: tuple[int, ...], itemsize: int) -> Runs:
    """The runs of ``block`` in a tensor of ``shape`` (see :class:`Runs`)."""
    ndim = len(shape)
    if ndim == 0:
        return Runs(0, itemsize)
    # Dims after j are whole: one run spans block.shape[j] * prod(shape[j+1:]) elements.
    j = ndim - 1
    while j > 0 and block.shape[j] == shape[j] and block.offset[j] == 0:
        j -= 1
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(ndim)]
    base = sum(block.offset[d] * strides[d] for d in range(j + 1))
    run = block.shape[j] * strides[j]
    # Outer dims of one index (a dim of size 1) add nothing: dropped, so a Shard(0) block
    # or a whole tensor is one run with no arithmetic.
    outer = [(block.shape[d], strides[d]) for d in range(j) if block.shape[d] != 1]
    return Runs(base, run, tuple(c for c, _s in outer), tuple(s for _c, s in outer))


# Blocks of one signature share their runs (a few integers each).
_cached_runs = functools.lru_cache(maxsize=4096)(block_runs)


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


_json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def safetensors_header(entries: list[Entry]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``entries`` (in order) and each key's data offset in the file."""
    # The JSON written out directly (keys escaped by json's own encoder): the same text
    # json.dumps(separators=(",", ":")) makes of the dict, at a third of its cost -- a
    # checkpoint of 100k tensors has a header of 100k records.
    parts = ['{"__metadata__":{"format":"pt"}']
    offsets, pos = {}, 0
    quote = _json_string
    for e in entries:
        end = pos + e.nbytes
        shape = ",".join(map(str, e.shape))
        parts.append(f'{quote(e.key)}:{{"dtype":"{SAFETENSORS_DTYPES[e.dtype]}",'
                     f'"shape":[{shape}],"data_offsets":[{pos},{end}]}}')
        offsets[e.key] = pos
        pos = end
    raw = (",".join(parts) + "}").encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"a file's safetensors header would be {len(raw)} bytes for "
                         f"{len(entries)} tensors, over the {MAX_HEADER_BYTES} bytes safetensors "
                         "readers accept; pass a smaller max_shard_size (fewer tensors per file)")
    head = len(raw).to_bytes(8, "little") + raw
    return head, {k: v + len(head) for k, v in offsets.items()}


# Files an export publishes; whatever else a directory holds (a tokenizer, a README) is kept.
_CONFIG_NAMES = ("config.json", "generation_config.json")
_STAGE_TAG = ".dext-export-"
# Temporary files of versions that staged inside the directory (".model.safetensors.<hex>.tmp").
_LEGACY_TMP_RE = re.compile(r"^\.(model.*\.safetensors|model\.safetensors\.index\.json|config\.json"
                            r"|generation_config\.json)\.[0-9a-f]{32}\.tmp$")
# Shard files a sink keeps open at once (each holds two descriptors); the rest are reopened
# when written to, so 10,000 shards need no more than the common 1024-descriptor limit.
OPEN_FILES = 32
# Runs under SMALL_RUN (a Shard(1)/TP layout's rows, small tensors) are gathered into aligned
# regions of the file and each region written direct once whole; at most ASSEMBLY_BYTES of
# regions are held at once (the oldest then goes through the page cache).
REGION_BYTES = 2**20
ASSEMBLY_BYTES = 64 * 2**20


@dataclass
class _Region:
    """An aligned region of a shard file being assembled from short runs."""

    buf: torch.Tensor  # REGION_BYTES, aligned
    size: int  # the file's bytes in this region
    filled: int = 0
    # tables of rows (src_ptr, offset in it, nbytes) copied in; only the offsets and sizes
    # are used later (the sources are gone by then)
    ranges: list[torch.Tensor] = field(default_factory=list)


def _config_texts(model: nn.Module | None) -> dict[str, str]:
    """``config.json``/``generation_config.json`` as ``save_pretrained`` writes them, computed
    before any byte moves (a config that does not serialize fails the preparing round)."""
    out = {}
    for name, attr in zip(_CONFIG_NAMES, ("config", "generation_config")):
        obj = getattr(model, attr, None) if model is not None else None
        if obj is not None and hasattr(obj, "to_json_string"):
            try:
                out[name] = obj.to_json_string(use_diff=True)
            except Exception as exc:
                raise ValueError(f"model.{attr} does not serialize to JSON ({type(exc).__name__}: "
                                 f"{exc}); make its attributes JSON-serializable (or delete the "
                                 "offending attribute) before exporting") from exc
    return out


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: str) -> None:
    """Removes a file, link or directory tree; a missing one is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _link_tree(src: str, dst: str) -> None:
    """``src`` (a file, link or directory tree) at ``dst`` too: hard links, a copy where the
    filesystem refuses them."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.mkdir(dst)
        for name in os.listdir(src):
            _link_tree(os.path.join(src, name), os.path.join(dst, name))
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


class FileSink:
    """A checkpoint built in a stage directory and published whole.

    The stage is a hidden sibling of ``directory`` (``.<name>.dext-export-<hex>``, so that it
    is on the same filesystem); the shard files, the index and the configs are written there,
    made durable, and published in one step (:meth:`commit`): a new directory is renamed into
    place; an existing one is swapped with the stage by ``renameat2(RENAME_EXCHANGE)`` after
    the files of it that the checkpoint does not replace (a tokenizer, a README) are
    hard-linked into the stage. A crash at any instant therefore leaves the earlier checkpoint
    or the new one, never a mix, and ``config.json`` is published with the weights. Where the
    swap is not available (not Linux, a filesystem without it, a directory that is a mount
    point or whose parent is not writable), the files are renamed into the directory in an
    order that makes a partial state fail to load loudly: the index and a single-file
    checkpoint's weights removed first, the shards and configs renamed in, the index (or the
    single file) last. Stages of earlier crashed exports of the same directory are removed
    when a new one starts: one export per directory at a time.
    """

    def __init__(self, directory: str, files: list[list[Entry]], model: nn.Module | None = None
                 ) -> None:
        # Resolved: a directory reached through a symlink is published in place of its
        # target's contents, the link kept.
        self.directory = os.path.realpath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"directory={directory!r} exists and is not a directory; pass a "
                             "directory path (it is created if missing)")
        self.texts = _config_texts(model)
        parent, base = os.path.split(self.directory.rstrip(os.sep) or os.sep)
        os.makedirs(parent, exist_ok=True)  # as save_pretrained, missing parents are made
        self._remove_stale(parent, base)
        token = uuid.uuid4().hex
        self.swap = os.path.isdir(parent) and os.access(parent, os.W_OK) and not (
            os.path.isdir(self.directory)
            and os.stat(self.directory).st_dev != os.stat(parent).st_dev)  # a mount point
        if self.swap:
            self.stage = os.path.join(parent, f".{base}{_STAGE_TAG}{token}")
        else:
            os.makedirs(self.directory, exist_ok=True)
            self.stage = os.path.join(self.directory, f"{_STAGE_TAG}{token}")
        os.mkdir(self.stage)
        self.published = False
        n = len(files)
        self.names = [WEIGHTS_NAME] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.files: list[_direct_io.DirectFile] = []
        # Per entry index: its file's number and its data's offset in that file.
        count = sum(len(group) for group in files)
        file_of, base_of = array.array("q", [0]) * count, array.array("q", [0]) * count
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[_direct_io.DirectFile, int] = \
            collections.OrderedDict()  # open files -> writers using each now
        self._regions: collections.OrderedDict[tuple[Any, int], _Region] = \
            collections.OrderedDict()  # (file, region index) -> being assembled, LRU last
        self._spilled: set[tuple[Any, int]] = set()  # regions gone to the page cache
        self._spare: list[torch.Tensor] = []  # region buffers to reuse
        self._region_lock = threading.Lock()
        self.heads: dict[Any, bytes] = {}
        try:
            for number, (name, group) in enumerate(zip(self.names, files)):
                head, offsets = safetensors_header(group)
                size = len(head) + sum(e.nbytes for e in group)
                file = _direct_io.DirectFile(os.path.join(self.stage, name), size)
                self.files.append(file)
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

    def _remove_stale(self, parent: str, base: str) -> None:
        """Removes what crashed exports of this directory left: stages, old temp files."""
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                if name.startswith(f".{base}{_STAGE_TAG}"):
                    _remove(os.path.join(parent, name))
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(_STAGE_TAG) or _LEGACY_TMP_RE.match(name):
                    _remove(os.path.join(self.directory, name))

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

    def write_batch(self, data: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``data[at : at + n]`` at ``offset`` of each row's entry (a :func:`_rows`
        table): runs under ``SMALL_RUN`` bytes are assembled into their file's regions (a
        few tensor operations and one native copy per region, however many runs), larger
        ones each through :meth:`DirectFile.write` (direct where it can)."""
        if not len(rows):
            return
        idx = rows[:, ROW_ENTRY]
        offset = self._base_of[idx] + rows[:, ROW_OFFSET]
        fid = self._file_of[idx]
        at, n = rows[:, ROW_AT], rows[:, ROW_NBYTES]
        small = n < SMALL_RUN
        if not bool(small.all()):
            for i in (~small).nonzero().flatten().tolist():
                file, a = self.files[int(fid[i])], int(at[i])
                with self._opened(file):
                    file.write(int(offset[i]), data[a : a + int(n[i])])
            offset, fid, at, n = offset[small], fid[small], at[small], n[small]
            if not len(n):
                return
        src = at + data.data_ptr()  # data is held by the caller until this returns
        first, last = int(fid.min()), int(fid.max())
        if first == last:  # a message's rows: mostly in one file
            self._assemble(self.files[first], src, offset, n)
            return
        for number in torch.unique(fid).tolist():
            mine = fid == number
            self._assemble(self.files[number], src[mine], offset[mine], n[mine])

    def _assemble(self, file: _direct_io.DirectFile, src: torch.Tensor, offset: torch.Tensor,
                  n: torch.Tensor) -> None:
        """Copies short runs (``src`` pointers, file ``offset``, ``n`` bytes: int64 vectors)
        into their regions (one native pass per region); a region complete is written
        whole, direct where the filesystem takes it (through the page cache elsewhere, one
        write instead of a syscall per run). Regions over ``ASSEMBLY_BYTES`` are spilled,
        oldest first, through the page cache (a region shared with long runs, which go
        direct by themselves, completes only at the end)."""
        index = torch.div(offset, REGION_BYTES, rounding_mode="floor")
        within = offset - index * REGION_BYTES
        over = within + n - REGION_BYTES
        cross = over > 0
        if bool(cross.any()):  # a run over a region's end: its tail starts the next one
            tail = over[cross]  # (runs are under SMALL_RUN <= REGION_BYTES: one boundary)
            head = n - over.clamp(min=0)
            src = torch.cat((src, src[cross] + head[cross]))
            index = torch.cat((index, index[cross] + 1))
            within = torch.cat((within, torch.zeros_like(tail)))
            n = torch.cat((head, tail))
        table = torch.stack((src, within, n), 1)
        if len(index) > 1 and not bool((index[1:] >= index[:-1]).all()):
            order = torch.argsort(index, stable=True)
            index, table = index[order], table[order]
        regions, counts = torch.unique_consecutive(index, return_counts=True)
        ends = counts.cumsum(0)
        totals = table[:, 2].cumsum(0)[ends - 1]
        totals[1:] -= totals[:-1].clone()
        through_cache: list[torch.Tensor] = []
        complete: list[tuple[int, _Region]] = []
        with self._region_lock:
            begin = 0
            for index_i, end, nbytes in zip(regions.tolist(), ends.tolist(), totals.tolist()):
                rows, begin = table[begin:end], end
                key = (file, index_i)
                if key in self._spilled:
                    spilled = rows.clone()
                    spilled[:, 1] += index_i * REGION_BYTES
                    through_cache.append(spilled)
                    continue
                region = self._regions.get(key)
                if region is None:
                    region = self._regions[key] = self._new_region(file, index_i)
                else:
                    self._regions.move_to_end(key)
                _native.pack_segments(region.buf, rows)  # the sources: held by the caller
                region.filled += nbytes
                region.ranges.append(rows)  # (their pointers are not kept valid: unused)
                if region.filled >= region.size:
                    del self._regions[key]
                    complete.append((index_i, region))
            evicted = []
            while len(self._regions) * REGION_BYTES > ASSEMBLY_BYTES:
                key, region = self._regions.popitem(last=False)
                self._spilled.add(key)
                evicted.append((key, region))
        if through_cache:
            with self._opened(file):
                file.write_segments(torch.cat(through_cache))
        for index_i, region in complete:
            with self._opened(file):
                file.write(index_i * REGION_BYTES, region.buf[: region.size])
            self._release_region(region)
        for (other, index_i), region in evicted:
            self._spill(other, index_i, region)

    def _new_region(self, file: _direct_io.DirectFile, index: int) -> _Region:
        buf = self._spare.pop() if self._spare else _direct_io.aligned_empty(REGION_BYTES)
        start = index * REGION_BYTES
        region = _Region(buf, min(REGION_BYTES, file.size - start))
        head = self.heads[file]
        if start < len(head):  # the header's bytes (already in the file) complete it too
            part = head[start : start + REGION_BYTES]
            buf[: len(part)].copy_(torch.frombuffer(bytearray(part), dtype=torch.uint8))
            region.filled = len(part)
            region.ranges.append(torch.tensor([[0, 0, len(part)]], dtype=torch.int64))
        return region

    def _release_region(self, region: _Region) -> None:
        with self._region_lock:
            if len(self._spare) < 64:
                self._spare.append(region.buf)

    def _spill(self, file: _direct_io.DirectFile, index: int, region: _Region) -> None:
        """Writes what a region holds through the page cache (it will not be written direct)."""
        ranges = torch.cat(region.ranges)
        within, n = ranges[:, 1], ranges[:, 2]
        table = torch.stack((within + region.buf.data_ptr(), within + index * REGION_BYTES, n), 1)
        with self._opened(file):
            file.write_segments(table)
        self._release_region(region)

    def _flush_regions(self) -> None:
        """Writes every region still being assembled (each shares bytes with long runs)."""
        with self._region_lock:
            left, self._regions = list(self._regions.items()), collections.OrderedDict()
        for (file, index), region in left:
            self._spill(file, index, region)

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

    def abort(self) -> None:
        """Removes the stage; the directory is as it was (unless already published)."""
        self.close()
        if not self.published:
            _remove(self.stage)

    def commit(self) -> None:
        """Makes the stage durable and publishes it (see the class docstring)."""
        self._flush_regions()
        self.close()
        for file in self.files:
            _fsync_path(file.path)
        published = list(self.names)
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            _write_file(os.path.join(self.stage, INDEX_NAME), json.dumps(index, indent=2))
            published.append(INDEX_NAME)
        for name, text in self.texts.items():
            _write_file(os.path.join(self.stage, name), text)
            published.append(name)
        _fsync_path(self.stage, directory=True)
        if self.swap and self._publish_swap():
            return
        self._publish_in_place(published)

    def _replaced(self, name: str) -> bool:
        """Whether ``name`` in the directory belongs to the checkpoint this one replaces."""
        return bool(_SHARD_RE.match(name)) or name == INDEX_NAME or name in self.texts or \
            name.startswith(_STAGE_TAG) or bool(_LEGACY_TMP_RE.match(name))

    def _publish_swap(self) -> bool:
        """The stage becomes the directory in one step; False where it cannot be swapped."""
        parent = os.path.dirname(self.directory)
        if not os.path.lexists(self.directory):
            os.rename(self.stage, self.directory)  # nothing was there: one atomic rename
            self.published = True
            _fsync_path(parent, directory=True)
            return True
        carried = []
        for name in os.listdir(self.directory):
            if not self._replaced(name):
                _link_tree(os.path.join(self.directory, name), os.path.join(self.stage, name))
                carried.append(name)
        if not _native.exchange_paths(self.stage, self.directory):
            for name in carried:
                _remove(os.path.join(self.stage, name))
            return False
        # Published. The stage path now holds the earlier directory: anything written into
        # it since the links were made moves over, the rest (the earlier checkpoint) goes.
        # Best effort from here: a failure to tidy up is not a failed export.
        with contextlib.suppress(OSError):
            _fsync_path(parent, directory=True)
            for name in os.listdir(self.stage):
                if not self._replaced(name) and not os.path.lexists(
                        os.path.join(self.directory, name)):
                    with contextlib.suppress(OSError):
                        os.rename(os.path.join(self.stage, name),
                                  os.path.join(self.directory, name))
        _remove(self.stage)
        self.published = True  # nothing of ours is left to abort
        return True

    def _publish_in_place(self, published: list[str]) -> None:
        """Renames the stage's files into the directory, the entry point last (see the class
        docstring), then removes stale shards of the earlier checkpoint."""
        os.makedirs(self.directory, exist_ok=True)
        target = functools.partial(os.path.join, self.directory)
        # First what makes a partial state load: the index, a single-file checkpoint.
        for name in (INDEX_NAME, WEIGHTS_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target(name))
        last = INDEX_NAME if len(self.names) > 1 else WEIGHTS_NAME
        for name in [n for n in published if n != last] + [last]:
            os.replace(os.path.join(self.stage, name), target(name))
        _fsync_path(self.directory, directory=True)
        for name in os.listdir(self.directory):  # stale shards of an earlier checkpoint
            if _SHARD_RE.match(name) and name not in published:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target(name))
        self.published = True
        _remove(self.stage)


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


# -- data ------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t``: a DTensor's local shard, else ``t`` itself."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return t
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        # The local shard itself (what to_local() returns, without its autograd node: a few
        # microseconds per entry less, which a model of 100k tensors notices).
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


def _piece_tensor(state: dict[str, torch.Tensor], entry: Entry, piece: Piece) -> torch.Tensor:
    """A piece's elements as a contiguous tensor, in the written tensor's row-major order, on
    the device they live on: the local block itself where the piece is all of it, a view
    where they are contiguous in it, else one contiguous copy of the piece (never of more)."""
    t = _local(state[piece.source or entry.source])
    if t.requires_grad:
        t = t.detach()
    if piece.local is not None:
        t = t[piece.local]
        if piece.perm is not None:
            t = t.permute(piece.perm)
        t = t.reshape(piece.block.shape)
    return t if t.is_contiguous() else t.contiguous()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# Columns of a row table (:func:`_rows`): which entry, where in it, where in the message, how
# many bytes. A table, not a list of tuples: a sink maps a message of a thousand small pieces
# to file offsets and copies them with a few tensor operations and one native call.
ROW_ENTRY, ROW_OFFSET, ROW_AT, ROW_NBYTES = range(4)


def _rows(message: list[Segment], at: int = 0) -> torch.Tensor:
    """Where a message's bytes go: an int64 table of ``(entry index, offset in the written
    tensor, offset in the message, nbytes)``, one row per contiguous run (one per segment,
    mostly); ``at``: where the first segment starts in the message. Computed per message
    from each piece's :class:`Runs`: at most a message's worth of rows exists at a time."""
    flat = array.array("q")
    for e, p, start, n in message:
        runs = p.runs(e)
        if not runs.counts:  # most pieces: one run, no search
            flat.extend((e.index, runs.base + start, at, n))
        else:
            i = e.index
            for offset, a, m in runs.pieces(start, n, at):
                flat.extend((i, offset, a, m))
        at += n
    if not flat:
        return torch.empty((0, 4), dtype=torch.int64)
    return torch.frombuffer(flat, dtype=torch.int64).reshape(-1, 4)  # keeps ``flat`` alive


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


def _placement(sink: Any, message: list[Segment]) -> int:
    """The address shift at which a message's bytes go to the sink without a copy (the file
    offset's of its first byte, where that starts a run), else 0."""
    e, p, start, _n = message[0]
    runs = p.runs(e)
    return sink.address_shift(e.index, runs.base + start) if not runs.counts else 0


def _needs_pinned(state: dict[str, torch.Tensor], messages: list[list[Segment]]) -> bool:
    """Whether any of these messages' bytes live on a GPU (only then is pinned memory taken).
    (A DTensor is on its local shard's device.)"""
    if not torch.cuda.is_initialized():  # no tensor can be on a GPU: skip the walk
        return False
    return any(state[p.source or e.source].is_cuda for m in messages for e, p, _s, _n in m)


# A message: the (entry, piece, start, nbytes) segments it carries, back to back.
Segment = tuple[Entry, Piece, int, int]


def plan_messages(items: Iterable[tuple[Entry, Piece]], chunk: int,
                  world: int | None = None) -> Any:
    """How pieces travel, computed alike by a sender and dst (and by dst for its own pieces
    on their way to the files).

    A piece of at least ``chunk`` bytes goes alone, in messages of ``chunk`` bytes (sent from
    its own memory); smaller pieces are packed back to back into messages of up to
    ``PACK_BYTES`` (1 MiB), so that a model of 100k small tensors costs a few messages, not
    100k, and dst writes one while the sender packs the next.

    ``world`` None: ``items`` are one rank's pieces; returns their messages. Else every
    rank's pieces, in plan order; returns each group rank's messages (a list per rank), in
    one pass -- dst plans every sender's stream.
    """
    # Per rank: [its messages, the message being packed, its bytes so far]
    streams: list[list[Any]] = [[[], [], 0] for _ in range(world or 1)]
    # Packed messages stay small enough that a receiver writes one while the next is packed.
    cap = min(chunk, PACK_BYTES)
    for e, p in items:
        n = p.nbytes
        if n == 0:
            continue
        stream = streams[p.rank if world else 0]
        if n >= chunk:
            stream[0].extend([(e, p, s, min(chunk, n - s))] for s in range(0, n, chunk))
            continue
        packed = stream[1]
        if packed and stream[2] + n > cap:
            stream[0].append(packed)
            packed = stream[1] = []
            stream[2] = 0
        packed.append((e, p, 0, n))
        stream[2] += n
    for stream in streams:
        if stream[1]:
            stream[0].append(stream[1])
    return streams[0][0] if world is None else [stream[0] for stream in streams]


def _message_nbytes(message: list[Segment]) -> int:
    return sum(s[3] for s in message)


class _Stager:
    """A rank's pieces as the bytes of its messages, on the device ``link`` wants.

    A message that is one host segment (a large piece, or one small piece alone) is a view of
    the piece's own memory; several host segments are packed by the compiled core into a host
    slot; bytes on another device than ``link`` are copied chunk by chunk through a slot
    (pinned for GPU bytes to the host, device for host bytes to NCCL). Three slots, so that
    two messages can be in flight while the third is filled.

    A piece that fails to read (``failure``) turns this and every later message into zeros
    of the same size: the stream keeps its shape, so no peer waits, and the failure is
    agreed afterwards.

    Everything it will need is allocated by :meth:`reserve`, in the round that agrees the
    ranks are ready, so that no allocation fails mid-stream (a peer would wait for bytes that
    never come).
    """

    def __init__(self, state: dict[str, torch.Tensor], chunk: int, link: torch.device,
                 pinned: _PinnedSlots | None) -> None:
        self.state, self.chunk, self.link, self.pinned = state, chunk, link, pinned
        self.failure: BaseException | None = None
        # The last piece read (a large one spans several messages), with its entry: one
        # Piece object serves every entry of a signature.
        self.current: tuple[Entry | None, Piece | None, torch.Tensor | None] = (None, None, None)
        self.zeros: torch.Tensor | None = None
        self.zeros_filled = False
        self.dev_slots: torch.Tensor | None = None
        self.host_slots: torch.Tensor | None = None

    def _bytes(self, e: Entry, p: Piece) -> torch.Tensor | None:
        """The piece as a contiguous tensor (of its own dtype: a byte view is only made where
        one is sliced), or None once a piece failed to read."""
        if self.failure is not None:
            return None
        if self.current[1] is p and self.current[0] is e:  # a large piece, over messages
            return self.current[2]
        try:
            data = _piece_tensor(self.state, e, p)
        except BaseException as exc:  # noqa: BLE001 - agreed after the stream ends
            self.failure = exc
            return None
        self.current = (e, p, data)
        return data

    def reserve(self, messages: list[list[Segment]]) -> None:
        """Allocates the slots these messages need and the buffer zeros are sent from after
        a failure (host: uninitialized until then; device: a slot is zeroed instead)."""
        if not messages:
            return
        packed = any(len(m) > 1 for m in messages)
        if self.link.type == "cuda":
            if packed or any(not _local(self.state[p.source or e.source]).is_cuda
                             for m in messages for e, p, _s, _n in m):
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return
        if packed and self.pinned is None:
            self.host_slots = torch.empty(
                (3, min(self.chunk, PACK_BYTES) + 2 * _direct_io.ALIGN), dtype=torch.uint8)
        self.zeros = torch.empty(max(_message_nbytes(m) for m in messages), dtype=torch.uint8)

    def _failed_bytes(self, slot: int, n: int) -> torch.Tensor:
        """``n`` zero bytes to send in place of a message after a failure."""
        if self.link.type == "cuda":
            if self.dev_slots is None:  # (every message was sent from its own memory so far)
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return self.dev_slots[slot, :n].zero_()
        assert self.zeros is not None, "reserve() was not called"
        if not self.zeros_filled:
            self.zeros.zero_()
            self.zeros_filled = True
        return self.zeros[:n]

    def _slot(self, slot: int, n: int, shift: int) -> torch.Tensor:
        if self.link.type == "cuda":
            if self.dev_slots is None:
                self.dev_slots = torch.empty((3, self.chunk), dtype=torch.uint8,
                                             device=self.link)
            return self.dev_slots[slot, :n]
        if self.pinned is not None:
            return self.pinned.view(slot, n, shift)
        if self.host_slots is None:  # only packed messages come here: at most PACK_BYTES
            self.host_slots = torch.empty((3, min(self.chunk, PACK_BYTES) + 2 * _direct_io.ALIGN),
                                          dtype=torch.uint8)
        return _direct_io.place(self.host_slots[slot], n, shift)

    def stage(self, message: list[Segment], slot: int, shift: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The message's bytes, and what must stay alive while they are read (a piece's own
        memory sent without a copy). ``shift``: the address alignment wanted of a slot."""
        if len(message) > 1 and self.link.type == "cpu" and self.failure is None:
            packed = self._pack_whole_blocks(message, slot, shift)
            if packed is not None:
                return packed, None
        n = _message_nbytes(message)
        sources = [self._bytes(e, p) for e, p, _s, _n in message]
        if self.failure is not None:
            return self._failed_bytes(slot, n), None
        if len(message) == 1 and sources[0].device.type == self.link.type:
            s = message[0][2]
            data = _flat_bytes(sources[0])
            return data[s : s + n], data  # from where it lives
        out = self._slot(slot, n, shift)
        if self.link.type == "cpu" and not any(d.is_cuda for d in sources):
            # Many small host pieces: one native pass, no Python per byte.
            rows, at = [], 0
            for (_e, _p, s, m), d in zip(message, sources):
                rows.append((d.data_ptr() + s, at, m))
                at += m
            _native.pack_segments(out, rows)  # the sources are alive: held here
        else:
            # Device copies are stream-ordered after the send that last read this slot (its
            # wait() made the current stream wait for it); D2H into pinned memory returns
            # once the bytes are there.
            at = 0
            for (_e, _p, s, m), d in zip(message, sources):
                out[at : at + m].copy_(_flat_bytes(d)[s : s + m])
                at += m
        return out, None

    def _pack_whole_blocks(self, message: list[Segment], slot: int, shift: int
                           ) -> torch.Tensor | None:
        """Packs a message of small pieces that are each a whole, contiguous host block (a
        model's small tensors): their bytes are their own memory, so there is nothing to
        read that can fail, and one table goes to the compiled core. None, with nothing
        done, where any piece is something else (the general path then reads it)."""
        rows = array.array("q")
        at = 0
        state = self.state
        for e, p, s, m in message:
            if p.local is not None:
                return None
            t = state[p.source or e.source]
            kind = type(t)
            if (kind is not torch.Tensor and kind is not nn.Parameter) or not t.is_cpu \
                    or not t.is_contiguous():
                return None
            rows.extend((t.data_ptr() + s, at, m))
            at += m
        out = self._slot(slot, at, shift)
        # The blocks are held by ``state`` while the copy runs (it returns once done).
        _native.pack_segments(out, torch.frombuffer(rows, dtype=torch.int64).reshape(-1, 3))
        return out

    def abandon(self) -> tuple:
        """What a transport may still read after a peer failed (kept, never freed)."""
        return (self.pinned, self.dev_slots, self.host_slots)


def _write_own(stager: _Stager, sink: Any, messages: list[list[Segment]]) -> None:
    """Writes this rank's own pieces to the sink, message by message (:func:`plan_messages`):
    small pieces packed, so the files see one batch of runs per chunk, not one call per
    tensor; GPU bytes through the stager's pinned slot (never a whole block on the host)."""
    for message in messages:
        data, _keep = stager.stage(message, 0, _placement(sink, message))
        if stager.failure is not None:
            raise stager.failure
        sink.write_batch(data, _rows(message))


# Buffers of transfers that were posted when a peer failed: the transport may still read or
# write them, so they are never freed (the group is unusable by then anyway).
_ABANDONED: list[Any] = []


@dataclass
class _Prepared:
    """What one rank allocated for the transfer, before it starts (:func:`_prepare_transfer`)."""

    messages: list[list[Segment]]  # this rank's own pieces, as messages
    stager: _Stager
    pinned: _PinnedSlots | None
    gpu_shards: bool
    # dst only: each sender's messages still to receive, and its free receive buffers
    plans: dict[int, collections.deque] = field(default_factory=dict)
    free: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def release(self) -> None:
        if self.pinned is not None:
            self.pinned.release()
            self.pinned = None


def _prepare_transfer(state: dict[str, torch.Tensor], entries: list[Entry],
                      ctx: _agree.GroupContext | None, dst_rank: int,
                      chunk: int) -> _Prepared:
    """Plans this rank's messages and allocates every buffer the transfer needs (raising
    here, in the round that agrees the ranks are ready, rather than mid-stream): dst two
    receive chunks per sender and its own pieces' slots, a sender its staging slots.
    ``ctx`` None: one process, no link."""
    me = 0 if ctx is None else ctx.rank
    link = torch.device("cpu") if ctx is None else ctx.device
    on_device = link.type == "cuda"  # NCCL: what crosses the link is device memory
    world = 1 if ctx is None else ctx.size
    # Every rank's messages on dst (it receives them all); a sender's own only.
    pairs = ((e, p) for e in entries for p in e.pieces)
    if me == dst_rank:
        streams = plan_messages(pairs, chunk, world)
    else:
        streams = [[] for _ in range(world)]
        streams[me] = plan_messages(((e, p) for e, p in pairs if p.rank == me), chunk)
    messages = streams[me]
    gpu_shards = _needs_pinned(state, messages)  # any of this rank's pieces on a GPU
    pinned = None
    try:
        if me != dst_rank:
            if gpu_shards and not on_device:
                pinned = _PinnedSlots(3, chunk)
            stager = _Stager(state, chunk, link, pinned)
            stager.reserve(messages)
            return _Prepared(messages, stager, pinned, gpu_shards)
        # Pinned slots: 0 for the own-pieces thread (GPU shards), 1 for received device chunks.
        if gpu_shards or on_device:
            pinned = _PinnedSlots(2, chunk)
        stager = _Stager(state, chunk, torch.device("cpu"), pinned)
        stager.reserve(messages)
        prepared = _Prepared(messages, stager, pinned, gpu_shards)
        for r, planned in enumerate(streams):
            if r == me or not planned:
                continue
            prepared.plans[r] = collections.deque(planned)
            if on_device:
                prepared.free[r] = list(torch.empty((2, chunk), dtype=torch.uint8, device=link))
            else:
                prepared.free[r] = [torch.empty(chunk + 2 * _direct_io.ALIGN, dtype=torch.uint8)
                                    for _ in range(2)]
        return prepared
    except BaseException:
        if pinned is not None:
            pinned.release()
        raise


def _transfer(state: dict[str, torch.Tensor], prepared: _Prepared, sink: Any,
              ctx: _agree.GroupContext, dst_rank: int, what: str) -> None:
    """Moves every piece to dst's sink: dst's own directly, the others' over the link.

    Each rank's pieces travel as the messages of :func:`plan_messages`: a large piece's from
    its own memory, small pieces packed by the compiled core into one chunk. The link carries
    host chunks on a CPU backend (gloo) and device chunks on NCCL; bytes that live elsewhere
    than the link wants cross over chunk by chunk (:class:`_Stager`): a GPU shard through
    pinned slots to gloo, a host shard through device slots to NCCL, and on dst a received
    device chunk through a pinned slot to the sink. No block is ever copied whole. Every
    buffer was allocated by :func:`_prepare_transfer`; the pinned ones are released here
    (kept forever where a peer failed with transfers posted).
    """
    me = ctx.rank
    on_device = ctx.device.type == "cuda"
    if prepared.gpu_shards:
        # Our threads copy on their own (default) streams: whatever the caller's streams
        # still compute into the shards lands first.
        torch.cuda.synchronize()

    def body(_worker: Any) -> None:
        if on_device:
            torch.cuda.set_device(ctx.device)  # a new thread starts on GPU 0
        if me != dst_rank:
            _send()
        else:
            _receive()

    def _send() -> None:
        in_flight: collections.deque = collections.deque()  # two sends, with what they read
        stager = prepared.stager
        done = False

        def wait_oldest() -> None:
            work, _keep = in_flight.popleft()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - names the receiver
                _ABANDONED.append((in_flight, stager.abandon()))
                raise _watch.PeerFailure(ctx.ranks[dst_rank], exc) from exc

        try:
            for i, message in enumerate(prepared.messages):
                if len(in_flight) == 2:
                    wait_oldest()  # its slot is free again
                data, keep = stager.stage(message, i % 3)
                in_flight.append((dist.isend(data, ctx.ranks[dst_rank], group=ctx.group),
                                  keep))
            while in_flight:
                wait_oldest()
            if on_device:
                torch.cuda.current_stream(ctx.device).synchronize()  # every send has left
            done = True
        finally:
            if done:
                prepared.release()
        if stager.failure is not None:
            raise _watch.LocalFailure(stager.failure)

    def _receive() -> None:
        failures: list[BaseException] = []  # the first is raised; appended from two threads
        pinned, plans, free = prepared.pinned, prepared.plans, prepared.free

        def write(message: list[Segment], data: torch.Tensor) -> None:
            # A sink that fails (a full disk) stops writing, but dst keeps receiving, so no
            # sender is left blocked; the failure is raised once everything has arrived.
            if failures:
                return
            try:
                sink.write_batch(data, _rows(message))
            except BaseException as exc:  # noqa: BLE001
                failures.append(exc)

        def write_own() -> None:
            if on_device:
                torch.cuda.set_device(ctx.device)
            try:
                _write_own(prepared.stager, sink, prepared.messages)
            except BaseException as exc:  # noqa: BLE001 - raised after the others arrive
                failures.append(exc)

        # Two receives in flight per sender, each written as it lands, while a second thread
        # writes dst's own pieces: the link, the disk and the senders all keep busy.
        pending: dict[int, collections.deque] = {r: collections.deque() for r in plans}

        def post(r: int) -> None:
            while plans[r] and free[r]:
                message = plans[r].popleft()
                n = _message_nbytes(message)
                raw = free[r].pop()
                if on_device:
                    buf = raw[:n]
                else:
                    # Placed as aligned as its place in the file: written direct, no copy.
                    buf = _direct_io.place(raw, n, _placement(sink, message))
                work = dist.irecv(buf, ctx.ranks[r], group=ctx.group)
                pending[r].append((work, raw, buf, message))

        for r in plans:
            post(r)
        own = threading.Thread(target=write_own, name=f"distributed_ext {what} (own pieces)",
                               daemon=True)
        own.start()
        clean = False
        try:
            while any(pending.values()):
                for r in plans:
                    if not pending[r]:
                        continue
                    work, raw, buf, message = pending[r].popleft()
                    try:
                        work.wait()
                    except BaseException as exc:  # noqa: BLE001 - names the sender
                        # Receives still posted keep writing into their buffers: keep them.
                        _ABANDONED.append((pending, free, pinned))
                        raise _watch.PeerFailure(ctx.ranks[r], exc) from exc
                    if on_device:
                        assert pinned is not None
                        host = pinned.view(1, buf.numel(), _placement(sink, message))
                        host.copy_(buf)  # stream-ordered after the receive; host waits
                        write(message, host)
                    else:
                        write(message, buf)
                    free[r].append(raw)
                    post(r)
            clean = True
        finally:
            own.join()  # its writes end before anything closes the sink's files
            if clean:
                prepared.release()
        if failures:
            raise _watch.LocalFailure(failures[0])

    _watch.run_watched(body, ctx.ranks, what)


@dataclass
class _Args:
    """The arguments every rank must pass alike, checked on each and agreed in the metadata
    round (a ``dst`` or ``chunk_bytes`` that differs between ranks would leave them waiting
    for messages that never come, or abort the transport)."""

    dst: int
    chunk_bytes: int
    extra: tuple[tuple[str, Any], ...] = ()  # (argument name, value) of the caller's own


def _check_args(described: list[Described], ctx: _agree.GroupContext, what: str) -> None:
    """ValueError on every rank alike if the ranks passed different arguments."""
    first = described[0].args
    for name, index in [("dst", None), ("chunk_bytes", None)] + [
            (n, i) for i, (n, _v) in enumerate(first.extra)]:
        if index is None:
            values = [getattr(d.args, name) for d in described]
        else:
            values = [d.args.extra[index][1] for d in described]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {ctx.ranks[r]}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{what}: {name} differs between ranks ({listing}); every rank "
                             f"must pass the same {name}")


def _export(model_or_state: nn.Module | dict, dst: int, group: dist.ProcessGroup | None,
            make_sink: Callable[[list[Entry], nn.Module | None], Any],
            chunk_bytes: int | None, what: str, hub_keys: bool = True,
            extra_args: tuple[tuple[str, Any], ...] = (), commit: bool = False,
            check: Callable[[], Any] | None = None) -> tuple[Any, nn.Module | None]:
    """The rounds of the module docstring; returns (dst's sink, the model).

    ``make_sink(entries, model)`` runs on dst in the preparing round (its failure is
    agreed). With ``commit``, dst commits the sink in a last round that every rank joins,
    so that no rank returns before the checkpoint is in place and a failed commit is raised
    on every rank. ``check()`` validates the caller's own arguments (``extra_args``) on every
    rank, inside the metadata round.
    """

    def resolve_chunk() -> int:
        chunk = EXPORT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"{what}: chunk_bytes must be a positive int (bytes per "
                             f"transport message), got {chunk_bytes!r}")
        return chunk

    def plan(described: list[Described], model: nn.Module | None, dst_rank: int,
             ranks: list[int], keep: int | None = None) -> list[Entry]:
        holdings = merge_holdings(described, ranks, dst_rank,
                                  agree_plan([d.plan for d in described], ranks))
        written = None
        if hub_keys and model is not None:
            written = _keys.resolve_written(model, {
                k: (_DTYPE_BY_NAME[h.sig.dtype], h.sig.shape) for k, h in holdings.items()})
        entries = plan_entries(holdings, written, dst_rank, ranks, keep)
        check_keys(entries)
        return entries

    def describe(held: dict[str, Any]) -> Described:
        chunk = resolve_chunk()
        if check is not None:
            check()
        # Inside the agreed round: a state_dict() hook that raises on one rank is raised
        # on every rank, not by that rank alone.
        state, model = resolve_state(model_or_state)
        recorded = recorded_plan(model) if model is not None else None
        # Each key's local block, looked up once here: the transfer reads these.
        local: dict[str, torch.Tensor] = {}
        described = describe_state(state, None if recorded is None else astuple(recorded),
                                   local)
        described.args = _Args(dst, chunk, extra_args)
        held.update(local=local, model=model, chunk=chunk, described=described)
        return described.summary()

    if not runtime.is_initialized():
        _require_group_if_launched(what)
        if dst != 0:
            raise ValueError(f"{what}: dst={dst}, but there is no process group: the one "
                             "process is rank 0 (pass dst=0, or set the group up first)")
        held: dict[str, Any] = {}
        describe(held)
        state, model = held["local"], held["model"]
        entries = plan([held["described"]], model, 0, [0])
        sink = make_sink(entries, model)
        prepared = None
        try:
            prepared = _prepare_transfer(state, entries, None, 0, held["chunk"])
            _write_own(prepared.stager, sink, prepared.messages)
            if commit:
                sink.commit()
        except BaseException:
            sink.abort()
            raise
        finally:
            if prepared is not None:
                prepared.release()
        return sink, model
    ctx = _agree.resolve_group(group, what)
    with _watch.DeferredInterrupts() as deferred:
        held = {}
        summaries = all_reduce(f"{what}: metadata", lambda: describe(held), list, group)
        described = resolve_described(summaries, held["described"], what, group)
        # From here on every rank computes the same from the same metadata: an error below is
        # raised by every rank alike.
        _check_args(described, ctx, what)
        dst_rank = ctx.group_rank_of(dst)
        if dst_rank is None:
            raise ValueError(f"{what}: dst={dst} is not a member of the group (global ranks "
                             f"{ctx.ranks}); pass the global rank of one of them")
        state, model, chunk = held["local"], held["model"], held["chunk"]
        # A sender makes only its own pieces; dst all of them (it lays out the files).
        entries = plan(described, model, dst_rank, ctx.ranks,
                       None if ctx.rank == dst_rank else ctx.rank)
        sink = None
        prepared = None
        try:
            interrupted = deferred.take()  # one that landed in the metadata round fails here
            if interrupted is not None:
                raise interrupted
            if ctx.rank == dst_rank:
                sink = make_sink(entries, model)
            prepared = _prepare_transfer(state, entries, ctx, dst_rank, chunk)
            status = _agree.Status()
        except BaseException as exc:  # noqa: BLE001 - carried to every rank
            status = _agree.Status.failed(exc)
        try:
            _agree.raise_first_failure(f"{what} (preparing)",
                                       _agree.exchange(status, ctx, what), ctx, status)
        except BaseException:
            if prepared is not None:
                prepared.release()
            if sink is not None:
                sink.abort()
            raise
        assert prepared is not None
        failure: BaseException | None = None
        try:
            _transfer(state, prepared, sink, ctx, dst_rank, what)
        except _watch.PeerFailure as exc:
            if sink is not None:
                sink.abort()
            raise _agree.peer_failure_error(what, exc) from exc.cause
        except BaseException as exc:  # noqa: BLE001 - a full disk on dst: agreed below
            failure = exc
        failure = failure or deferred.take()
        status = _agree.Status() if failure is None else _agree.Status.failed(failure)
        try:
            _agree.raise_first_failure(f"{what} (transfer)", _agree.exchange(status, ctx, what),
                                       ctx, status)
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
        if commit:
            _commit_round(sink, ctx, deferred, what)
    return sink, model


def _commit_round(sink: Any, ctx: _agree.GroupContext,
                  deferred: _watch.DeferredInterrupts, what: str) -> None:
    """dst publishes the checkpoint; every rank then learns whether it did (a failed commit
    -- a config that does not serialize, an fsync or rename error, Ctrl-C -- raises on every
    rank, naming dst's error; the directory then holds the earlier checkpoint)."""
    committed = False
    try:
        if sink is not None:
            interrupted = deferred.take()
            if interrupted is not None:
                raise interrupted  # before anything is published: nothing changes
            sink.commit()
            committed = True
        # A Ctrl-C during the commit (or, on a sender, while it waited for it): carried in
        # this round like any failure, so that every rank raises alike.
        late = deferred.take()
        if late is not None:
            raise late
        status = _agree.Status()
    except BaseException as exc:  # noqa: BLE001 - carried to every rank
        if sink is not None and not committed:
            sink.abort()
        status = _agree.Status.failed(exc)
    try:
        statuses = _agree.exchange(status, ctx, what)
    except RuntimeError as exc:
        if committed:
            # A peer died after the data had all arrived: the checkpoint is complete and in
            # place; the group, though, is unusable.
            raise RuntimeError(f"{exc} (the checkpoint itself is complete: it was published "
                               "before the failure)") from exc
        raise
    _agree.raise_first_failure(f"{what} (commit)", statuses, ctx, status)


def export_hf_checkpoint(model_or_state: nn.Module | dict, directory: str | os.PathLike[str],
                         dst: int = 0, group: dist.ProcessGroup | None = None, *,
                         max_shard_size: int | str = "5GB",
                         chunk_bytes: int | None = None) -> None:
    """Writes a sharded model's full state as ONE Hugging Face checkpoint on global rank ``dst``.

    Collective over ``group``. ``model_or_state`` is an ``nn.Module`` or a state dict. A
    module is written as ``save_pretrained`` writes it: the same keys, shapes, dtypes and
    bytes (tied weights and ``_keys_to_ignore_on_save`` left out; transformers' own
    ``revert_weight_conversion`` applied, so a MoE whose experts are fused in memory is
    written one tensor per expert, in the hub's names), with ``config.json`` and
    ``generation_config.json`` from its ``config``/``generation_config``. Each written tensor
    is a set of blocks of in-memory tensors (renames, splits, selections, transposes), streamed
    from where they live: no rank materializes a fused tensor. A conversion that is not such a
    set of blocks (a cast, arithmetic) raises ValueError on every rank before any byte moves,
    naming the key. A state dict is written with its own keys.
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
    for direct writes, three 1 MiB slots where its own small tensors are packed, up to 64 MiB
    of 1 MiB file regions being assembled from short runs (small tensors, the rows of a
    ``Shard(1)``/TP layout), and metadata (a few hundred bytes per tensor; a block's runs are
    arithmetic, never a list); its large blocks are written from its own tensors. The files
    bypass the page cache (``O_DIRECT``) where the filesystem allows -- short runs too, once
    their region is whole -- so the checkpoint takes no kernel memory either, and is on the
    disk when the call returns (elsewhere the page cache holds it until ``fsync``, before
    publishing). A sender holds
    its shards, three 1 MiB slots where its small pieces are packed, and at most one
    contiguous copy of one piece at a time where a piece is not contiguous in its shard (a
    transposed or column block), on the piece's own device.

    Cost: by bytes, not tensor count. Pieces under 1 MiB are packed into shared messages by
    the compiled core and written by dst in one native call per file and message; the
    metadata round carries compact tables; a DTensor's blocks are computed on every rank from
    its global shape, mesh and placements. Python's cyclic garbage collector is paused for
    the call (its collections walk every object a large model holds).

    GPU-resident shards never cross whole: on NCCL they are sent from device memory chunk by
    chunk and dst receives into two device chunks per sender, staged through a pinned chunk
    to the files; on gloo a sender stages them through three pinned chunks, and dst writes its
    own through one. Device memory: at most two chunks per sender on dst, three on a sender
    whose shards are on the host under NCCL; no rank gathers a full parameter on its GPU.
    Pinned memory: at most three chunks (leased from the package's one pinned pool).

    Failure: arguments that differ between ranks, a bad entry (a ``Partial`` or
    ``_StridedShard`` DTensor, a dtype or key safetensors cannot store, ranks that disagree on
    a key's dtype or shape, blocks that do not tile a tensor exactly), a ``state_dict()`` that
    raises, an allocation or a ``config`` that does not serialize raise on every rank before
    any byte moves; a failure during the transfer (a full disk, a dead peer, Ctrl-C) or the
    commit (an fsync or rename error) makes every rank raise. Under a distributed launch with
    no process group set up, RuntimeError. The checkpoint is built in a hidden sibling
    directory and published whole (an atomic ``renameat2(RENAME_EXCHANGE)`` swap; elsewhere
    an order that makes a partial state fail to load), so a crash at any instant leaves the
    earlier checkpoint or the new one, never a mix; files of the directory that the
    checkpoint does not replace are kept; stale shards are gone, as with ``save_pretrained``.
    See ``docs/checkpoint.md``.

    Args:
        model_or_state: The (sharded) model, or a state dict, on every rank of ``group``.
        directory: Where dst writes (created if missing).
        dst: The global rank that writes.
        group: The process group (default: the world).
        max_shard_size: The largest file, in bytes or as ``"5GB"``/``"500MiB"``.
        chunk_bytes: Transport piece size (default 16 MiB).
    """
    what = "export_hf_checkpoint"
    path = os.fspath(directory)

    def make_sink(entries: list[Entry], model: nn.Module | None) -> FileSink:
        return FileSink(path, layout_files(entries, parse_shard_size(max_shard_size)), model)

    # Checked on every rank and agreed in the metadata round, with dst and chunk_bytes
    # ("5GB" and 5000000000 are the same size: compared parsed, where they parse).
    try:
        shard_value: Any = parse_shard_size(max_shard_size)
    except (TypeError, ValueError):
        shard_value = max_shard_size  # raised by check() inside the round, on this rank
    extra = (("max_shard_size", shard_value), ("directory", path))
    with _cyclic_gc_paused():
        _export(model_or_state, dst, group, make_sink, chunk_bytes, what,
                extra_args=extra, commit=True, check=lambda: parse_shard_size(max_shard_size))


def gather_full_state(model_or_state: nn.Module | dict, dst: int = 0,
                      group: dist.ProcessGroup | None = None, *,
                      hub_keys: bool = False) -> dict | None:
    """The full state of a sharded model (or state dict) as CPU tensors on ``dst``; None elsewhere.

    Collective; the same inputs, assembly and failure rules as :func:`export_hf_checkpoint`
    (tied weights once). The keys are the model's in-memory names, as ``state_dict()`` has
    them -- a state dict for ``load_state_dict`` of the same model class. With
    ``hub_keys=True`` they are instead the keys and tensors ``export_hf_checkpoint`` writes
    (the hub's layout: e.g. one tensor per expert where transformers fuses a MoE's experts in
    memory), for code that wants the checkpoint's tensors without a file.

    Memory on dst: the full state once (the returned CPU tensors, filled in place) plus two
    transport chunks per sender (and the pinned and device chunks of
    :func:`export_hf_checkpoint` for GPU-resident shards); nothing else.
    """
    what = "gather_full_state"
    with _cyclic_gc_paused():
        sink, _model = _export(model_or_state, dst, group, MemorySink, None, what,
                               hub_keys=hub_keys)
    return None if sink is None else sink.tensors
