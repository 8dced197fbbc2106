"""In-memory names <-> the keys a checkpoint is written with: the hub's layout, derived from
transformers' own conversion machinery, each written tensor as blocks of in-memory tensors.

Transformers 5 keeps many families' weights in memory in another layout than their
checkpoints (a MoE's experts fused into one 3-D ``gate_up_proj``; renamed modules), and
``save_pretrained`` reverts that with ``revert_weight_conversion``. We run that same function,
not a table of ours, on *traced* stand-ins of the in-memory tensors: meta tensors that carry
which in-memory key they view. Views (``chunk``, ``split``, ``select``, ``narrow``,
``transpose``, ``permute``, ``squeeze``...) keep their storage offset and strides into the
stand-in's storage, so each written tensor comes out as a strided view of one in-memory
tensor, or a ``cat``/``stack`` of such views; :func:`box_of` turns a view into a box of the
in-memory tensor and a mapping of dims. Nothing is materialized: the exporter then streams
each written tensor's bytes from wherever the boxes live.

An operation that is not a view or a concatenation (a dtype cast, arithmetic, a reshape that
copies) cannot be streamed: it is recorded on the written key and refused by the exporter,
naming the key and the operation (the way out: ``gather_full_state`` then
``save_pretrained``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from distributed_ext.export.plan.remembered import LastAnswer

__all__ = ["Part", "Written", "box_of", "resolve_written"]


@dataclass(frozen=True)
class Part:
    """A box of one in-memory tensor placed in a written tensor.

    ``at``/``shape``: where the box lies in the written tensor (offset and size per written
    dim). ``src_start``: the box's first index in the in-memory tensor, per in-memory dim.
    ``src_dims``: for each written dim, the in-memory dim it runs along (``-1`` for a dim of
    size 1 that runs along none). In-memory dims no written dim runs along are fixed at
    ``src_start`` (a selected index).
    """

    source: str
    at: tuple[int, ...]
    shape: tuple[int, ...]
    src_start: tuple[int, ...]
    src_dims: tuple[int, ...]

    def src_stop(self, d: int) -> int:
        """One past the box's last index along in-memory dim ``d``."""
        for j, sd in enumerate(self.src_dims):
            if sd == d:
                return self.src_start[d] + self.shape[j]
        return self.src_start[d] + 1

    @property
    def is_permuted(self) -> bool:
        """Whether the written dims run along in-memory dims out of order (a transpose)."""
        mapped = [d for d in self.src_dims if d >= 0]
        return mapped != sorted(mapped)


@dataclass(frozen=True)
class Written:
    """A tensor as the checkpoint holds it: its dtype, shape and the parts it is made of
    (they tile it), or ``unstreamable``: the operation that makes it not a set of boxes."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    unstreamable: str | None = None
    # Computed from its one part's rows (:class:`plan.types.Transform`; ``dtype``/``shape``
    # are then the computed tensor's, the part the whole in-memory tensor)
    transform: Any = None


def identity(key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Written:
    """A tensor written as it is held, under its own key."""
    nd = len(shape)
    return Written(key, dtype, shape, (Part(key, (0,) * nd, shape, (0,) * nd,
                                            tuple(range(nd))),))


def box_of(view: torch.Tensor, src_shape: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                    tuple[int, ...]] | None:
    """``(src_start, src_dims)`` of a strided view into a contiguous tensor of ``src_shape``
    (its storage offset and strides in elements), or None if the view is not a box of it
    (a dim that spans several in-memory dims, an overlap)."""
    src_strides = [math.prod(src_shape[d + 1:]) for d in range(len(src_shape))]
    start: list[int] = []
    rest = view.storage_offset()
    for d, n in enumerate(src_shape):
        q, rest = divmod(rest, src_strides[d]) if src_strides[d] else (0, rest)
        start.append(q)
        if q >= max(n, 1):
            return None
    if rest:
        return None
    dims: list[int] = []
    used: set[int] = set()
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            dims.append(-1)
            continue
        # Among in-memory dims of this stride, only the outermost can have size > 1.
        d = next((d for d in range(len(src_shape))
                  if src_strides[d] == stride and src_shape[d] > 1), None)
        if d is None or d in used or start[d] + size > src_shape[d]:
            return None
        used.add(d)
        dims.append(d)
    return tuple(start), tuple(dims)


class _Traced(torch.Tensor):
    """A meta stand-in for an in-memory tensor (or a view of one, or a concatenation), as
    transformers' conversion ops see it. ``_parts``: the concatenation's pieces, as
    ``(offset per dim, traced view)``; ``_source``: the key a view views; ``_bad``: the first
    operation that is neither."""

    _source: str | None
    _parts: list[tuple[tuple[int, ...], _Traced]] | None
    _bad: str | None
    _src_shape: tuple[int, ...]

    @staticmethod
    def __new__(cls, meta: torch.Tensor, source: str | None, src_shape: tuple[int, ...],
                parts: list | None = None, bad: str | None = None) -> _Traced:
        t = torch.Tensor._make_subclass(cls, meta)
        t._source, t._src_shape, t._parts, t._bad = source, src_shape, parts, bad
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = getattr(func, "__name__", None) or repr(func)
        kwargs = kwargs or {}
        # A call on one stand-in with plain arguments (``.shape``, ``.dim()``, ``.squeeze(0)``:
        # a MoE's reverted experts make thousands) is answered without walking them.
        alone = not kwargs and args and type(args[0]) is cls and not any(
            isinstance(a, (torch.Tensor, list, tuple, dict)) for a in args[1:])
        traced = [args[0]] if alone else [a for a in _flat(args) if isinstance(a, _Traced)]
        first = traced[0] if traced else None
        with torch._C.DisableTorchFunctionSubclass():
            if name in _SAME_VALUES and first is not None and _keeps_dtype(func, args, kwargs):
                return first  # the same values: still the same view
            base = None if first is None else first.as_subclass(torch.Tensor)
            if alone:
                out = func(base, *args[1:])
            else:
                out = func(*_unwrap(args), **_unwrap(kwargs))
        if not _has_tensor(out):
            return out  # .shape, .size(), .dim(), .dtype...
        if name in ("cat", "concat", "concatenate", "stack"):
            return _concat(name, args, kwargs, out)
        bad = next((t._bad for t in traced if t._bad), None)
        if bad is None and first is not None and first._parts is not None:
            bad = f"{name} of a concatenation"
        if bad is None and (len(traced) != 1 or not _all_views_of(out, base)):
            bad = name
        return _wrap(out, first, bad)


# Calls that return the same values as their input (a copy at most).
_SAME_VALUES = {"contiguous", "clone", "detach", "to", "cpu", "cuda", "requires_grad_"}


def _keeps_dtype(func: Any, args: Any, kwargs: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name != "to":
        return True
    dtype = kwargs.get("dtype")
    dtype = dtype if dtype is not None else next(
        (a for a in args[1:] if isinstance(a, torch.dtype)), None)
    return dtype is None or dtype == args[0].dtype


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flat(item)]
    return [x]


def _unwrap(x: Any) -> Any:
    if isinstance(x, _Traced):
        return x.as_subclass(torch.Tensor)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y) for y in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _has_tensor(x: Any) -> bool:
    return any(isinstance(y, torch.Tensor) for y in _flat(x))


def _all_views_of(out: Any, base: torch.Tensor) -> bool:
    return all(torch._C._is_alias_of(t, base) for t in _flat(out) if isinstance(t, torch.Tensor))


def _wrap(out: Any, like: _Traced | None, bad: str | None) -> Any:
    if isinstance(out, torch.Tensor):
        src = like._source if like is not None else None
        shape = like._src_shape if like is not None else ()
        return _Traced(out, src, shape, None, bad)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, like, bad) for o in out)
    return out


def _concat(name: str, args: Any, kwargs: Any, out: torch.Tensor) -> _Traced:
    tensors = list(args[0])
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    dim = dim % out.dim()
    parts: list[tuple[tuple[int, ...], _Traced]] = []
    pos = 0
    bad = None
    for t in tensors:
        if not isinstance(t, _Traced) or t._bad or t._parts is not None:
            bad = (t._bad if isinstance(t, _Traced) and t._bad else f"{name} of a non-view")
            break
        if name == "stack":
            with torch._C.DisableTorchFunctionSubclass():
                view = t.as_subclass(torch.Tensor).unsqueeze(dim)
            t = _Traced(view, t._source, t._src_shape)
        at = tuple(pos if d == dim else 0 for d in range(out.dim()))
        parts.append((at, t))
        pos += t.shape[dim]
    meta = torch.empty(out.shape, dtype=out.dtype, device="meta")
    return _Traced(meta, None, (), None if bad else parts, bad)


def _parts_of(value: _Traced) -> tuple[list[Part], str | None]:
    with torch._C.DisableTorchFunctionSubclass():  # (its shape read as a plain tensor's)
        pieces = value._parts if value._parts is not None else [((0,) * value.dim(), value)]
        parts = []
        for at, view in pieces:
            if view._bad:
                return [], view._bad
            box = box_of(view, view._src_shape)
            if box is None or view._source is None:
                return [], "a reshape that is not a box of the in-memory tensor"
            parts.append(Part(view._source, at, tuple(view.shape), *box))
    return parts, None


def resolve_written(model: Any, held: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                    converts: bool | None = None) -> list[Written]:
    """The tensors ``save_pretrained`` would write for ``model``'s state ``held`` (in-memory key
    -> dtype and global shape, tied weights already dropped), in transformers' own layout.

    Runs ``transformers.core_model_loading.revert_weight_conversion`` -- what
    ``save_pretrained`` runs -- on traced meta stand-ins, so a family added to transformers
    needs nothing here. A model with no conversion (or no transformers) keeps its keys.
    ``converts``: :func:`has_conversions` of ``model`` where already known (None: found here).
    """
    if not (has_conversions(model) if converts is None else converts):
        return [identity(k, dt, shape) for k, (dt, shape) in held.items()]
    split = _converted_apart(model, held)
    return _traced_revert(model, held) if split is None else split


def _converted_apart(model: Any, held: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                     ) -> list[Written] | None:
    """:func:`resolve_written`, with transformers' function run only on the keys one of its
    converters takes; None where that cannot be told apart (two keys renamed alike, a
    converted tensor not traced to its keys): then run on every key.

    Why: ``revert_weight_conversion`` compiles a regular expression of every key it only
    renames (a ``WeightRenaming`` of that key each); a quantized MoE has thousands
    such keys (each expert's scales) and few converted ones. For a key no converter matches,
    its result is the key through the model's renamings (``apply_renamings``), which is what
    is computed here with transformers' own functions, in its order (keys sorted by
    ``dot_natural_key``, each converter's outputs at its first key). Tested equal to the
    whole function on every family of the tests, with such keys added."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
            dot_natural_key,
        )

        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:  # (as revert_weight_conversion chooses them)
            conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                           if not isinstance(c, PrefixChange)]
        if not conversions:
            return None
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
        converters = [r for r in reverse if isinstance(r, WeightConverter)]
        # entry (its name in transformers' mapping) -> the key renamed, or the converted keys
        entries: dict[str, str | list[str]] = {}
        entry_of: dict[str, str] = {}
        for key in sorted(held, key=dot_natural_key):
            name, pattern = apply_converters(key, converters)
            if pattern is None:
                name = apply_renamings(key, renamings)
                if name in entries:
                    return None
                entries[name] = key
            else:
                keys = entries.setdefault(name, [])
                if not isinstance(keys, list):
                    return None
                keys.append(key)
                entry_of[key] = name
    except Exception:  # noqa: BLE001 - transformers' whole function decides (and raises)
        return None
    outputs: dict[str, list[Written]] = {}
    if entry_of:
        for w in _traced_revert_once(model, {k: held[k] for k in entry_of}):
            if not w.parts or w.parts[0].source not in entry_of:
                return None
            outputs.setdefault(entry_of[w.parts[0].source], []).append(w)
    out: list[Written] = []
    for name, kept in entries.items():
        if isinstance(kept, str):
            dt, shape = held[kept]
            nd = len(shape)
            # (as a traced view reads: a dim of size 1 runs along none)
            out.append(Written(name, dt, tuple(shape), (Part(
                kept, (0,) * nd, tuple(shape), (0,) * nd,
                tuple(-1 if n == 1 else d for d, n in enumerate(shape))),)))
        else:
            out.extend(outputs.pop(name, []))
    return None if outputs else out


# The last model's converted keys and what they were traced to (an export resolves the same
# converted keys more than once: a quantized model's weights before its scales are known,
# then all); forgotten at the start of each export (:func:`forget`).
_TRACED = LastAnswer()


def forget() -> None:
    """Drops what an earlier export remembered (a conversion registered since then counts)."""
    _TRACED.forget()


def _traced_revert_once(model: Any, held: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                        ) -> list[Written]:
    """:func:`_traced_revert`, remembered for the last model and keys (while the model's own
    record of conversions, if any, is the same object: else transformers' table decides,
    the same for the same model)."""
    key = tuple(held.items())
    recorded = getattr(model, "_weight_conversions", None)
    last = _TRACED.get(model, key)
    if last is not None and last[0] is recorded:
        return list(last[1])
    out = _traced_revert(model, held)
    _TRACED.put(model, key, (recorded, list(out)))
    return out


def _traced_revert(model: Any, held: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                   ) -> list[Written]:
    """``revert_weight_conversion`` run on traced stand-ins of every key of ``held``."""
    from transformers.core_model_loading import revert_weight_conversion

    stand_ins = {k: _Traced(torch.empty(shape, dtype=dt, device="meta"), k, tuple(shape))
                 for k, (dt, shape) in held.items()}
    reverted = revert_weight_conversion(model, dict(stand_ins))
    out = []
    for key, value in reverted.items():
        if not isinstance(value, _Traced):
            out.append(Written(key, held.get(key, (torch.float32, ()))[0], (), (),
                               f"a conversion that made a {type(value).__name__}"))
            continue
        parts, bad = _parts_of(value)
        with torch._C.DisableTorchFunctionSubclass():
            dtype, shape = value.dtype, tuple(value.shape)
        out.append(Written(key, dtype, shape, tuple(parts), bad))
    return out


def has_conversions(model: Any) -> bool:
    """Whether transformers would convert ``model``'s keys or weights on save."""
    if model is None or getattr(model, "config", None) is None:
        return False
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return False
    if getattr(model, "_weight_conversions", None) is not None:
        return bool(model._weight_conversions)
    if not _may_convert(model):
        return False
    try:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - a model transformers does not know: its own keys
        return False
    return any(not isinstance(c, PrefixChange) for c in conversions)


def _may_convert(model: Any) -> bool:
    """False only where transformers' table of conversions cannot hold ``model``: no
    ``PreTrainedModel`` inside it has a class name or ``model_type`` that the table's source
    file names in quotes (every key of the table is such a literal there) or that a user
    registered. The table itself, 900 regular expressions, is costly to build once
    per process, on the critical path of a fresh rank's first export (every peer waits on
    dst's answer); a Llama, a Qwen2 or a Mistral is not in it. Where the source cannot be
    read, or names the model, the table decides (:func:`has_conversions`)."""
    try:
        from transformers import PreTrainedModel, conversion_mapping
    except ImportError:
        return True
    source = _conversion_source(getattr(conversion_mapping, "__file__", None))
    if source is None:
        return True
    registered = getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", None) or ()
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        for name in (type(module).__name__, getattr(module.config, "model_type", None)):
            if name is None or name in registered:
                return True
            if f'"{name}"' in source or f"'{name}'" in source:
                return True
    return False


@functools.lru_cache(maxsize=8)
def _conversion_source(path: str | None) -> str | None:
    """The text of transformers' conversion table's module (read once per process), or
    None where there is no readable source file."""
    if path is None or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None
