"""FSDP2 for Hugging Face causal LMs: find the decoder layers, shard each, then the root.

Detection looks for the decoder-layer ModuleList at the layouts Hugging Face models use
(``model.layers``, ``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``,
``backbone.layers``, a VLM's ``language_model``; through a PEFT wrapper too), then falls back
to the model's ``_no_split_modules`` classes. Parameters whose dtype differs from the model's
dominant one (an fp32 MoE router in a bf16 model) are kept out of the shard groups, because
FSDP2 rejects a group that mixes dtypes; they stay replicated on the compute device.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import runtime

__all__ = ["fsdp2_wrap", "is_fsdp2_model", "resolve_decoder_layers"]

# Attribute paths of the decoder-layer ModuleList, most specific first. A VLM's language model
# comes before the generic ``model.layers`` so that a vision tower's layers are never chosen.
KNOWN_LAYER_PATHS = (
    "model.language_model.layers",  # VLMs (transformers >= 4.52): Llava, Qwen2-VL, Gemma3 ...
    "language_model.model.layers",  # older VLM layout
    "model.language_model.model.layers",
    "language_model.layers",
    "model.layers",  # Llama, Mistral, Mixtral, Qwen2/3(-MoE), Gemma/2, Phi-3, DeepSeek ...
    "model.decoder.layers",  # OPT
    "transformer.h",  # GPT-2, Bloom, Falcon
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "backbone.layers",  # Nemotron-H, Mamba
    "transformer.blocks",  # MPT
)


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:  # torch without distributed
        return None


def is_fsdp2_model(model: nn.Module) -> bool:
    """Return True if any submodule of ``model`` has been wrapped with FSDP2 ``fully_shard``."""
    fsdp_type = _fsdp_module_type()
    return fsdp_type is not None and any(isinstance(m, fsdp_type) for m in model.modules())


def _attr_path(root: nn.Module, path: str) -> nn.Module | None:
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def _roots(model: nn.Module) -> list[nn.Module]:
    """The model, and the model a PEFT wrapper holds (``get_base_model()``)."""
    roots = [model]
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, nn.Module) and base is not model:
            roots.append(base)
    return roots


def _no_split_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def resolve_decoder_layers(
    model: nn.Module, layers: Sequence[nn.Module] | str | type | None = None
) -> list[nn.Module]:
    """The decoder layers of ``model``: explicit, at a known layout, or by ``_no_split_modules``.

    Args:
        model: A Hugging Face causal LM (or a PEFT wrapper, or a VLM).
        layers: Overrides detection: a list of modules, or a class (or class name) whose
            instances in ``model`` are the layers.

    Raises:
        ValueError: nothing is found; the message names what was looked for and how to pass
            ``layers`` explicitly.
    """
    if layers is not None:
        if isinstance(layers, (str, type)):
            name = layers if isinstance(layers, str) else layers.__name__
            found = [m for m in model.modules() if type(m).__name__ == name]
            if not found:
                raise ValueError(f"fsdp2_wrap: layers={name!r} matches no submodule of "
                                 f"{type(model).__name__}")
            return found
        found = list(layers)
        if not found or not all(isinstance(m, nn.Module) for m in found):
            raise ValueError("fsdp2_wrap: layers must be a non-empty list of nn.Module, a "
                             "class or a class name")
        return found
    for root in _roots(model):
        for path in KNOWN_LAYER_PATHS:
            candidate = _attr_path(root, path)
            if isinstance(candidate, nn.ModuleList) and len(candidate) > 0:
                return list(candidate)
    classes = _no_split_classes(model)
    if classes:
        found = [m for m in model.modules() if type(m).__name__ in classes]
        # Keep the outermost matches: a layer class may nest another listed class.
        outer = [m for m in found
                 if not any(m is not o and any(m is x for x in o.modules()) for o in found)]
        if outer:
            return outer
    raise ValueError(
        f"fsdp2_wrap: found no decoder layers in {type(model).__name__}: looked for a "
        f"ModuleList at {', '.join(KNOWN_LAYER_PATHS)} and for instances of its "
        f"_no_split_modules ({sorted(classes) or 'none declared'}); pass them explicitly: "
        "fsdp2_wrap(model, layers=[...modules...]) or layers='MyDecoderLayer'"
    )


def _dominant_dtype(model: nn.Module) -> torch.dtype | None:
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def _off_dtype_names(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` of every parameter whose dtype differs from the model's dominant one."""
    dominant = _dominant_dtype(model)
    return [(n, p) for n, p in model.named_parameters() if p.dtype != dominant]


def _off_dtype_params(model: nn.Module) -> set[nn.Parameter]:
    """Params whose dtype differs from the model's dominant (by element count) param dtype.

    FSDP2 needs one dtype per shard group, but checkpoints routinely keep a few parameters in
    fp32 (an MoE router in a bf16 model); pass these to ``fully_shard(ignored_params=...)``.
    As ModelOpt's function of this name: returns the set of parameters (empty when the model
    has one dtype) and warns once per call, on the master rank only, with a UserWarning that
    says "mixed parameter dtypes" and names the first few.
    """
    off = _off_dtype_names(model)
    if not off:
        return set()
    if runtime.is_master():
        counts: dict[torch.dtype, int] = {}
        for p in model.parameters():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        dominant = _dominant_dtype(model)
        off_numel = sum(n for d, n in counts.items() if d != dominant)
        names = sorted(n for n, _p in off)
        warnings.warn(
            f"Model has mixed parameter dtypes {sorted(str(d) for d in counts)}; FSDP2 needs one "
            f"dtype per shard group, so {len(names)} non-{dominant} parameter(s) "
            f"({100 * off_numel / sum(counts.values()):.2f}% of elements) stay replicated "
            f"rather than sharded: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}",
            UserWarning,
            stacklevel=2,
        )
    return {p for _n, p in off}


def _compute_device() -> torch.device:
    """Where FSDP2's default mesh computes: the current GPU if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fsdp2_wrap(
    model: nn.Module,
    shard_root: bool = True,
    mp_policy: object | None = None,
    cpu_offload: bool = False,
    *,
    layers: Sequence[nn.Module] | str | type | None = None,
) -> list[nn.Module]:
    """Auto-detect a HF causal-LM's decoder layers and FSDP2 ``fully_shard`` each one.

    By default (``shard_root=True``) the root module is wrapped too, so embed/lm_head/norm are
    sharded instead of replicated per rank; pass ``shard_root=False`` to leave the root
    replicated (only decoder layers sharded). Returns the detected decoder layers so callers
    can reuse the detection result.

    Parameters whose dtype differs from the model's dominant one (by element count; see
    :func:`_off_dtype_params`) are excluded from the wrap (``ignored_params``), since FSDP2
    rejects a shard group that mixes dtypes. They stay replicated, are moved onto the shards'
    compute device (also under ``cpu_offload``), and a warning names them.
    ``config.architectures`` keeps the model's class name although ``fully_shard`` swaps
    the class.

    Args:
        model: The model, on every rank of the default process group.
        shard_root: Also shard the root module.
        mp_policy: A ``torch.distributed.fsdp.MixedPrecisionPolicy`` passed to every call.
        cpu_offload: Offload sharded parameters to the CPU (``CPUOffloadPolicy``).
        layers: Overrides detection (see :func:`resolve_decoder_layers`); not in the spec's
            signature, keyword-only.

    Returns:
        The decoder layers that were sharded.

    Memory: each rank keeps 1/world of the sharded parameters, plus the excluded ones whole.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()) and "RANK" not in os.environ:
        # fully_shard would build a default group from the launch's environment (as torch
        # does under torchrun) and, with none, fail inside torch ("environment variable
        # RANK expected").
        raise RuntimeError(
            "fsdp2_wrap: no process group is set up; call it inside `with "
            "distributed_ext.distributed_run():` under torchrun (it sets the group up), or "
            "set one up first with torch.distributed.init_process_group(...) -- for a "
            "single process a one-rank group: init_process_group('gloo', "
            "init_method='tcp://127.0.0.1:29500', rank=0, world_size=1)")
    found = resolve_decoder_layers(model, layers)
    ignored = _off_dtype_params(model)  # warns once, on the master rank, naming them
    device = _compute_device()
    if ignored:
        with torch.no_grad():
            for p in ignored:
                if p.device != device:
                    p.data = p.data.to(device)  # fully_shard does not move params it ignores
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "architectures", None) is None:
        config.architectures = [type(model).__name__]
    kwargs: dict = {}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if ignored:
        kwargs["ignored_params"] = ignored
    for layer in found:
        fully_shard(layer, **kwargs)
    if shard_root:
        fully_shard(model, **kwargs)
    return found
