"""What each rank holds: its entries described as compact tables (exchanged in the metadata
round, as a digest where every rank holds the same keys), with every check a signature
determines made once per signature; a DTensor's blocks computed from its global shape, mesh
and placements alone."""

from __future__ import annotations

import array
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distributed_ext import runtime
from distributed_ext._dtensor import dtensor_type
from distributed_ext.export.plan.placements import (
    check_mesh_order,
    mesh_boxes,
    placement_code,
    show_codes,
)
from distributed_ext.export.plan.safetensors import SAFETENSORS_DTYPES, _dtype_name
from distributed_ext.export.plan.wrappers import strip_wrapper_keys, unwrap


def resolve_state(model_or_state: nn.Module | dict) -> tuple[dict[str, torch.Tensor], nn.Module | None]:
    """The in-memory entries to export, and the model if any.

    For a module: the model inside its wrappers (``torch.compile``, DDP:
    :mod:`plan.wrappers`) and its ``state_dict()`` under its own keys, less
    the keys ``save_pretrained`` leaves out: tied weights (the keys of ``_tied_weights_keys``
    that alias their source), so that ``from_pretrained`` re-ties them, and
    ``_keys_to_ignore_on_save``. The keys are the model's in-memory names;
    :mod:`plan.keys` maps them to the hub's.
    """
    if isinstance(model_or_state, nn.Module):
        model = unwrap(model_or_state)
        # keep_vars: a tied parameter is then the same object under both keys.
        state = strip_wrapper_keys(model, dict(model.state_dict(keep_vars=True)))
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
    if a.is_meta or b.is_meta:  # (no memory to compare: a model built from its config)
        return False
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
        if self.placements is None:
            return f"{self.dtype} {self.shape}"
        assert self.mesh_ranks is not None and self.mesh_shape is not None
        return (f"{self.dtype} {self.shape} {show_codes(self.placements)} on mesh of "
                f"ranks {list(self.mesh_ranks)} shape {list(self.mesh_shape)}")


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
    # dst's verdict on whether transformers converts the model's keys on save (None on the
    # other ranks): one rank builds transformers' table of conversions, not every rank.
    converts: bool | None = None

    def summary(self) -> Described:
        """This without its keys and ids, with their digest: a few hundred bytes whatever
        the number of keys."""
        assert self.keys is not None and self.sig_ids is not None
        h = hashlib.blake2b(digest_size=16)
        h.update(len(self.keys).to_bytes(8, "little"))
        # JSON: unambiguous whatever the keys hold ("a\0b","c" and "a","b\0c" differ).
        h.update(json.dumps(self.keys, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        h.update(self.sig_ids)
        return Described(None, None, self.signatures, self.plan, self.args, h.digest(),
                         self.converts)


def describe_state(state: dict[str, Any], plan: tuple | None = None,
                   local: dict[str, torch.Tensor] | None = None) -> Described:
    """This rank's entries as compact tables; TypeError/ValueError naming the key of an
    entry the export cannot write (not a tensor, a dtype safetensors cannot store, a
    ``Partial`` DTensor or one of a placement it does not know, a local shard of another shape than its
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
    sig = dtensor_signature(key, t)
    ranks = sig.mesh_ranks
    assert ranks is not None and sig.placements is not None
    if list(ranks) != sorted(ranks):
        check_mesh_order(key, sig.shape, sig.placements, ranks, sig.mesh_shape)
    expected = _dtensor_blocks(sig).get(_my_global_rank(), (None, None))[0]
    table.append(sig)
    return len(table) - 1, None if expected is None else torch.Size(expected)


def dtensor_signature(key: str, t: Any) -> Signature:
    """A DTensor's signature: dtype, global shape, placements (as codes), mesh ranks and mesh
    shape. ValueError naming ``key`` for a placement the export cannot place."""
    spec = t._spec
    mesh = spec.mesh
    codes = tuple(placement_code(key, p) for p in spec.placements)
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    return Signature(_dtype_name(t.dtype), tuple(spec.shape), codes, ranks,
                     tuple(mesh.mesh.shape))


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
    return runtime.rank()


def _dtensor_blocks(sig: Signature) -> dict[int, tuple[tuple[int, ...], list]]:
    """Every mesh rank's local shape and boxes of a DTensor (global rank -> (local shape,
    [(global offset, shape, local offset or None)])): :func:`plan.placements.mesh_boxes`."""
    assert sig.placements is not None and sig.mesh_ranks is not None and sig.mesh_shape
    return mesh_boxes(sig.shape, sig.placements, sig.mesh_ranks, sig.mesh_shape)


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
