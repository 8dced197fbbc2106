"""The model inside the wrappers users export through, and its keys without theirs.

``torch.compile(model)`` and DDP/DataParallel wrap a model in a module whose state dict
puts the wrapper's attribute before every key (``_orig_mod.``, ``module.``); written as
is, ``from_pretrained`` finds none of the checkpoint's keys and loads random weights
without an error. The export writes the model inside: the outermost wrappers are peeled
off (their model gives the config, the tied keys and transformers' conversions), and a
wrapper deeper in the tree (``model.layers[i] = torch.compile(layer)``) has its attribute
dropped from the keys below it, as torch DCP's ``_get_fqns`` drops it. FSDP1 and
activation checkpointing remove their own prefixes in their state-dict hooks.

Any other module whose whole state is one Hugging Face model below it (a user's
``Wrapper(nn.Module)`` holding ``self.inner = model``) would be written under the
wrapper's keys: refused, naming the wrapper and the path of the model inside.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn


def wrapper_attr(module: nn.Module) -> str | None:
    """The attribute under which ``module`` holds the model it wraps, for the wrappers that
    put it into every key (``torch.compile``'s ``OptimizedModule``: ``_orig_mod``;
    DistributedDataParallel and DataParallel: ``module``); None for any other module."""
    # torch._dynamo takes seconds to import: a compiled module exists only once it is.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return "_orig_mod"
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return "module"
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` with its outermost wrappers (:func:`wrapper_attr`) peeled off; ValueError
    for a module whose whole state is a Hugging Face model below it under another name."""
    while (attr := wrapper_attr(model)) is not None:
        model = getattr(model, attr)
    _refuse_foreign_wrapper(model)
    return model


def wrapper_paths(model: nn.Module) -> set[str]:
    """The paths of the wrappers' attributes inside ``model`` (``model.layers.0._orig_mod``):
    the parts of its modules' and keys' names that the written keys drop."""
    return {f"{name}.{attr}" if name else attr
            for name, m in model.named_modules() if (attr := wrapper_attr(m)) is not None}


def drop_wrapper_parts(name: str, paths: set[str]) -> str:
    """``name`` (a key or a module's name) without the wrappers' attributes in ``paths``."""
    if not paths:
        return name
    parts, path = [], ""
    for part in name.split("."):
        path = f"{path}.{part}" if path else part
        if path not in paths:
            parts.append(part)
    return ".".join(parts)


def strip_wrapper_keys(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``model.state_dict()``) with the attribute of every wrapper inside
    ``model`` dropped from the keys below it; ValueError naming both keys where two would
    then be one."""
    paths = wrapper_paths(model)
    if not paths:
        return state
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        new = drop_wrapper_parts(key, paths)
        if new in out:
            raise ValueError(
                f"model_or_state: state keys {origin[new]!r} and {key!r} are both {new!r} once "
                "the wrappers' attributes (torch.compile's _orig_mod, DDP's module) are "
                "dropped; export the model inside the wrapper, whose keys are its own")
        out[new], origin[new] = value, key
    return out


def _is_hf_model(module: nn.Module) -> bool:
    return getattr(module, "config", None) is not None and hasattr(module, "save_pretrained")


def _refuse_foreign_wrapper(model: nn.Module) -> None:
    """ValueError where ``model`` is not a Hugging Face model but its whole state is one
    below it: its keys would all start with that model's path."""
    if _is_hf_model(model) or getattr(model, "config", None) is not None:
        return
    inner = next(((name, m) for name, m in model.named_modules()
                  if name and _is_hf_model(m)), None)
    if inner is None:
        return
    path, module = inner
    keys = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
    if keys and all(k.startswith(path + ".") for k in keys):
        raise ValueError(
            f"model_or_state is a {type(model).__name__} whose whole state is the "
            f"{type(module).__name__} at {path!r}: written as is, every key would start "
            f"with {path + '.'!r} and from_pretrained would find none of them; pass the "
            f"model inside instead (export_hf_checkpoint(model.{path}, ...), or "
            f"model.get_submodule({path!r}))")
