"""A quantized weight's rows computed where they live: ModelOpt's own export function run on a
stand-in module that holds only a rank's rows (its quantizers copied, a per-row amax cut to
those rows), on the device the quantizers live on; the compiled core's kernels in its place
for host rows where they give ModelOpt's bytes (:mod:`plan.row_kernels`). :class:`_RowsOf`
is the per-row :class:`plan.types.Transform` function the plan hands the transport."""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from distributed_ext.export.plan.quantizers import ROW_FORMATS, _Unit
from distributed_ext.export.plan.row_kernels import RowsFn
from distributed_ext.export.plan.shared_inputs import copy_quantizer


def _by_rows(buf: torch.Tensor, total: int) -> bool:
    """Whether a quantizer's buffer is per row or per row block of a weight of ``total``
    rows (an amax of ``total * k`` rows, row-major): :func:`_cut` cuts it by rows."""
    return buf.dim() > 0 and buf.numel() != 1 and buf.shape[0] % total == 0


def _cut(buf: torch.Tensor, first: int, n: int, total: int, repeat: int) -> torch.Tensor:
    """Rows ``first .. first + n`` (of ``total``) of a per-row or per-row-block buffer
    (:func:`_by_rows`), ``repeat`` times over; a per-tensor one as it is."""
    if not _by_rows(buf, total):
        return buf
    k = buf.shape[0] // total
    cut = buf[first * k : (first + n) * k]
    return torch.cat([cut] * repeat) if repeat > 1 else cut


def device_of(unit: _Unit) -> torch.device:
    """Where ModelOpt's arithmetic of a unit's rows runs: on its weight quantizer's device
    (where its calibration results live: the GPU of a model calibrated there), the host
    where the quantizer holds no tensor. Rows held elsewhere (FSDP2's CPU offload keeps the
    weights on the host, the quantizers' buffers on the GPU) are moved there first, as
    ModelOpt's own arithmetic would refuse them beside its amax."""
    for buf in unit.weight_quantizer._buffers.values():  # (its own; not the generator's cost)
        if isinstance(buf, torch.Tensor):
            return buf.device
    return torch.device("cpu")


def _stand_in(unit: _Unit, rows: torch.Tensor, first: int, repeat: int) -> nn.Module:
    """``rows`` (``repeat`` times over; on the unit's device, :func:`device_of`) and copies
    of the unit's quantizers -- the weight quantizer's per-row buffers cut to those rows --
    as ModelOpt's export reads a linear."""
    device = device_of(unit)
    if rows.device != device:
        rows = rows.to(device)
    s = nn.Module()
    n = rows.shape[0]
    s.weight = nn.Parameter(rows.repeat(repeat, *(1,) * (rows.dim() - 1)) if repeat > 1
                            else rows, requires_grad=False)
    wq = copy_quantizer(unit.weight_quantizer)
    for name, buf in list(wq.named_buffers(recurse=False)):
        if isinstance(buf, torch.Tensor) and buf.dim() > 0:
            cut = _cut(buf, unit.first + first, n, unit.total, repeat)
            if cut is not buf:  # (a per-tensor buffer stays: ModelOpt's setter is slow)
                setattr(wq, name, cut)
    # (the shape ModelOpt gives a per-block amax when exporting it: the weight's rows)
    shape = getattr(wq, "_amax_shape_for_export", None)
    if shape is not None and len(shape) and shape[0] == unit.total:
        wq._amax_shape_for_export = (n * repeat, *tuple(shape)[1:])
    s.weight_quantizer = wq
    # Copies: ModelOpt's export converts their amax to float32 in place.
    if unit.input_quantizer is not None:
        s.input_quantizer = copy_quantizer(unit.input_quantizer)
    if unit.output_quantizer is not None:
        s.output_quantizer = copy_quantizer(unit.output_quantizer)
    return s


def _export_rows(unit: _Unit, rows: torch.Tensor, first: int, dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """ModelOpt's export of the rows ``first ..`` of a unit's weight: the quantized rows and
    the scales it registers (named as ModelOpt writes them under the module). One block of
    ``step`` rows alone is computed twice over and halved: ModelOpt's arithmetic squeezes a
    per-row scale of one row to a scalar."""
    from modelopt.torch.export.quant_utils import quantizer_attr_names
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    repeat = 2 if rows.shape[0] <= ROW_FORMATS[unit.fmt] else 1
    s = _stand_in(unit, rows, first, repeat)
    _export_quantized_weight(s, dtype)
    names = quantizer_attr_names("weight")
    out = {"weight": s.weight.detach()}
    for attr in (names.weight_scale, names.weight_scale_2, names.input_scale):
        value = getattr(s, attr, None)
        if isinstance(value, torch.Tensor):
            out[attr] = value.detach()
    if repeat > 1:  # the first copy's rows of each per-row output
        n = s.weight.shape[0] // repeat
        out = {k: v[:n] if k == "weight" or (v.dim() and v.shape[0] == 2 * n) else v
               for k, v in out.items()}
    return out


def _weight_scale_rows(unit: _Unit, rows: torch.Tensor, first: int) -> torch.Tensor:
    """ModelOpt's ``weight_scale`` of the rows ``first ..`` of a unit's weight alone (its
    ``get_weight_scaling_factor``, as its export registers it), without quantizing them:
    for a format whose scales come from the calibration (INT4 AWQ)."""
    from modelopt.torch.export.quant_utils import get_weight_scaling_factor

    repeat = 2 if rows.shape[0] <= ROW_FORMATS[unit.fmt] else 1
    scale = get_weight_scaling_factor(_stand_in(unit, rows, first, repeat), "weight")
    return scale[: rows.shape[0]] if repeat > 1 else scale


class _RowsOf:
    """One output of ModelOpt's export of a weight, for the rows a rank holds (called in the
    stager). ModelOpt computes a weight's every output in one call; the outputs other than
    the weight (per-row and per-block scales: 1/32 of the rows' bytes or less) are kept
    (:class:`_Kept`) when the weight's rows are computed, so that the scales' entry, written
    next, takes them instead of computing the rows again."""

    def __init__(self, unit: _Unit, suffix: str, dtype: torch.dtype, token: int,
                 kept: tuple[str, ...], fast: RowsFn | None) -> None:
        self.unit, self.suffix, self.dtype, self.token, self.kept = (unit, suffix, dtype,
                                                                     token, kept)
        # The compiled core's arithmetic (plan.row_kernels; host rows), or None: ModelOpt's
        # own, on the unit's device (a GPU's rows are quantized there, then cross to the host).
        self.fast = fast
        # (the weight's rows computed straight into the caller's bytes, where the compiled
        # core can and no other output is kept beside them: Transform.rows_of)
        into = getattr(fast, "rows_into", None)
        self.rows_into = into if suffix == "weight" and not kept else None

    def __call__(self, rows: torch.Tensor, first: int) -> torch.Tensor:
        if self.fast is not None and not rows.is_cpu:  # (the core's kernels take host rows)
            rows = rows.cpu()
        key = (self.token, first, rows.shape[0])
        if self.suffix != "weight":
            got = _KEPT.take(key, self.suffix)
            if got is not None:
                return got
            # Not kept (the weight's rows not computed first, or cut otherwise): computed
            # alone where the compiled core can (NVFP4's block scales: no codes).
            alone = getattr(self.fast, "alone", {}).get(self.suffix)
            if alone is not None:
                return alone(rows, first)
        out = (self.fast(rows, first) if self.fast is not None
               else _export_rows(self.unit, rows, first, self.dtype))
        if self.suffix == "weight":
            _KEPT.put(key, {k: out[k] for k in self.kept})
        return out[self.suffix]


class _Kept:
    """The per-row outputs other than the weight, of the rows last computed, by (weight,
    first row, rows): at most ``budget`` bytes, the oldest dropped first; each taken once.
    Thread-safe (a rank's own writes and its shared blocks' rounds compute at once)."""

    def __init__(self, budget: int) -> None:
        import collections
        import threading

        self.budget, self.held = budget, 0
        self.items: collections.OrderedDict[tuple, dict[str, torch.Tensor]] = \
            collections.OrderedDict()
        self.lock = threading.Lock()

    def put(self, key: tuple, outputs: dict[str, torch.Tensor]) -> None:
        if not outputs:
            return
        size = sum(v.numel() * v.element_size() for v in outputs.values())
        with self.lock:
            self.items[key] = outputs
            self.held += size
            while self.held > self.budget and self.items:
                _k, old = self.items.popitem(last=False)
                self.held -= sum(v.numel() * v.element_size() for v in old.values())

    def take(self, key: tuple, suffix: str) -> torch.Tensor | None:
        with self.lock:
            outputs = self.items.get(key)
            if outputs is None or suffix not in outputs:
                return None
            value = outputs.pop(suffix)
            self.held -= value.numel() * value.element_size()
            if not outputs:
                del self.items[key]
            return value

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.held = 0


_KEPT = _Kept(32 * 2**20)
_TOKENS = itertools.count()
