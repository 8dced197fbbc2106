"""Probing what ModelOpt's export writes for each quantized weight: its export of a few rows of
ones on a stand-in (the written dtypes and shapes, which outputs grow with the rows, the
global scales), each weight probed by one rank of the export and the probes shared; and
ModelOpt's steps before it quantizes (:func:`_ready`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan.quant_rows import _by_rows, _export_rows, device_of
from distributed_ext.export.plan.quantizers import (
    ROW_FORMATS,
    _sources,
    _Unit,
    export_dtype,
    held_units,
)
from distributed_ext.export.plan.shared_inputs import fuse_shared_inputs, needs_gather, sync_amax

# A weight's probe (:func:`_probe`): ModelOpt's outputs of a few rows, in its order, each
# (name, dtype, shape, bytes of a global output | None for a per-row one: its shape for
# that many rows), and which outputs are per row. Plain data, not tensors: ranks hand each
# other their share, and a tensor costs far more to pickle and unpickle.
Probe = tuple[list[tuple[str, torch.dtype, tuple[int, ...], "bytes | None"]], list[str]]

def _ready(model: nn.Module, dtype: torch.dtype, pre_quant: bool | None = None) -> None:
    """ModelOpt's export's steps before it quantizes, on this rank's copy of the calibration
    results, in place: the shared-input layers fused (AWQ's are fused before, by every rank
    together: :func:`plan.shared_inputs.needs_gather`, ``pre_quant`` where the caller asked
    it already), then :func:`plan.shared_inputs.sync_amax`."""
    if not (needs_gather(model) if pre_quant is None else pre_quant):
        fuse_shared_inputs(model)
    sync_amax(model, dtype)

def probe_share(model: nn.Module, state_of: Callable[[], dict[str, Any]], index: int,
                count: int, pre_quant: bool | None = None
                ) -> tuple[dict[str, Probe] | None, dict[str, Any] | None,
                           dict[str, Any] | None]:
    """This rank's share of the quantized weights' probes (:func:`probe_range`, of the
    weights grouped by weight quantizer in written order: :func:`_by_quantizer`), after
    ModelOpt's steps before it quantizes (:func:`_ready`, which :func:`prepare` given
    these probes then skips; ``pre_quant`` as there); None for a model ModelOpt did not
    quantize. Each rank of an export computes its share and every rank gets them all: a
    probe costs a few hundred microseconds of ModelOpt's Python per weight, and a MoE has one
    weight per expert and projection (18k for 48 layers of 128 experts). Returned beside
    them: the model's state (``state_of()``, asked once those steps ran, so that it holds the
    quantizers' buffers as they leave them: the export's plan may take it instead of asking
    again), or None where not asked; and on the last rank (``index == count - 1``) ModelOpt's
    quantization config of the model (``get_quant_config``, for :func:`prepare`'s
    ``quant_config``): a walk of every module in ModelOpt's Python (as much as about a hundred probes for a
    dense model; the last rank probes less for it),
    the same on every rank, so asked of one; else None. ValueError as :func:`prepare`'s."""
    sources = _sources(model)
    if not sources:
        return None, None, None
    dtype = export_dtype(model)
    _ready(model, dtype, pre_quant)
    state = state_of()
    held, units = held_units(model, state, sources, None)
    groups = _by_quantizer(units)
    first, end = probe_range(index, count, len(groups), len(sources))
    asked: dict[tuple, Probe] = {}
    probes = {w.key: _probe_once(w, unit, held[w.parts[0].source][0], dtype, asked)
              for group in groups[first:end] for w, unit in group}
    config = None
    if index == count - 1:
        from modelopt.torch.export.quant_utils import get_quant_config

        config = get_quant_config(model)
    return probes, state, config


def _by_quantizer(units: list[tuple[_keys.Written, _Unit]]
                  ) -> list[list[tuple[_keys.Written, _Unit]]]:
    """The units grouped by their weight quantizer, in the order each first comes: a group
    is probed by one rank, so that weights that may share a probe (:func:`_probe_once`: a
    gated expert's gate and up projections, written far apart) are probed together."""
    groups: dict[int, list[tuple[_keys.Written, _Unit]]] = {}
    for w, unit in units:
        groups.setdefault(id(unit.weight_quantizer), []).append((w, unit))
    return list(groups.values())


# What asking ModelOpt's quantization config costs (the last rank asks it), in probes: a
# fixed part and a part a quantized module (fitted to a dense Llama and a Qwen3-MoE:
# docs/measurements.md).
_CONFIG_IN_PROBES = (40.0, 0.3)


def probe_range(index: int, count: int, weights: int, sources: int) -> tuple[int, int]:
    """The quantized weights' groups (``first, end`` among ``weights`` groups,
    :func:`_by_quantizer`) whose probes group rank ``index`` of ``count`` makes: consecutive
    shares of the same work, the last rank's smaller by what ModelOpt's quantization config
    costs it (:data:`_CONFIG_IN_PROBES`, for a model of ``sources`` quantized modules). The
    same on every rank that holds the same keys. Why not equal shares: a rank that asks the
    config while its peers probe would finish last (a dense Llama), and one that takes a share
    less for it would finish first while they probe (a MoE, whose config is cheap beside its
    thousands of weights)."""
    if count == 1:
        return 0, weights
    fixed, per_source = _CONFIG_IN_PROBES
    config = fixed + per_source * sources
    last = min(weights, max(0, round((weights + config) / count - config)))
    others, extra = divmod(weights - last, count - 1)
    if index == count - 1:
        return weights - last, weights
    first = index * others + min(index, extra)
    return first, first + others + (index < extra)

# _kind(...) -> the outputs of ModelOpt's export that grow with the rows (_plan_unit)
_PER_ROW: dict[tuple, list[str]] = {}


def _kind(unit: _Unit, weight_dtype: torch.dtype, dtype: torch.dtype, cols: int, whole: bool
          ) -> tuple:
    """What ModelOpt's export of a weight's rows makes of their number: the format, the
    quantizers' setup (block sizes, axis, each buffer's shape, a multiple ``k`` of the
    weight's rows written ``"rows*k"``), the columns and dtypes."""
    def shapes(q: nn.Module | None) -> tuple:
        if q is None:
            return ()
        return tuple((name, buf.dim(), tuple(
            f"rows*{d // unit.total}" if i == 0 and d and d % unit.total == 0 else d
            for i, d in enumerate(buf.shape)))
            for name, buf in q.named_buffers() if isinstance(buf, torch.Tensor))

    wq = unit.weight_quantizer
    return (unit.fmt, str(weight_dtype), str(dtype), cols, whole,
            repr(getattr(wq, "block_sizes", None)), repr(getattr(wq, "axis", None)),
            shapes(wq), shapes(unit.input_quantizer), type(wq).__name__)


def _probe_rows(step: int, total: int) -> int:
    """The rows of a weight of ``total`` rows that its probe exports: two blocks of ``step``,
    or all of them where it has under four."""
    return 2 * step if 4 * step <= total else total


def _probe(w: _keys.Written, unit: _Unit, weight_dtype: torch.dtype, dtype: torch.dtype
           ) -> Probe:
    """ModelOpt's export of ``2 * step`` rows of ones of a weight (all its rows where it has
    under four blocks), and which of its outputs grow with the rows: those that differ from
    its export of ``4 * step`` rows (asked once per kind of weight, :func:`_kind`)."""
    shape = w.shape
    step = ROW_FORMATS[unit.fmt]
    total = shape[0]
    if len(shape) != 2 or total % step:
        raise ValueError(f"{w.key!r}: {unit.fmt} takes {step} rows of a 2-D weight together, "
                         f"but it has shape {list(shape)}")
    probe = _probe_rows(step, total)

    def ones(n: int) -> dict[str, torch.Tensor]:
        rows = torch.ones((n, shape[1]), dtype=weight_dtype, device=device_of(unit))
        try:
            return _export_rows(unit, rows, 0, dtype)
        except (AssertionError, NotImplementedError) as exc:  # (ModelOpt's, naming nothing)
            raise ValueError(f"{unit.name} ({unit.fmt}): ModelOpt's export refuses this "
                             f"weight of shape {list(shape)}: {exc}; change its quantization "
                             "config, or leave this module unquantized") from exc

    one = ones(probe)
    # Which outputs grow with the rows depends on the format, the quantizer's setup and the
    # weight's columns and dtypes, not on its values: asked of ModelOpt once per kind.
    kind = _kind(unit, weight_dtype, dtype, shape[1], probe == total)
    per_row = _PER_ROW.get(kind)
    if per_row is None or not set(per_row) <= set(one):
        # (a weight of under four blocks: every output with rows is computed from its rows)
        two = one if probe == total else ones(2 * probe)
        per_row = [k for k, small in one.items() if k == "weight" or (small.dim() > 0 and (
            two[k].shape != small.shape or two is one))]
        _PER_ROW[kind] = per_row
    return ([(k, v.dtype, tuple(v.shape), None if k in per_row else
              v.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
             for k, v in one.items()], list(per_row))


def _probe_once(w: _keys.Written, unit: _Unit, weight_dtype: torch.dtype, dtype: torch.dtype,
                asked: dict[tuple, Probe]) -> Probe:
    """:func:`_probe`, or the probe already made in this export (``asked``) of a weight
    whose stand-in is the same: the same quantizer objects, rows cut alike from their
    buffers (no per-row buffer: the rows' place does not matter), the same shape and dtypes.
    A gated expert's gate and up projections share one weight quantizer (a third of a MoE's
    probes). The quantizers are alive for the export, so their ids are not reused in it."""
    wq = unit.weight_quantizer
    per_row = any(isinstance(b, torch.Tensor) and _by_rows(b, unit.total)
                  for b in wq.buffers(recurse=False))
    key = (id(wq), id(unit.input_quantizer), id(unit.output_quantizer), unit.fmt,
           unit.total, unit.first if per_row else None, tuple(w.shape), weight_dtype, dtype)
    probe = asked.get(key)
    if probe is None:
        probe = asked[key] = _probe(w, unit, weight_dtype, dtype)
    return probe
