"""A ModelOpt-quantized model written as ModelOpt's own ``export_hf_checkpoint`` writes it,
every quantized weight computed from the rows each rank holds.

ModelOpt's export of a quantized linear turns its weight into a quantized tensor and
registers its scales (``_export_quantized_weight``), then renames and drops its quantizers'
buffers (``postprocess_state_dict``). Every format it writes for a linear layer is computed
row by row (a per-tensor or per-channel scale from the calibrated amax; NVFP4's per-16 block
scales along a row; INT4 AWQ's per-group scales, rows packed in pairs), so each rank runs
ModelOpt's own function on a stand-in module that holds only its rows (the quantizers copied,
a per-row amax cut to those rows) and gets those rows of every output. Nothing is restated
here: which format a module has, its arithmetic, its scales and the JSON files are
ModelOpt's, byte for byte.

The written tensors of a quantized weight are either *global* (the same whatever the rows: a
per-tensor scale, ``weight_scale_2``, ``input_scale``), computed on every rank from its copy
of the (already global) calibration results and written as a small plain tensor, or *per
row* (the weight, per-channel and per-block scales): a :class:`plan.types.Transform` of the
in-memory weight's rows, computed by the rank that holds them where it writes them. Which is
which, and the written shapes, come from running ModelOpt's function on one and two row
blocks of ones.

ModelOpt is imported only where a model has its quantizers (it is then already imported).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from distributed_ext.export.plan.keys import Written
from distributed_ext.export.plan.types import Transform

# The formats written from the shards (ModelOpt's names), each with how many rows its
# arithmetic takes together (INT4 AWQ packs two rows in a byte). Every other format is refused
# by name: their blocks have not been checked against ModelOpt's export.
ROW_FORMATS = {"fp8": 1, "fp8_pc_pt": 1, "int8_wo": 1, "int8_sq": 1, "nvfp4": 1,
               "w4a16_nvfp4": 1, "int4_awq": 2}
# Formats whose layers ModelOpt's export first fuses (amax shared by the linears that read one
# input, AWQ's pre-quant scales averaged and folded into the norm before them):
# ``requantize_resmooth_fused_llm_layers`` does nothing for these.
_UNFUSED = {None, "fp8", "fp8_pb_real"}
_KV_CACHE_MAXBOUND = 448  # ModelOpt's KV cache scale: amax / 448 (FP8 and NVFP4 caches)
_QUANTIZERS = ("weight_quantizer", "input_quantizer", "output_quantizer")


@dataclass
class Quantized:
    """What a quantized model's export writes beyond its state: the computed tensors (written
    key -> (in-memory source key, dtype, global shape, transform)) and ModelOpt's JSON files."""

    computed: dict[str, tuple[str, torch.dtype, tuple[int, ...], Transform]] = field(
        default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # hf_quant_config.json
    quantization_config: dict[str, Any] | None = None  # config.json's
    digest: tuple = ()  # what every rank must agree on (formats, shapes, global scales)


def _modelopt_loaded() -> bool:
    return "modelopt.torch.quantization" in sys.modules


def quantized_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """The modules of ``model`` that ModelOpt quantized (an enabled weight quantizer):
    name -> (module, ModelOpt's format name). Empty where ModelOpt was never imported."""
    if not _modelopt_loaded():
        return {}
    from modelopt.torch.export.model_config import QUANTIZATION_NONE
    from modelopt.torch.export.quant_utils import get_quantization_format

    out = {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "weight_quantizer", None), nn.Module):
            continue
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        fmt = get_quantization_format(module)
        if fmt not in (None, QUANTIZATION_NONE):
            out[name] = (module, fmt)
    return out


def needs_fusion(model: nn.Module) -> bool:
    """Whether ModelOpt's export would first fuse the quantizers of layers that read one
    input (every format but FP8 per-tensor): see :func:`fuse_shared_inputs`."""
    formats = {fmt for _m, fmt in quantized_modules(model).values()}
    return bool(formats - _UNFUSED)


def fuse_shared_inputs(model: nn.Module) -> None:
    """ModelOpt's own ``requantize_resmooth_fused_llm_layers``, as its export runs it first:
    the linears that read one input get one input amax and one per-tensor weight amax (q, k,
    v; gate, up), and AWQ's pre-quant scales are averaged over them and folded into the norm
    before them (rescaling those weights). It changes the model in place, as ModelOpt's export
    does, and runs a forward of two tokens (collective under FSDP2: every rank calls it).
    Running it twice changes nothing more."""
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    requantize_resmooth_fused_llm_layers(model)


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


class _StandIn(nn.Module):
    """A quantized linear's weight rows and copies of its quantizers: what ModelOpt's
    ``_export_quantized_weight`` reads and registers its outputs on."""


def _slice_rows(t: torch.Tensor, first: int, n: int, total: int) -> torch.Tensor:
    """The rows ``first .. first + n`` (of ``total``) of a per-row (or per-row-block) buffer
    (an amax of ``total * k`` rows, row-major); a per-tensor one as it is."""
    if t.dim() == 0 or t.numel() == 1 or t.shape[0] % total:
        return t
    k = t.shape[0] // total
    return t[first * k : (first + n) * k]


def _stand_in(module: nn.Module, rows: torch.Tensor, first: int, total: int,
              repeat: int) -> _StandIn:
    """``rows`` (``repeat`` times over) and copies of ``module``'s quantizers, a per-row amax
    cut to those rows (and repeated alike)."""
    s = _StandIn()
    n = rows.shape[0]
    s.weight = nn.Parameter(rows.repeat(repeat, *(1,) * (rows.dim() - 1)) if repeat > 1
                            else rows, requires_grad=False)
    for attr in _QUANTIZERS:
        q = getattr(module, attr, None)
        if not isinstance(q, nn.Module):
            continue
        q = copy.deepcopy(q)
        if attr == "weight_quantizer":
            for name, buf in list(q.named_buffers(recurse=False)):
                if isinstance(buf, torch.Tensor) and buf.dim() > 0:
                    cut = _slice_rows(buf, first, n, total)
                    setattr(q, name, torch.cat([cut] * repeat) if cut is not buf and repeat > 1
                            else cut)
            # (the shape ModelOpt gives a per-block amax when exporting it: the weight's rows)
            shape = getattr(q, "_amax_shape_for_export", None)
            if shape is not None and len(shape) and shape[0] == total:
                q._amax_shape_for_export = (n * repeat, *tuple(shape)[1:])
        setattr(s, attr, q)
    return s


def _export_rows(module: nn.Module, rows: torch.Tensor, first: int, total: int,
                 dtype: torch.dtype, step: int) -> dict[str, torch.Tensor]:
    """ModelOpt's export of the rows ``first ..`` of ``module``'s weight: the quantized rows
    and the scales it registers (names as ModelOpt writes them under the module). One block
    of ``step`` rows alone is computed twice over and halved: ModelOpt's arithmetic squeezes
    a per-row scale of one row to a scalar."""
    from modelopt.torch.export.quant_utils import quantizer_attr_names
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    repeat = 2 if rows.shape[0] <= step else 1
    s = _stand_in(module, rows, first, total, repeat)
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


def prepare(model: nn.Module, state: dict[str, Any]) -> Quantized | None:
    """For a model ModelOpt quantized: ``state`` rewritten in place as ModelOpt's export
    writes it (its quantizers' buffers dropped or renamed -- ``pre_quant_scale``, KV cache
    scales --, each quantized weight's global scales added as small tensors) and the
    computed tensors (:class:`Quantized`); None for any other model (``state`` untouched).
    ValueError naming the module and the format where a format is not written from the
    shards."""
    modules = quantized_modules(model)
    if not modules:
        return None
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import _postprocess_single_tensor, get_quant_config

    for name, (_m, fmt) in modules.items():
        if fmt not in ROW_FORMATS:
            raise ValueError(
                f"{name}: ModelOpt quantized it as {fmt!r}, which export_hf_checkpoint does not "
                f"write from the shards (it writes {', '.join(sorted(ROW_FORMATS))}); export "
                "it with modelopt.torch.export.export_hf_checkpoint instead")
    dtype = export_dtype(model)
    quant_config = get_quant_config(model)
    kv_format = quant_config["quantization"].get("kv_cache_quant_algo")
    weights = {f"{name}.weight" if name else "weight": name for name in modules}
    out = Quantized()
    digest: list[tuple] = []
    rewritten: dict[str, Any] = {}
    for key, value in state.items():
        name = weights.get(key)
        if name is not None:
            module, fmt = modules[name]
            rewritten[key] = value  # the source of the computed tensors
            _plan_module(name, module, fmt, key, value, dtype, out, rewritten, digest)
            continue
        new_key, new_value = _postprocess_single_tensor(key, value, _KV_CACHE_MAXBOUND, kv_format)
        if new_key is not None:
            rewritten[new_key] = new_value
    state.clear()
    state.update(rewritten)
    out.files["hf_quant_config.json"] = json.dumps(quant_config, indent=4)
    out.quantization_config = convert_hf_quant_config_format(quant_config)
    out.digest = (str(dtype), tuple(digest))
    return out


def _plan_module(name: str, module: nn.Module, fmt: str, key: str, weight: Any,
                 dtype: torch.dtype, out: Quantized, state: dict[str, Any],
                 digest: list[tuple]) -> None:
    """One quantized linear: its global outputs into ``state``, its per-row ones into
    ``out.computed``. Which is which: ModelOpt's export of ``step`` and ``2 * step`` rows of
    ones (a per-row output grows with them)."""
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise ValueError(f"{name}: a quantized weight of shape {list(shape)}; export_hf_checkpoint "
                         "writes quantized 2-D linear weights from the shards (fused 3-D experts "
                         "not yet); export it with modelopt.torch.export.export_hf_checkpoint")
    step = ROW_FORMATS[fmt]
    total = shape[0]
    if total % step:
        raise ValueError(f"{name}: {fmt} takes {step} rows together, but its weight has "
                         f"{total} rows")
    prefix = f"{name}." if name else ""
    probe = 2 * step if 4 * step <= total else total

    def ones(n: int) -> dict[str, torch.Tensor]:
        return _export_rows(module, torch.ones((n, shape[1]), dtype=weight.dtype), 0, total,
                            dtype, step)

    one = ones(probe)
    # (a weight of under four blocks: every output with rows is computed from the rows)
    two = one if probe == total else ones(2 * probe)
    what = f"{name} ({fmt})"
    for suffix, small in one.items():
        big = two[suffix]
        per_row = suffix == "weight" or (small.dim() > 0 and (
            big.shape != small.shape or two is one))
        if not per_row:
            state[prefix + suffix] = small.contiguous()
            digest.append((prefix + suffix, str(small.dtype), tuple(small.shape),
                           small.float().reshape(-1).tolist()))
            continue
        out_rows = small.shape[0] * step // probe  # written rows per `step` in-memory rows
        rows = total // step * out_rows
        written_shape = (rows, *small.shape[1:])
        fn = _RowsOf(module, suffix, total, dtype, step)
        out.computed[prefix + suffix] = (key, small.dtype, written_shape,
                                         Transform(fn, step, out_rows, what))
        digest.append((prefix + suffix, str(small.dtype), written_shape))


class _RowsOf:
    """One output of ModelOpt's export of a module's weight, for the rows a rank holds."""

    def __init__(self, module: nn.Module, suffix: str, total: int, dtype: torch.dtype,
                 step: int) -> None:
        self.module, self.suffix, self.total, self.dtype, self.step = (module, suffix, total,
                                                                       dtype, step)

    def __call__(self, rows: torch.Tensor, first: int) -> torch.Tensor:
        return _export_rows(self.module, rows, first, self.total, self.dtype,
                            self.step)[self.suffix]


def apply(written: list[Written], quantized: Quantized) -> list[Written]:
    """The written tensors with each quantized weight replaced by the tensors computed from
    it (the weight and its per-row scales, each beside its source's place)."""
    by_source: dict[str, list[str]] = {}
    for key, (source, *_rest) in quantized.computed.items():
        by_source.setdefault(source, []).append(key)
    out = []
    for w in written:
        keys = by_source.get(w.parts[0].source) if len(w.parts) == 1 else None
        if not keys:
            if any(p.source in by_source for p in w.parts):
                # (a quantized weight that transformers writes converted: refused by the plan)
                key = next(k for p in w.parts for k in by_source.get(p.source, ()))
                _s, dtype, shape, t = quantized.computed[key]
                out.append(Written(w.key, dtype, shape, w.parts, None, t))
                continue
            out.append(w)
            continue
        for key in keys:
            _source, dtype, shape, t = quantized.computed[key]
            out.append(Written(key if w.key == _source else w.key + key[len(_source):],
                               dtype, shape, w.parts, None, t))
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
