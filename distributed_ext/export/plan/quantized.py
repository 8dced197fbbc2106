"""A ModelOpt-quantized model written as ModelOpt's own ``export_hf_checkpoint`` writes it,
every quantized weight computed from the rows each rank holds.

ModelOpt's export turns each quantized weight into a quantized tensor and its scales
(``_export_quantized_weight``; a MoE's fused experts split into per-expert projections
first, each with its expert's quantizer), then renames and drops its quantizers' buffers
(``postprocess_state_dict``). Every format it writes for a linear weight is computed row by
row (a per-tensor or per-channel scale from the calibrated amax; NVFP4's per-16 block scales
along a row; INT4 AWQ's per-group scales, rows packed in pairs), so each rank runs ModelOpt's
own function on a stand-in module that holds only its rows (the quantizers copied, a
per-row amax cut to those rows) and gets those rows of every output. Nothing is restated
here: a module's format, the arithmetic, the scales and the JSON files are ModelOpt's.

The outputs of a quantized weight are either *global* (the same whatever the rows: a
per-tensor scale, ``weight_scale_2``, ``input_scale``), computed on every rank from its copy
of the calibration results (already global; agreed in the metadata round) and written as a
small plain tensor, or *per row* (the weight, per-channel and per-block scales): a
:class:`plan.types.Transform` of the rows of the weight transformers would write, computed
by the rank that holds them. Which is which, and the written shapes, come from ModelOpt's
export of two and four row blocks of ones.

The rows are computed on the device their quantizers live on (:func:`device_of`): a host
weight's by the compiled core where it gives ModelOpt's bytes (:mod:`plan.row_kernels`), a
GPU's by ModelOpt's own arithmetic there, the quantized bytes then crossing to the host
(half or less of the rows' bytes) as any GPU-resident bytes do.

ModelOpt is imported only for a model that has its quantizers (it is then already loaded).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan.remembered import LastAnswer
from distributed_ext.export.plan.row_kernels import RowsFn, fast_rows, keep_tables_for
from distributed_ext.export.plan.shared_inputs import (
    copy_quantizer,
    fuse_shared_inputs,
    modelopt_loaded,
    needs_gather,
    sync_amax,
)
from distributed_ext.export.plan.types import Transform
from distributed_ext.export.plan.wrappers import drop_wrapper_parts, wrapper_paths

# The formats written from the shards (ModelOpt's names), each with how many rows its
# arithmetic takes together (INT4 AWQ packs two rows in a byte). Any other format is refused
# by name: its blocks have not been checked against ModelOpt's export.
ROW_FORMATS = {"fp8": 1, "fp8_pc_pt": 1, "int8_wo": 1, "int8_sq": 1, "nvfp4": 1,
               "w4a16_nvfp4": 1, "int4_awq": 2}
_KV_CACHE_MAXBOUND = 448  # ModelOpt's KV cache scale: amax / 448 (FP8 and NVFP4 caches)


@dataclass
class Quantized:
    """What a quantized model's export writes beyond its state: for each weight transformers
    would write (its key), the tensors computed from its rows in its place (key, dtype,
    shape, transform), and ModelOpt's JSON files."""

    replaces: dict[str, list[tuple[str, torch.dtype, tuple[int, ...], Transform]]] = field(
        default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # hf_quant_config.json
    quantization_config: dict[str, Any] | None = None  # config.json's
    digest: tuple = ()  # what every rank must agree on (formats, shapes, global scales)


@dataclass(frozen=True)
class _Unit:
    """How ModelOpt exports one written 2-D weight: its quantizers, and where its rows lie
    among the ``total`` rows its weight quantizer's amax covers (a fused expert's up
    projection starts at ``first`` = its gate's rows)."""

    name: str  # the written module, for messages
    fmt: str
    weight_quantizer: nn.Module
    input_quantizer: nn.Module | None
    output_quantizer: nn.Module | None
    first: int
    total: int


@dataclass(frozen=True)
class _Linear:
    """A quantized linear (a source of :func:`_sources`) and its ModelOpt format."""

    module: nn.Module
    fmt: str


def _format(weight_quantizer: nn.Module, input_quantizer: nn.Module | None,
            probe: nn.Module | None = None) -> str | None:
    """ModelOpt's format of a weight with these quantizers (None where unquantized).
    ``probe``: a module of :func:`_format_probe` to ask it through (one serves a walk)."""
    from modelopt.torch.export.model_config import QUANTIZATION_NONE
    from modelopt.torch.export.quant_utils import get_quantization_format

    probe = _format_probe() if probe is None else probe
    probe.weight_quantizer = weight_quantizer
    if input_quantizer is not None:
        probe.input_quantizer = input_quantizer
    try:
        fmt = get_quantization_format(probe)
    finally:  # (the probe keeps none of the model's modules)
        probe._modules.clear()
    return None if fmt in (None, QUANTIZATION_NONE) else fmt


def _format_probe() -> nn.Module:
    """A module that holds only a weight, for :func:`_format` (ModelOpt looks for the weight
    a quantizer goes with)."""
    probe = nn.Module()
    probe.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    return probe


def _sources(model: nn.Module) -> dict[str, Any]:
    """The quantized in-memory weights (key -> a linear module with its format, or (fused
    experts module, projection attribute)). Empty where ModelOpt was never imported.
    Remembered for the model until the next export (:func:`forget`): an export asks twice
    (its probes, its plan), and each linear's format is a ModelOpt call."""
    if not modelopt_loaded():
        return {}
    last = _SOURCES.get(model, None)
    if last is not None:
        return dict(last)
    out = _find_sources(model)
    _SOURCES.put(model, None, dict(out))
    return out


def _find_sources(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    probe = _format_probe()
    # A wrapper inside the model (``layers[i] = torch.compile(layer)``, DDP) keeps its
    # attribute in the modules' names; the written keys drop it: so do the sources' keys.
    wrappers = wrapper_paths(model)
    for name, module in model.named_modules():
        name = drop_wrapper_parts(name, wrappers)
        # Quantizers are submodules: looked up among them first, since ModelOpt's modules
        # answer a missing attribute in ~4 us of Python, and most modules have no quantizer
        # (four such misses a module were half of this walk: 20 of 40 ms for a 1 GiB Llama).
        subs = module._modules
        fused = any(k.endswith("_weight_quantizers") for k in subs)
        if not fused and "weight_quantizer" not in subs:
            continue
        prefix = f"{name}." if name else ""
        if fused:
            first_proj = getattr(module, "_first_proj_attr", "gate_up_proj")
            if isinstance(getattr(module, f"{first_proj}_weight_quantizers", None),
                          nn.ModuleList):
                for attr in (first_proj, "down_proj"):
                    if isinstance(getattr(module, f"{attr}_weight_quantizers", None),
                                  nn.ModuleList):
                        out[prefix + attr] = (module, attr)
                continue
        wq = getattr(module, "weight_quantizer", None)
        if isinstance(wq, nn.Module) and isinstance(getattr(module, "weight", None), torch.Tensor):
            # (asked of ModelOpt once: its probe of a module is most of this walk's cost)
            fmt = _format(wq, getattr(module, "input_quantizer", None), probe)
            if fmt is not None:
                out[prefix + "weight"] = _Linear(module, fmt)
    for canonical in tied_aliases(model).values():
        # ModelOpt's export writes the canonical side of a tie (the input embedding) as it
        # is, whatever its quantizer; the alias (``lm_head``) as its own quantizers say.
        out.pop(canonical, None)
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """The model's declared ties (``_tied_weights_keys``: alias key -> canonical key) whose
    two sides are one parameter now."""
    tied = getattr(model, "_tied_weights_keys", None)
    if not isinstance(tied, dict):
        return {}
    out = {}
    for alias, canonical in tied.items():
        try:
            same = model.get_parameter(alias) is model.get_parameter(canonical)
        except (AttributeError, TypeError):
            continue
        if same:
            out[alias] = canonical
    return out


def _keep_quantized_aliases(model: nn.Module, state: dict[str, Any],
                            sources: dict[str, Any]) -> None:
    """The alias of a tie that ModelOpt quantized (``lm_head`` of tied embeddings): its export
    writes it as its own quantized tensor beside the canonical one, so its key, which the
    state leaves out as ``save_pretrained`` does, is put back (the same tensor)."""
    for alias, canonical in tied_aliases(model).items():
        if alias in sources and alias not in state and canonical in state:
            state[alias] = state[canonical]


def export_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ModelOpt's export quantizes from where none is passed: the config's, else the
    first parameter's."""
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) if config is not None else None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    first = next(model.parameters(), None)
    return first.dtype if first is not None else torch.float16


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


def _unit_of(w: _keys.Written, sources: dict[str, Any], held: dict[str, tuple],
             probe: nn.Module | None = None, formats: dict[tuple, str | None] | None = None
             ) -> _Unit | None:
    """The unit of a written tensor made from a quantized in-memory weight (None for any
    other); ValueError where it is made in a way ModelOpt's weights are not split by rows.
    ``probe``: a module of :func:`_format_probe` to ask an expert's format through;
    ``formats``: the experts' formats asked so far in this walk, by their quantizers'
    identity (a gated expert's gate and up projections share its weight quantizer: asked
    once for both)."""
    srcs = {p.source for p in w.parts}
    quantized = [s for s in srcs if s in sources]
    if not quantized:
        return None
    key = quantized[0]
    source = sources[key]
    src_shape = held[key][1]
    if len(w.parts) != 1 or w.unstreamable is not None:
        raise ValueError(f"{w.key!r}: made of the quantized {key!r} by a conversion that is "
                         "not one box of it; export_hf_checkpoint cannot quantize it by rows: "
                         "export it with modelopt.torch.export.export_hf_checkpoint")
    part = w.parts[0]
    if isinstance(source, _Linear):  # a linear: its whole weight, as it is
        module = source.module
        if len(src_shape) != 2 or part.shape != src_shape or any(part.src_start) \
                or part.src_dims != (0, 1):
            raise ValueError(f"{w.key!r}: a quantized weight of shape {list(src_shape)} "
                             "written converted; export_hf_checkpoint quantizes 2-D linear "
                             "weights written as they are held")
        name = key[: -len(".weight")] if key.endswith(".weight") else ""
        return _Unit(name, source.fmt, module.weight_quantizer,
                     getattr(module, "input_quantizer", None),
                     getattr(module, "output_quantizer", None), 0, src_shape[0])
    module, attr = source  # fused experts [E, rows, cols]: one expert's rows, every column
    if len(src_shape) != 3 or part.src_dims != (1, 2) or part.shape[1] != src_shape[2]:
        raise ValueError(f"{w.key!r}: written from the fused experts {key!r} "
                         f"{list(src_shape)} other than as rows of one expert (a transposed "
                         "layout); export it with modelopt.torch.export.export_hf_checkpoint")
    expert = part.src_start[0]
    wq = getattr(module, f"{attr}_weight_quantizers")[expert]
    iq = getattr(module, f"{attr}_input_quantizer", None)
    asked = (id(wq), id(iq))  # (alive for the walk: ids are not reused during it)
    if formats is not None and asked in formats:
        fmt = formats[asked]
    else:
        fmt = _format(wq, iq, probe)
        if fmt is not None:
            _check_calibrated(w, wq, expert, key)
        if formats is not None:
            formats[asked] = fmt
    if fmt is None:  # (this expert's weights left unquantized: written as they are)
        return None
    return _Unit(w.key.removesuffix(".weight"), fmt, wq, iq, None, part.src_start[1],
                 src_shape[1])


def _check_calibrated(w: _keys.Written, wq: nn.Module, expert: int, key: str) -> None:
    """ValueError where an expert's enabled weight quantizer has no amax, or one of zeros
    (ModelOpt's own test for it, an uncalibrated expert)."""
    amax = getattr(wq, "_amax", None)
    if not getattr(wq, "is_enabled", False):
        return
    if amax is None or (amax.item() == 0 if amax.numel() == 1 else bool(torch.all(amax == 0))):
        raise ValueError(f"{w.key!r}: expert {expert} of {key!r} was not calibrated (its amax "
                         "is missing or zero); ModelOpt then takes the amax of its whole "
                         "weight, which is not computed from the shards -- calibrate with "
                         "data that routes tokens to every expert")


# A weight's probe (:func:`_probe`): ModelOpt's outputs of a few rows, in its order, each
# (name, dtype, shape, bytes of a global output | None for a per-row one: its shape for
# that many rows), and which outputs are per row. Plain data, not tensors: ranks hand each
# other their share, and a tensor takes 0.1 ms to pickle and unpickle.
Probe = tuple[list[tuple[str, torch.dtype, tuple[int, ...], "bytes | None"]], list[str]]


def _ready(model: nn.Module, dtype: torch.dtype, pre_quant: bool | None = None) -> None:
    """ModelOpt's export's steps before it quantizes, on this rank's copy of the calibration
    results, in place: the shared-input layers fused (AWQ's are fused before, by every rank
    together: :func:`plan.shared_inputs.needs_gather`, ``pre_quant`` where the caller asked
    it already), then :func:`plan.shared_inputs.sync_amax`."""
    if not (needs_gather(model) if pre_quant is None else pre_quant):
        fuse_shared_inputs(model)
    sync_amax(model, dtype)


# The last model's quantized weights, and its units for the held keys (an export asks twice:
# its probes, its plan); forgotten at the start of each export (:func:`forget`).
_SOURCES = LastAnswer()
_UNITS = LastAnswer()


def forget() -> None:
    """Drops what an earlier export remembered (its quantized weights and units, its kept
    outputs): a model's quantizers may change between two exports."""
    _SOURCES.forget()
    _UNITS.forget()
    _KEPT.clear()


def _units(model: nn.Module, sources: dict[str, Any], held: dict[str, tuple],
           converts: bool | None) -> list[tuple[_keys.Written, _Unit]]:
    """Each written quantized weight and how ModelOpt exports it, in the written order (the
    same on every rank that holds the same keys); ValueError naming the module and the
    format where a weight is not written from the shards. The last answer is remembered
    for the same model, sources and keys."""
    key = (tuple(held.items()), tuple(
        (k, id(v.module), v.fmt) if isinstance(v, _Linear) else (k, id(v[0]), v[1])
        for k, v in sources.items()))
    last = _UNITS.get(model, key)
    if last is not None:
        return list(last)
    units = []
    probe = _format_probe()  # (one for the walk: a MoE asks the format of each expert)
    formats: dict[tuple, str | None] = {}
    written_from: set[str] = set()
    for w in _keys.resolve_written(model, held, converts):
        written_from.update(p.source for p in w.parts)
        unit = _unit_of(w, sources, held, probe, formats)
        if unit is None:
            continue
        if unit.fmt not in ROW_FORMATS:
            raise ValueError(
                f"{unit.name}: ModelOpt quantized it as {unit.fmt!r}, which "
                f"export_hf_checkpoint does not write from the shards (it writes "
                f"{', '.join(sorted(ROW_FORMATS))}); export it with "
                "modelopt.torch.export.export_hf_checkpoint instead")
        _check_blocks(unit, w.shape)
        units.append((w, unit))
    _check_every_source_written(sources, written_from)
    _UNITS.put(model, key, list(units))
    return units


def _check_blocks(unit: _Unit, shape: tuple[int, ...]) -> None:
    """ValueError naming the module, its format and what to change where the weight's
    columns are not a whole number of its quantizer's blocks (ModelOpt's export refuses it
    with an AssertionError or "Cannot pack", naming no module), or its rows not a whole
    number of the rows its format packs together."""
    step = ROW_FORMATS[unit.fmt]
    blocks = getattr(unit.weight_quantizer, "block_sizes", None)
    block = blocks.get(-1) if isinstance(blocks, dict) else None
    if len(shape) == 2 and isinstance(block, int) and block > 0 and shape[1] % block:
        raise ValueError(
            f"{unit.name} ({unit.fmt}): its weight has {shape[1]} columns, not a multiple of "
            f"the format's block of {block} columns, so ModelOpt cannot export it; make that "
            f"dimension a multiple of {block} (the layer's input size: hidden_size or "
            f"intermediate_size), quantize with a block size that divides {shape[1]}, or "
            "leave this module unquantized (disable its weight quantizer)")
    if len(shape) == 2 and shape[0] % step:
        raise ValueError(
            f"{unit.name} ({unit.fmt}): its weight has {shape[0]} rows, and the format packs "
            f"{step} rows together; make that dimension a multiple of {step}, or leave this "
            "module unquantized")


def _check_every_source_written(sources: dict[str, Any], written_from: set[str]) -> None:
    """ValueError naming the first quantized module whose weight no written tensor is made
    from: its quantization config would declare it quantized while the checkpoint held it in
    high precision, or not at all (the config and the tensors must come from one source:
    checked before any byte moves, whatever wrapper or tie came between them)."""
    for key, source in sources.items():
        if key in written_from:
            continue
        fmt = source.fmt if isinstance(source, _Linear) else "its experts' formats"
        raise ValueError(
            f"{key.removesuffix('.weight')}: ModelOpt quantized it ({fmt}), but no tensor the "
            f"checkpoint writes is made from its weight {key!r} (the model's state names it "
            "otherwise, or leaves it out): its quantization config and its tensors would "
            "disagree. Export the model whose state_dict() holds the key, or export it with "
            "modelopt.torch.export.export_hf_checkpoint")


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
    ``quant_config``): a walk of every module in ModelOpt's Python (0.06-0.15 s for a 1 GiB
    Llama of 1056 quantizers, as much as 100-150 probes; the last rank probes less for it),
    the same on every rank, so asked of one; else None. ValueError as :func:`prepare`'s."""
    sources = _sources(model)
    if not sources:
        return None, None, None
    dtype = export_dtype(model)
    _ready(model, dtype, pre_quant)
    state = state_of()
    _keep_quantized_aliases(model, state, sources)
    held = _held(state)
    units = _units(model, sources, held, None)
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
# fixed part and a part a quantized module. Measured: a probe 0.5-0.6 ms, the config of a
# 1 GiB Llama of 294 quantized linears 0.064 s (~130 probes), of a Qwen3-MoE of 30 quantized
# modules (1940 weights: its experts' are fused) 0.027 s (~50 probes).
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


def _held(state: dict[str, Any]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def prepare(model: nn.Module, state: dict[str, Any], converts: bool | None = None,
            probes: dict[str, Probe] | None = None,
            quant_config: dict[str, Any] | None = None) -> Quantized | None:
    """For a model ModelOpt quantized: ``state`` rewritten in place as ModelOpt's export
    writes it (its quantizers' buffers dropped or renamed -- ``pre_quant_scale``, KV cache
    scales --, each quantized weight's global scales added as small tensors under their
    written keys) and the tensors computed in place of its weights (:class:`Quantized`);
    None for any other model (``state`` untouched). ValueError naming the module and the
    format where a weight is not written from the shards. Runs ModelOpt's own steps before
    it quantizes, in place (:func:`_ready`), as its export does -- unless ``probes`` (every
    rank's :func:`probe_share`, merged) are given: they ran there. A weight without a probe
    is probed here. ``quant_config``: ModelOpt's ``get_quant_config`` of the model where a
    rank asked it already (:func:`probe_share`), else asked here."""
    sources = _sources(model)
    if not sources:
        return None
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import _postprocess_single_tensor, get_quant_config

    dtype = export_dtype(model)
    if probes is None:
        _ready(model, dtype)
    _keep_quantized_aliases(model, state, sources)
    held = _held(state)
    out = Quantized()
    digest: list[tuple] = []
    extra: dict[str, torch.Tensor] = {}
    fasts: list[RowsFn | None] = []
    asked: dict[tuple, Probe] = {}
    for w, unit in _units(model, sources, held, converts):
        weight_dtype = held[w.parts[0].source][0]
        probe = None if probes is None else probes.get(w.key)
        if probe is None:
            probe = _probe_once(w, unit, weight_dtype, dtype, asked)
        fasts.append(_plan_unit(w, unit, weight_dtype, dtype, probe, out, extra, digest))
    keep_tables_for(fasts)
    if quant_config is None:
        quant_config = get_quant_config(model)
    kv_format = quant_config["quantization"].get("kv_cache_quant_algo")
    rewritten: dict[str, Any] = {}
    # Every rank computes the same tensors only from the same calibration results: their
    # digest is agreed in the metadata round.
    calibration = hashlib.blake2b(digest_size=16)
    for key, value in state.items():
        if key in sources:
            rewritten[key] = value  # the source of the computed tensors
            continue
        if "quantizer" in key and type(value) is torch.Tensor:
            calibration.update(key.encode("utf-8", "surrogatepass"))
            calibration.update(value.detach().cpu().contiguous().reshape(-1)
                               .view(torch.uint8).numpy().tobytes())
        new_key, new_value = _postprocess_single_tensor(key, value, _KV_CACHE_MAXBOUND, kv_format)
        if new_key is not None:
            rewritten[new_key] = new_value
    rewritten.update(extra)
    state.clear()
    state.update(rewritten)
    out.files["hf_quant_config.json"] = json.dumps(quant_config, indent=4)
    out.quantization_config = convert_hf_quant_config_format(quant_config)
    out.digest = (str(dtype), tuple(digest), calibration.hexdigest())
    return out


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


def _plan_unit(w: _keys.Written, unit: _Unit, weight_dtype: torch.dtype, dtype: torch.dtype,
               probe: Probe, out: Quantized, extra: dict[str, torch.Tensor],
               digest: list[tuple]) -> RowsFn | None:
    """One quantized weight, from its probe: its global outputs into ``extra``, its per-row
    ones into ``out.replaces``; the compiled core's rows of it (or None)."""
    outputs, per_row = probe
    shape = w.shape
    step = ROW_FORMATS[unit.fmt]
    total = shape[0]
    probe_rows = _probe_rows(step, total)
    # (a per-row output's dtype and shape for the probe's rows, as a tensor of no storage)
    one = {k: torch.empty(dims, dtype=dt, device="meta") if data is None else
           torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(dims)
           if data else torch.empty(dims, dtype=dt) for k, dt, dims, data in outputs}
    prefix = w.key.removesuffix("weight")
    what = f"{unit.name} ({unit.fmt})"
    token = next(_TOKENS)  # (this weight's rows, in the kept outputs' keys)
    # The compiled core's rows only for a unit quantized on the host: a GPU's are computed
    # there by ModelOpt's own arithmetic (the core's kernels are the host's).
    fast = fast_rows(unit.fmt, unit.weight_quantizer, weight_dtype, dtype, shape[1], one,
                     per_row, lambda rows, first: _export_rows(unit, rows, first, dtype),
                     lambda rows, first: _weight_scale_rows(unit, rows, first), total) \
        if device_of(unit).type == "cpu" else None
    for suffix, small in one.items():
        if suffix not in per_row:
            extra[prefix + suffix] = small
            digest.append((prefix + suffix, str(small.dtype), tuple(small.shape),
                           small.float().reshape(-1).tolist()))
            continue
        out_rows = small.shape[0] * step // probe_rows  # written rows per `step` weight rows
        written_shape = (total // step * out_rows, *small.shape[1:])
        fn = _RowsOf(unit, suffix, dtype, token, tuple(k for k in per_row if k != "weight"),
                     fast)
        transform = Transform(fn, step, out_rows, what, weight_dtype, tuple(shape))
        out.replaces.setdefault(w.key, []).append((prefix + suffix, small.dtype, written_shape,
                                                   transform))
        digest.append((prefix + suffix, str(small.dtype), written_shape))
    return fast


def apply(written: list[_keys.Written], quantized: Quantized) -> list[_keys.Written]:
    """The written tensors with each quantized weight replaced by the tensors computed from
    it (the weight and its per-row scales), in its place."""
    out = []
    for w in written:
        computed = quantized.replaces.get(w.key)
        if computed is None:
            out.append(w)
            continue
        out.extend(_keys.Written(key, dtype, shape, w.parts, None, t)
                   for key, dtype, shape, t in computed)
    return out


def config_text(text: str, model: nn.Module, quantized: Quantized) -> str:
    """``config.json`` as ModelOpt's export writes it: the text ``save_pretrained`` writes,
    through ModelOpt's own deployment fixes, with its ``quantization_config``."""
    from modelopt.torch.export.plugins import sanitize_hf_config_for_deployment

    data = json.loads(text)
    sanitize_hf_config_for_deployment(data, model)
    if quantized.quantization_config is not None:
        data["quantization_config"] = quantized.quantization_config
    return json.dumps(data, indent=4)
