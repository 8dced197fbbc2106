"""The quantizers of a ModelOpt-quantized model's layers that read one input, fused as
ModelOpt's export fuses them before it quantizes -- without reading a weight where the fusing
changes no weight, and from each rank's rows where it does (:class:`Resmooth`).

ModelOpt's ``requantize_resmooth_fused_llm_layers`` finds the linears that take one input
tensor (q, k, v; gate, up) with a forward of the model, which under FSDP2 gathers every
layer's weights, then gives each group one input amax and one per-tensor weight amax
(``preprocess_linear_fusion``). Here the groups come from a forward of a weightless replica
and ModelOpt's own ``preprocess_linear_fusion`` runs on each; where fusing rescales weights
(pre-quant scales: AWQ, SmoothQuant) it runs on stand-ins holding each rank's rows
(:class:`Resmooth`), or, where a step is not by row, ModelOpt's own function runs instead,
on every rank.
"""

from __future__ import annotations

import copy
import re
import sys
from typing import Any

import torch
import torch.nn as nn

# Formats whose shared-input layers ModelOpt's ``requantize_resmooth_fused_llm_layers``
# leaves as they are.
_UNFUSED = {"fp8", "fp8_pb_real"}


def modelopt_loaded() -> bool:
    """Whether ModelOpt's quantization was imported (a model can only then have its
    quantizers): nothing here imports it otherwise."""
    return "modelopt.torch.quantization" in sys.modules


def _model_format(model: nn.Module) -> str | None:
    from modelopt.torch.export.quant_utils import get_quantization_format

    fmt = get_quantization_format(model)
    return None if fmt in (None, "none") else fmt


def needs_gather(model: nn.Module) -> bool:
    """Whether ModelOpt's fusing of this model's shared-input layers rescales weights (pre-quant
    scales -- AWQ's, SmoothQuant's -- averaged over the layers that read one input): done from
    each rank's rows by :class:`Resmooth` where it can, else by ModelOpt's own
    ``requantize_resmooth_fused_llm_layers`` (gathering each such group's weights and running
    a forward: collective under FSDP2; see :func:`fuse_shared_inputs`)."""
    if not modelopt_loaded():
        return False
    # (ModelOpt's condition: preprocess_linear_fusion rescales where there is such a scale.
    # Its quantizers are submodules: looked up in each module's table, not by getattr, which
    # on a module without one raises inside torch and ModelOpt's __getattr__: 4x the walk.)
    return any(getattr(m._modules.get("input_quantizer"), "pre_quant_scale", None) is not None
               for m in model.modules()
               if isinstance(m._modules.get("weight_quantizer"), nn.Module))


def fuse_shared_inputs(model: nn.Module) -> None:
    """As ModelOpt's export does first: the quantizers of linears that read one input (q, k, v;
    gate, up) get one input amax and one per-tensor weight amax (ModelOpt's own
    ``preprocess_linear_fusion`` on each group), in place.

    ModelOpt finds those groups with a forward of the model, which under FSDP2 gathers every
    layer's weights; here the forward runs on a weightless replica instead (the model's class
    from its config, every parameter one element broadcast to its shape, every linear
    answering zeros), so it reads no weight and runs on this rank alone. A model with
    pre-quant scales (AWQ, SmoothQuant), whose fusing rescales the weights themselves, runs
    ModelOpt's own function instead (:func:`needs_gather`)."""
    fmt = _model_format(model)
    if fmt is None or fmt in _UNFUSED:
        return  # (ModelOpt's fusing leaves these as they are)
    if needs_gather(model):
        from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

        requantize_resmooth_fused_llm_layers(model)
        return
    from modelopt.torch.export.quant_utils import get_quantization_format, preprocess_linear_fusion

    names = _quantized_linears(model)
    fused: dict[str, list[str]] = {}
    for group, _norm in _shared_input_groups(model, set(names)):
        modules = [names[n] for n in group]
        if len(modules) > 1 and get_quantization_format(modules[0]) not in (
                *_UNFUSED, "none", None):
            _fuse_group(preprocess_linear_fusion, group, modules)
            fused[group[0]] = group
    # As ModelOpt: experts the forward did not reach are fused by their names' pattern.
    expert = _EXPERT
    for first, group in fused.items():
        if not expert.search(first):
            continue
        index = 0
        while True:
            renamed = [expert.sub(rf"\g<1>{index}", n, count=1) for n in group]
            if renamed[0] not in fused and renamed[0] not in names:
                break
            if renamed[0] not in fused and all(n in names for n in renamed):
                _fuse_group(preprocess_linear_fusion, renamed, [names[n] for n in renamed])
            index += 1


def _fuse_group(fuse: Any, group: list[str], modules: list[nn.Module]) -> None:
    """ModelOpt's ``preprocess_linear_fusion`` of one group of linears that read one input;
    its refusals (asserts that name no module) as a ValueError naming the group and the fix."""
    try:
        fuse(modules)
    except (AssertionError, NotImplementedError) as exc:
        raise ValueError(
            f"{', '.join(group)}: these linears read one input, so ModelOpt's export gives "
            f"them one input scale, and it refuses them: {exc or type(exc).__name__}. Quantize "
            "them alike (one format, a per-tensor input quantizer), e.g. with one quant_cfg "
            "entry for the whole layer") from exc


class Resmooth:
    """ModelOpt's fusing of the layers that read one input where they carry pre-quant scales
    (INT4 AWQ, INT8 SmoothQuant), done from the rows each rank holds: no weight gathered.

    ModelOpt's ``requantize_resmooth_fused_llm_layers`` gives each group (q, k, v; gate, up)
    the mean of its pre-quant scales, rescales each weight's columns to it
    (``_update_pre_quant_scale``: elementwise, in float32), calibrates the weight quantizer
    on the new weight again, unifies the input amax, and for AWQ folds the scale into the
    layernorm before the group (``fuse_prequant_layernorm``); under FSDP2 it gathers each
    group's weights and layernorm to do so. Every step but the layernorm's is row by row and
    the calibration's amax is per row (group) or a maximum, so here ModelOpt's own
    ``preprocess_linear_fusion`` runs on stand-ins that hold a rank's rows (and copies of
    the quantizers), in two passes:

    1. :meth:`pieces` (changes nothing): each weight quantizer's amax over this rank's new
       rows, and this rank's part of each layernorm (a vector of the hidden size), to be
       gathered by every rank (``collectives.all_reduce``, failures agreed).
    2. :meth:`apply` (every rank, once every rank's pieces arrived): the same computation
       again, its rows copied into the rank's shard in place, each quantizer given the
       amax of all rows; each layernorm, whole from the pieces, folded by ModelOpt's own
       ``fuse_prequant_layernorm`` and its rows copied back.

    Where a step is not row by row or a layout not whole rows -- a MoE (ModelOpt averages over
    experts), NVFP4-AWQ or SVDQuant, a sequential quantizer, a shard holding part of a row
    (TP), an empty shard -- :meth:`pieces` answers None and ModelOpt's own function runs
    instead (gathering). Peak memory, per rank: one group's new rows in the weight's dtype
    plus one weight's rows in float32 (ModelOpt's arithmetic), beside every rank's amax
    pieces once gathered (host memory; together as large as those layers' amax buffers,
    which every rank holds already: 4 bytes per 128 weights at INT4 AWQ's groups, 1/64 of a
    bf16 weight's bytes) and its norms' (a vector of the hidden size each)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.groups: list[tuple[list[str], list[nn.Module], str | None]] = []

    def pieces(self) -> dict[str, dict] | None:
        """Pass 1 on this rank: ``{"amax": {linear: (first row, stop, amax)}, "norms":
        {layernorm: (first, stop, weight, bias)}}``, or None where ModelOpt's own function must
        run. The model is left as it was."""
        from modelopt.torch.export.layer_utils import is_moe
        from modelopt.torch.export.quant_utils import get_quantization_format
        from modelopt.torch.quantization.nn import SequentialQuantizer

        fmt = _model_format(self.model)
        if fmt is None or "nvfp4_awq" in fmt or "svdquant" in fmt \
                or any(is_moe(m) for m in self.model.modules()):
            return None
        names = _quantized_linears(self.model)
        if any(isinstance(m.weight_quantizer, SequentialQuantizer) for m in names.values()):
            return None
        modules_of = dict(self.model.named_modules())
        out: dict[str, dict] = {"amax": {}, "norms": {}}
        self.groups = []
        for group, norm in _shared_input_groups(self.model, set(names)):
            modules = [names[n] for n in group]
            group_fmt = get_quantization_format(modules[0])
            if len(modules) < 2 or group_fmt in (*_UNFUSED, "none", None):
                continue
            if _EXPERT.search(group[0]):
                return None  # (ModelOpt also fuses experts the forward missed, by name)
            norm = norm if "awq" in group_fmt else None
            stands = self._stand_ins(group, modules)
            if stands is None:
                return None  # (a shard of columns, strided rows, or none)
            for stand, name, (rows, first) in stands:
                amax = getattr(stand.weight_quantizer, "_amax", None)
                real = getattr(names[name].weight_quantizer, "_amax", None)
                total, count = names[name].weight.shape[0], rows.shape[0]
                if stand.weight.data_ptr() == rows.data_ptr():
                    # (its scale was the group's mean already: not calibrated again, its
                    # amax is the model's, or the group's maximum of them: all rows')
                    first, count = 0, total
                if not _amax_by_rows(amax, real, count, total):
                    return None
                out["amax"][name] = (first, first + count, _to_host(amax))
            if norm is not None:
                held = _rows_held(modules_of[norm].weight)
                bias = getattr(modules_of[norm], "bias", None)
                held_bias = _rows_held(bias) if isinstance(bias, torch.Tensor) else None
                if held is None or (isinstance(bias, torch.Tensor) and held_bias is None):
                    return None
                out["norms"][norm] = (held[1], held[1] + held[0].shape[0], _to_host(held[0]),
                                      None if held_bias is None else _to_host(held_bias[0]))
            self.groups.append((group, modules, norm))
        return out

    def _stand_ins(self, group: list[str], modules: list[nn.Module]
                   ) -> list[tuple[nn.Module, str, tuple[torch.Tensor, int]]] | None:
        """ModelOpt's ``preprocess_linear_fusion`` run on stand-ins of a group's linears
        that hold this rank's rows and copies of their quantizers: (stand-in, name, (the
        rank's rows in its shard, their first row's global index)) for each; None where a
        weight's shard here is not a run of whole rows, or holds none."""
        from modelopt.torch.export.quant_utils import preprocess_linear_fusion

        held = [_rows_held(m.weight) for m in modules]
        if any(h is None or h[0].shape[0] == 0 for h in held):
            return None
        stands = []
        for m, (rows, _first) in zip(modules, held):  # type: ignore[misc]
            s = nn.Module()
            s.weight = nn.Parameter(rows.detach(), requires_grad=False)  # (replaced, not changed)
            s.weight_quantizer = _detached(m.weight_quantizer)
            s.input_quantizer = _detached(m.input_quantizer)
            stands.append(s)
        preprocess_linear_fusion(stands)
        return list(zip(stands, group, held))  # type: ignore[arg-type]

    def apply(self, every: list[dict[str, dict]]) -> None:
        """Pass 2, on every rank, with every rank's :meth:`pieces` (in rank order): the
        model's shards and quantizers changed in place as ModelOpt's function changes them."""
        from modelopt.torch.export.quant_utils import fuse_prequant_layernorm

        modules_of = dict(self.model.named_modules())
        for group, modules, norm in self.groups:
            stands = self._stand_ins(group, modules)
            assert stands is not None  # (pass 1 found every shard whole rows)
            for stand, name, (rows, _first) in stands:
                real = modules_of[name]
                if stand.weight.data_ptr() != rows.data_ptr():  # (calibrated again)
                    with torch.no_grad():
                        rows.copy_(stand.weight)
                iq, siq = real.input_quantizer, stand.input_quantizer
                if getattr(siq, "_pre_quant_scale", None) is not None:
                    iq.pre_quant_scale = siq._pre_quant_scale
                if getattr(siq, "_amax", None) is not None:
                    iq.amax = siq._amax
                amax = _assemble_amax(name, [p["amax"][name] for p in every])
                if amax is not None:
                    real.weight_quantizer.amax = amax.to(real.weight.device)
            if norm is None:
                continue
            layernorm = modules_of[norm]
            parts = [p["norms"][norm] for p in every]
            stand_norm = copy.copy(layernorm)
            stand_norm._parameters = dict(layernorm._parameters)
            whole = _assemble_rows(norm, [(a, b, w) for a, b, w, _ in parts])
            stand_norm._parameters["weight"] = nn.Parameter(whole, requires_grad=False)
            if parts[0][3] is not None:
                stand_norm._parameters["bias"] = nn.Parameter(
                    _assemble_rows(norm, [(a, b, t) for a, b, _, t in parts]),
                    requires_grad=False)
            fuse_prequant_layernorm(stand_norm, modules)  # (the real linears' scales dropped)
            for attr in ("weight", "bias"):
                value = getattr(layernorm, attr, None)
                if not isinstance(value, torch.Tensor):
                    continue
                rows, first = _rows_held(value)  # type: ignore[misc]
                with torch.no_grad():
                    rows.copy_(getattr(stand_norm, attr)[first : first + rows.shape[0]])


def fuse_pre_quant_scales_alone(model: nn.Module) -> None:
    """In one process (no group): the pre-quant scales' fusing by :class:`Resmooth` from the
    model's (whole) rows, else by ModelOpt's own function."""
    resmooth = Resmooth(model)
    pieces = resmooth.pieces()
    if pieces is not None:
        resmooth.apply([pieces])
    else:
        fuse_shared_inputs(model)


_EXPERT = re.compile(r"(experts?\.)\d+")  # (ModelOpt's pattern of an expert's name)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy in host memory (what the ranks exchange: a GPU tensor would be unpickled onto
    the sender's device number)."""
    return None if t is None else t.detach().to("cpu", copy=True)


def _rows_held(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A tensor's rows on this rank as one run of whole rows of the global tensor: (the
    local tensor, the global index of its first row) -- the tensor itself and 0 where it is
    not a DTensor; None where its shard is not such a run (a shard of columns, strided
    rows)."""
    from distributed_ext._dtensor import dtensor_type
    from distributed_ext.export.plan.entries import (
        _dtensor_blocks,
        _local,
        _my_global_rank,
        dtensor_signature,
    )

    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return t.detach(), 0
    try:
        sig = dtensor_signature("weight", t)
    except ValueError:
        return None
    assert sig.placements is not None
    if any(c[0] == "SS" or (c[0] == "S" and c[1] != 0) for c in sig.placements):
        return None
    local_shape, boxes = _dtensor_blocks(sig)[_my_global_rank()]
    local = _local(t).detach()
    if len(boxes) != 1 or tuple(local.shape) != tuple(local_shape):
        return None
    return local, boxes[0][0][0] if t.dim() else 0


def _amax_by_rows(amax: torch.Tensor | None, real: torch.Tensor | None, rows: int,
                  total: int) -> bool:
    """Whether a weight quantizer's amax from ``rows`` of ``total`` rows is a part of the
    amax of all of them: per row (or per row and group: ``k`` entries a row, row-major), or
    one maximum (then the amax of all rows is the maximum of the ranks')."""
    if amax is None or real is None:
        return amax is None and real is None
    if amax.numel() == 1 and real.numel() == 1:
        return True
    return (amax.dim() > 0 and real.dim() > 0 and real.shape[0] % total == 0
            and amax.shape[0] == real.shape[0] // total * rows
            and amax.shape[1:] == real.shape[1:])


def _assemble_amax(name: str, parts: list[tuple[int, int, torch.Tensor | None]]
                   ) -> torch.Tensor | None:
    """A weight quantizer's amax over all rows from the ranks' parts (:func:`_amax_by_rows`)."""
    if parts[0][2] is None:
        return None
    if parts[0][2].numel() == 1 and all(t.numel() == 1 for _a, _b, t in parts):  # type: ignore
        return torch.stack([t.reshape(()) for _a, _b, t in parts]).amax().reshape(
            parts[0][2].shape)  # type: ignore[union-attr]
    return _assemble_rows(name, parts)  # type: ignore[arg-type]


def _assemble_rows(name: str, parts: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """Rows ``first .. stop`` of each part (``k`` entries a row: a part's length over its
    rows) placed into one tensor of every row; replicated parts are the same rows again.
    RuntimeError where the parts leave a row out (the ranks' layouts do not cover the
    tensor)."""
    total = max(b for _a, b, _t in parts)
    k = next((t.shape[0] // (b - a) for a, b, t in parts if b > a), 1)
    sample = parts[0][2]
    out = sample.new_empty((total * k, *sample.shape[1:]))
    covered = torch.zeros(total, dtype=torch.bool)
    for a, b, t in parts:
        out[a * k : b * k] = t
        covered[a:b] = True
    if not bool(covered.all()):
        raise RuntimeError(f"{name}: the ranks' rows do not cover it "
                           f"({[(a, b) for a, b, _t in parts]} of {total})")
    return out


# What a ModelOpt quantizer keeps of the shape it first quantized in blocks (it refuses
# another shape after): the stand-ins' copies forget it, as they hold a rank's rows.
_BLOCK_SETUP = ("_original_shape", "_block_reshape_size", "_padding", "_slices",
                "_amax_shape_for_export")


def copy_quantizer(quantizer: nn.Module) -> nn.Module:
    """A copy of a quantizer that ModelOpt's export may change (set, convert or delete its
    buffers and attributes) without changing the model's: its own attribute and buffer
    tables over the same tensors (a deep copy costs a millisecond a call, and a call is made
    per 1 MiB of rows); a quantizer with submodules is copied deeply."""
    if quantizer._modules:
        out = copy.deepcopy(quantizer)
        for module in out.modules():
            module._buffers = {k: _replicated_local(v) for k, v in module._buffers.items()}
        return out
    out = copy.copy(quantizer)
    out._buffers = {k: _replicated_local(v) for k, v in quantizer._buffers.items()}
    out._parameters = dict(quantizer._parameters)
    return out


def _replicated_local(value: Any) -> Any:
    """A buffer as ModelOpt's arithmetic on a rank's rows takes it: a replicated DTensor (what
    torch's ``distribute_module`` makes of a quantizer's amax under ``parallelize_module``)
    as its local tensor, the whole of it; anything else as it is."""
    placements = getattr(value, "placements", None)
    if placements is not None and hasattr(value, "to_local") and all(
            p.is_replicate() for p in placements):
        return value.to_local()
    return value


def _detached(quantizer: nn.Module) -> nn.Module:
    """A copy of a quantizer that ModelOpt's fusing may change (its buffers set in place,
    its calibrator run) without changing the model's: :func:`copy_quantizer` with buffers
    and calibrator of its own, and no block setup (:data:`_BLOCK_SETUP`) for the shape of
    the model's weight."""
    out = copy_quantizer(quantizer)
    if not quantizer._modules:  # (a deep copy has its own already)
        out._buffers = {k: None if v is None else v.clone() for k, v in out._buffers.items()}
        calibrator = getattr(quantizer, "_calibrator", None)
        if calibrator is not None:
            out._calibrator = copy.deepcopy(calibrator)
    for attr in _BLOCK_SETUP:
        out.__dict__.pop(attr, None)
    return out


def _enabled(quantizer: Any) -> bool:
    return quantizer is not None and bool(getattr(quantizer, "is_enabled", False))


def _quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linears ModelOpt's fusing looks at (a weight, a quantizer enabled), by name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "weight_quantizer", None), nn.Module)
            and not isinstance(m.weight_quantizer, nn.ModuleList)
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and (_enabled(m.weight_quantizer) or _enabled(getattr(m, "input_quantizer", None)))}


def _shared_input_groups(model: nn.Module, linears: set[str]
                         ) -> list[tuple[list[str], str | None]]:
    """The names of ``linears`` grouped by the input tensor they take in a forward of two
    tokens of a weightless replica of ``model`` (see :func:`fuse_shared_inputs`), in the
    order the forward reaches them; each with the name of the layernorm whose output that
    input is (ModelOpt's ``is_layernorm``), if it is one."""
    from modelopt.torch.export.layer_utils import is_layernorm

    cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    with torch.device("meta"):
        replica = cls(copy.deepcopy(model.config))
    for module in replica.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    # (buffers computed at construction, e.g. rotary frequencies: the real model's values)
    real_buffers = dict(model.named_buffers())
    for name, b in replica.named_buffers():
        got = real_buffers.get(name)
        if type(got) is torch.Tensor and got.shape == b.shape and got.dtype == b.dtype:
            b.copy_(got.detach())
    seen: dict[int, list[str]] = {}
    keep: list[torch.Tensor] = []  # (inputs alive until the end: their ids stay theirs)

    def answer(name: str, module: nn.Linear) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if name in linears:
                keep.append(x)
                seen.setdefault(id(x), []).append(name)
            return x.new_zeros((*x.shape[:-1], module.out_features))
        return forward

    # Every linear answers zeros (a product with a broadcast weight would make it whole:
    # lm_head's alone is vocabulary x hidden); the quantized ones note their input.
    for name, module in replica.named_modules():
        if isinstance(module, nn.Linear):
            module.forward = answer(name, module)
    made_by: dict[int, str] = {}  # id of a layernorm's output -> the layernorm

    def note(name: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                keep.append(output)
                made_by[id(output)] = name
        return hook

    for name, module in replica.named_modules():
        if is_layernorm(module):
            module.register_forward_hook(note(name))
    ids = torch.ones((1, 2), dtype=torch.long)
    with torch.no_grad():
        replica(ids, use_cache=False)
    return [(group, made_by.get(i)) for i, group in seen.items()]


def sync_amax(model: nn.Module, dtype: torch.dtype) -> None:
    """ModelOpt's export's other steps before it quantizes: missing expert input amax filled,
    gate/up amax of separate experts shared, tied modules' input amax merged (in place, on
    each rank's copy of the calibration results; no collective)."""
    from modelopt.torch.export.layer_utils import is_moe, sync_moe_gate_up_amax
    from modelopt.torch.export.model_utils import TiedWeightMap
    from modelopt.torch.export.quant_utils import sync_tied_input_amax
    from modelopt.torch.export.unified_export_hf import _prepare_moe_inputs

    # ModelOpt's two MoE steps act only on the modules its `is_moe` names that have experts,
    # and each walks every module to find them (on every rank): one walk here (the cheaper
    # test first), and none of theirs where there is none.
    if any(hasattr(m, "experts") and is_moe(m) for m in model.modules()):
        _prepare_moe_inputs(model, dtype, False)
        sync_moe_gate_up_amax(model)
    tied = TiedWeightMap(model)
    # ModelOpt merges the input amax of modules that share a weight, declared tied (its
    # map) or the same parameter object; with neither it changes nothing, and its walk of
    # every module is paid by every rank on every call.
    if tied.alias_to_canonical or _shares_a_parameter(model):
        sync_tied_input_amax(model, tied)


def _shares_a_parameter(model: nn.Module) -> bool:
    """Whether some parameter object is registered under two names (a weight two modules
    share, declared or not)."""
    seen: set[int] = set()
    for _name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            return True
        seen.add(id(p))
    return False
