"""What each rank holds: its entries described as compact tables (exchanged in the metadata
round, as a digest where every rank holds the same keys), with every check a signature
determines made once per signature; a DTensor's blocks computed from its global shape, mesh
and placements alone."""

from __future__ import annotations

import array
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import _agree
from distributed_ext._dtensor import dtensor_type
from distributed_ext.collectives import all_reduce
from distributed_ext.export.safetensors import SAFETENSORS_DTYPES, _dtype_name


def resolve_state(model_or_state: nn.Module | dict) -> tuple[dict[str, torch.Tensor], nn.Module | None]:
    """The in-memory entries to export, and the model if any.

    For a module: its ``state_dict()``, less the keys ``save_pretrained`` leaves out: tied
    weights (the keys of ``_tied_weights_keys`` that alias their source), so that
    ``from_pretrained`` re-ties them, and ``_keys_to_ignore_on_save``. The keys are the
    model's in-memory names; :mod:`distributed_ext.export.keys` maps them to the hub's.
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
    dtensor = dtensor_type()
    if dtensor is not None and (isinstance(a, dtensor) or isinstance(b, dtensor)):
        if not (isinstance(a, dtensor) and isinstance(b, dtensor)):
            return False  # a DTensor and a plain tensor: two tensors (an untied pair)
        a, b = a.to_local(), b.to_local()
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.numel() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


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
        # JSON: unambiguous whatever the keys hold ("a\0b","c" and "a","b\0c" differ).
        h.update(json.dumps(self.keys, ensure_ascii=False).encode("utf-8", "surrogatepass"))
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
    dtensor = dtensor_type()
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
    if list(ranks) != sorted(ranks):
        _check_mesh_order(key, sig)
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


def _my_global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _mesh_positions(mesh_ranks: tuple[int, ...], mesh_shape: tuple[int, ...]
                    ) -> list[tuple[list[int], list[int]]]:
    """Per mesh entry (in the mesh's row-major order): its coordinate, and its position
    along each mesh dim as torch's collectives see it -- its rank in the process group of
    that dim, whose members are the dim's slice of the mesh in ascending global rank (the
    order ``new_group`` keeps). The two differ only where a mesh's ranks are not ascending
    along a dim (``DeviceMesh("cpu", [1, 0])``); ``full_tensor()`` (and
    ``distribute_tensor``) then place a shard by its position, so the export does too."""
    coords = []
    for i in range(len(mesh_ranks)):
        coord, rest = [], i
        for n in reversed(mesh_shape):
            rest, c = divmod(rest, n)
            coord.append(c)
        coords.append(list(reversed(coord)))
    strides = [math.prod(mesh_shape[d + 1:]) for d in range(len(mesh_shape))]
    out = []
    for i, coord in enumerate(coords):
        position = []
        for d, n in enumerate(mesh_shape):
            base = i - coord[d] * strides[d]
            line = [mesh_ranks[base + k * strides[d]] for k in range(n)]
            position.append(sorted(line).index(mesh_ranks[i]))
        out.append((coord, position))
    return out


@functools.lru_cache(maxsize=4096)
def _dtensor_blocks(sig: Signature) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every mesh rank's block of a DTensor (global rank -> (offset, shape)), computed from its
    global shape, mesh and placements alone -- the same on every rank, nothing exchanged.
    Placed by each rank's position along the mesh dims (:func:`_mesh_positions`), as
    ``full_tensor()`` places it."""
    placements = _torch_placements(sig)
    out = {}
    for g, (_coord, position) in zip(sig.mesh_ranks, _mesh_positions(sig.mesh_ranks,
                                                                     sig.mesh_shape)):
        out[g] = _block_at(sig, placements, position)
    return out


def _torch_placements(sig: Signature) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    assert sig.placements is not None and sig.mesh_ranks is not None and sig.mesh_shape
    return [Shard(c[1]) if c[0] == "S" else Replicate() for c in sig.placements]


def _block_at(sig: Signature, placements: list[Any], coord: list[int]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(sig.shape, sig.mesh_shape, coord,
                                                           placements)
    return tuple(offset), tuple(shape)


def _check_mesh_order(key: str, sig: Signature) -> None:
    """ValueError where a mesh's ranks are not ascending along a dim AND its shards are
    uneven there: torch itself then sizes a shard by its coordinate but gathers it by its
    group rank, so ``full_tensor()`` mixes rows up -- there is no right answer to write."""
    assert sig.mesh_ranks is not None and sig.mesh_shape is not None
    placements = _torch_placements(sig)
    for coord, position in _mesh_positions(sig.mesh_ranks, sig.mesh_shape):
        if coord != position and _block_at(sig, placements, coord)[1] != \
                _block_at(sig, placements, position)[1]:
            raise ValueError(
                f"state[{key!r}] is a DTensor of shape {list(sig.shape)} sharded unevenly "
                f"({sig.placements}) on a mesh whose ranks are not ascending "
                f"({list(sig.mesh_ranks)}, shape {list(sig.mesh_shape)}): torch sizes its "
                "shards by mesh coordinate but gathers them in group-rank order, so even its "
                "own full_tensor() is wrong here; build the DeviceMesh with ascending ranks, "
                "or pad the dim to a multiple of the mesh dim's size")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t``: a DTensor's local shard, else ``t`` itself."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return t
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        # The local shard itself (what to_local() returns, without its autograd node: a few
        # microseconds per entry less, which a model of 100k tensors notices).
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


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
