"""The quantizers of a ModelOpt-quantized model's layers that read one input, fused as
ModelOpt's export fuses them before it quantizes -- without reading a weight where the fusing
changes no weight.

ModelOpt's ``requantize_resmooth_fused_llm_layers`` finds the linears that take one input
tensor (q, k, v; gate, up) with a forward of the model, which under FSDP2 gathers every
layer's weights, then gives each group one input amax and one per-tensor weight amax
(``preprocess_linear_fusion``). Here the groups come from a forward of a weightless replica
and ModelOpt's own ``preprocess_linear_fusion`` runs on each; where fusing rescales weights
(pre-quant scales: AWQ, SmoothQuant) ModelOpt's own function runs instead, on every rank.
"""

from __future__ import annotations

import copy
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
    scales -- AWQ's, SmoothQuant's -- averaged over the layers that read one input): ModelOpt's own
    ``requantize_resmooth_fused_llm_layers`` does that, gathering each such group's weights
    and running a forward (collective under FSDP2: see :func:`fuse_shared_inputs`)."""
    if not modelopt_loaded():
        return False
    # (ModelOpt's condition: preprocess_linear_fusion rescales where there is such a scale)
    return any(getattr(getattr(m, "input_quantizer", None), "pre_quant_scale", None) is not None
               for m in model.modules() if isinstance(getattr(m, "weight_quantizer", None),
                                                      nn.Module))


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
    import re

    from modelopt.torch.export.quant_utils import get_quantization_format, preprocess_linear_fusion

    names = {name: m for name, m in model.named_modules()
             if isinstance(getattr(m, "weight_quantizer", None), nn.Module)
             and not isinstance(m.weight_quantizer, nn.ModuleList)
             and isinstance(getattr(m, "weight", None), torch.Tensor)
             and (_enabled(m.weight_quantizer) or _enabled(getattr(m, "input_quantizer", None)))}
    fused: dict[str, list[str]] = {}
    for group in _shared_input_groups(model, set(names)):
        modules = [names[n] for n in group]
        if len(modules) > 1 and get_quantization_format(modules[0]) not in (
                *_UNFUSED, "none", None):
            preprocess_linear_fusion(modules)
            fused[group[0]] = group
    # As ModelOpt: experts the forward did not reach are fused by their names' pattern.
    expert = re.compile(r"(experts?\.)\d+")
    for first, group in fused.items():
        if not expert.search(first):
            continue
        index = 0
        while True:
            renamed = [expert.sub(rf"\g<1>{index}", n, count=1) for n in group]
            if renamed[0] not in fused and renamed[0] not in names:
                break
            if renamed[0] not in fused and all(n in names for n in renamed):
                preprocess_linear_fusion([names[n] for n in renamed])
            index += 1


def _enabled(quantizer: Any) -> bool:
    return quantizer is not None and bool(getattr(quantizer, "is_enabled", False))


def _shared_input_groups(model: nn.Module, linears: set[str]) -> list[list[str]]:
    """The names of ``linears`` grouped by the input tensor they take in a forward of two
    tokens of a weightless replica of ``model`` (see :func:`fuse_shared_inputs`), in the
    order the forward reaches them."""
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
    ids = torch.ones((1, 2), dtype=torch.long)
    with torch.no_grad():
        replica(ids, use_cache=False)
    return list(seen.values())


def sync_amax(model: nn.Module, dtype: torch.dtype) -> None:
    """ModelOpt's export's other steps before it quantizes: missing expert input amax filled,
    gate/up amax of separate experts shared, tied modules' input amax merged (in place, on
    each rank's copy of the calibration results; no collective)."""
    from modelopt.torch.export.layer_utils import sync_moe_gate_up_amax
    from modelopt.torch.export.model_utils import TiedWeightMap
    from modelopt.torch.export.quant_utils import sync_tied_input_amax
    from modelopt.torch.export.unified_export_hf import _prepare_moe_inputs

    _prepare_moe_inputs(model, dtype, False)
    sync_moe_gate_up_amax(model)
    sync_tied_input_amax(model, TiedWeightMap(model))
