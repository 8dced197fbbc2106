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

The steps, one module each: :mod:`plan.quantizers` (the quantized weights and their
formats, and the refusals), :mod:`plan.probes` (what ModelOpt writes for each, probed on a
few rows), :mod:`plan.quant_rows` (the rows computed where they live); here, the plan that
puts them together (:func:`prepare`, :func:`apply`) and the JSON files.

ModelOpt is imported only for a model that has its quantizers (it is then already loaded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan import probes as _probes
from distributed_ext.export.plan import quantizers as _quantizers
from distributed_ext.export.plan.probes import Probe, _probe_rows, _ready
from distributed_ext.export.plan.quant_rows import (
    _KEPT,
    _TOKENS,
    _export_rows,
    _RowsOf,
    _weight_scale_rows,
    device_of,
)
from distributed_ext.export.plan.quantizers import ROW_FORMATS, _sources, _Unit, export_dtype, held_units
from distributed_ext.export.plan.row_kernels import RowsFn, fast_rows, keep_tables_for
from distributed_ext.export.plan.types import Transform

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

def forget() -> None:
    """Drops what an earlier export remembered (its quantized weights and units, its kept
    outputs): a model's quantizers may change between two exports."""
    _quantizers.forget()
    _KEPT.clear()

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
    held, units = held_units(model, state, sources, converts)
    out = Quantized()
    digest: list[tuple] = []
    extra: dict[str, torch.Tensor] = {}
    fasts: list[RowsFn | None] = []
    asked: dict[tuple, Probe] = {}
    for w, unit in units:
        weight_dtype = held[w.parts[0].source][0]
        probe = None if probes is None else probes.get(w.key)
        if probe is None:
            probe = _probes._probe_once(w, unit, weight_dtype, dtype, asked)
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
