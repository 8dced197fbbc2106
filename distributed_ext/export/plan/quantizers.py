"""Finding a ModelOpt-quantized model's quantized weights and their formats: the quantized
linears and fused experts (under the keys the checkpoint writes: a wrapper's attribute
dropped, a tie resolved as ModelOpt's export resolves it), how ModelOpt exports each written
weight (:class:`_Unit`), and the checks that refuse, before any byte moves, what is not
written from the shards -- naming the module, its format and what to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan.remembered import LastAnswer
from distributed_ext.export.plan.shared_inputs import modelopt_loaded
from distributed_ext.export.plan.wrappers import drop_wrapper_parts, wrapper_paths

# The formats written from the shards (ModelOpt's names), each with how many rows its
# arithmetic takes together (INT4 AWQ packs two rows in a byte). Any other format is refused
# by name: its blocks have not been checked against ModelOpt's export.
ROW_FORMATS = {"fp8": 1, "fp8_pc_pt": 1, "int8_wo": 1, "int8_sq": 1, "nvfp4": 1,
               "w4a16_nvfp4": 1, "int4_awq": 2}

# The last model's quantized weights, and its units for the held keys (an export asks twice:
# its probes, its plan); forgotten at the start of each export (:func:`forget`).
_SOURCES = LastAnswer()
_UNITS = LastAnswer()

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
        # answer a missing attribute slowly in Python, and most modules have no quantizer
        # (such misses were half of this walk).
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

def _held(state: dict[str, Any]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()
            if isinstance(v, torch.Tensor)}

def held_units(model: nn.Module, state: dict[str, Any], sources: dict[str, Any],
               converts: bool | None) -> tuple[dict[str, tuple], list[tuple[_keys.Written, _Unit]]]:
    """The keys ``state`` holds (a quantized tied alias put back first:
    :func:`_keep_quantized_aliases`) and each written quantized weight's unit
    (:func:`_units`): what the probes and the plan both start from."""
    _keep_quantized_aliases(model, state, sources)
    held = _held(state)
    return held, _units(model, sources, held, converts)


def forget() -> None:
    """Drops the quantized weights and units an earlier export remembered."""
    _SOURCES.forget()
    _UNITS.forget()
