"""A DCP checkpoint on disk written as a Hugging Face checkpoint by every rank at once
(:func:`convert_dcp_to_hf`): the saved chunks are the export's holdings, read from their
files by the rank that writes (or sends) them, through the export's own rounds, transport,
writers and publish. No rank loads a tensor or the model (built on the meta device from its
config, for the keys and the files ``save_pretrained`` writes). Details: docs/convert.md."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import runtime
from distributed_ext.export.api import _cyclic_gc_paused
from distributed_ext.export.files.publish import check_directory
from distributed_ext.export.files.saved import Saved, SavedSource, read_saved
from distributed_ext.export.files.sinks import FileSink
from distributed_ext.export.files.writers import WRITERS, check_writers
from distributed_ext.export.plan.entries import resolve_state
from distributed_ext.export.plan.safetensors import (
    SAFETENSORS_DTYPES,
    layout_files,
    parse_shard_size,
)
from distributed_ext.export.plan.saved import check_against_model, saved_holdings
from distributed_ext.export.plan.types import Entry
from distributed_ext.export.rounds import Call, _export

__all__ = ["convert_dcp_to_hf"]


def convert_dcp_to_hf(dcp_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      config: Any, *, group: dist.ProcessGroup | None = None,
                      prefix: str = "", dtype: torch.dtype | None = None,
                      max_shard_size: int | str = "5GB", writers: str = "auto") -> None:
    """Writes the model a DCP checkpoint holds as the Hugging Face checkpoint
    ``save_pretrained`` would write for it, every rank writing its share, no rank loading a
    tensor.

    Collective over ``group`` (or one process with no process group). Reads what
    ``dcp.save`` writes with ``FileSystemWriter`` (``torch.save`` items or safetensors) and
    what ``HuggingFaceStorageWriter`` writes unconsolidated (transformers'
    ``save_pretrained(..., distributed_checkpoint=True)``), saved by any layout and world;
    every rank must see ``dcp_dir``. The model class is built on the meta device from
    ``config``, for the keys and layout ``save_pretrained`` writes (a MoE's fused experts
    one tensor per expert, tied weights and ``_keys_to_ignore_on_save`` left out),
    ``config.json`` and ``generation_config.json``. Keys outside ``prefix`` (an optimizer's
    state) are skipped. Publishing and failures as :func:`export_hf_checkpoint`'s:
    ``out_dir`` holds the earlier checkpoint until the new one is complete. The saved
    ``.metadata`` is a pickle read by torch's own reader: convert only checkpoints you trust
    as you would load them. More: ``docs/convert.md``.

    Args:
        dcp_dir: The directory ``dcp.save`` wrote.
        out_dir: Where the checkpoint is published (created if missing).
        config: A transformers ``PretrainedConfig``, or a directory holding ``config.json``.
        group: The process group (default: the world, where one is set up).
        prefix: What the model's keys are saved under (``"model."`` for ``{"model": ...}``).
        dtype: Cast each floating-point tensor to it (bytes equal to ``tensor.to(dtype)``);
            None (default): as saved.
        max_shard_size: The largest file, in bytes or as ``"5GB"``.
        writers: As :func:`export_hf_checkpoint`'s (``"auto"``, ``"all"``, ``"dst"``); the
            group's first rank publishes.

    Raises:
        ValueError: on every rank, before any byte is written: arguments that differ
            between ranks or are bad; a key the model needs that the checkpoint lacks, a
            shape or dtype kind that differs from the config's model, saved chunks that do
            not cover a tensor exactly, a saved file missing or shorter than its chunks
            reach. The message names the key and the file.
        RuntimeError: on every rank but the failing one (which raises its own error): a
            rank's failure while the bytes move (a short read, a saved item that is not a
            plain tensor, a full disk, a dead rank), named; ``out_dir`` then is as it was.

    Memory: no rank holds a whole tensor: a saved chunk is read 16 MiB of rows at a time
    (``plan.saved.SAVED_BLOCK_BYTES``), a few such pieces in flight, beside the export's
    buffers (its docstring): at most 128 MiB of peak growth a rank, whatever the size of a
    saved chunk or of the checkpoint (tested; measured in benchmarks/RESULTS.md).
    """
    what = "convert_dcp_to_hf"
    source_dir, path = os.fspath(dcp_dir), os.fspath(out_dir)
    try:
        shard_value: Any = parse_shard_size(max_shard_size)
    except (TypeError, ValueError):
        shard_value = max_shard_size
    saved = _SavedModel(source_dir, config, prefix, dtype, what)
    # (dcp_dir is not compared: nodes may mount it at different paths; the checkpoint's
    # digest is agreed instead)
    agreed = (("prefix", prefix),
              ("dtype", str(dtype)), ("max_shard_size", shard_value), ("directory", path),
              ("writers", writers))
    dst = 0 if group is None else dist.get_global_rank(group, 0)

    def make_sink(entries: list[Entry], model: nn.Module | None, join: str | None,
                  _quantized: Any) -> FileSink:
        return FileSink(path, layout_files(entries, parse_shard_size(max_shard_size)), model,
                        join)

    def check() -> None:
        _check_arguments(prefix, dtype, what)
        parse_shard_size(max_shard_size)
        check_writers(writers, what)
        me = runtime.rank() if runtime.is_initialized() else 0
        check_directory(path, what, on_dst=me == dst)

    with _cyclic_gc_paused():
        _export(Call(None, dst, group, make_sink, None, what, agreed=agreed, directory=path,
                     commit=True, check=check,
                     writers=writers if writers in WRITERS else "dst", saved=saved))


def _check_arguments(prefix: object, dtype: object, what: str) -> None:
    if not isinstance(prefix, str):
        raise ValueError(f"{what}: prefix must be a str (the model's keys' prefix in the "
                         f"checkpoint, e.g. 'model.'), got {type(prefix).__name__}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
                              or dtype not in SAFETENSORS_DTYPES):
        raise ValueError(f"{what}: dtype must be None or a floating-point torch.dtype "
                         f"safetensors stores (e.g. torch.bfloat16), got {dtype!r}")


class _SavedModel:
    """What the export's rounds ask of a checkpoint on disk (``Call.saved``): ``resolve()``
    -- run in the metadata round, so that what fails here is raised on every rank --
    gives each key's source, the meta model and the holdings by world size; ``digest`` is
    then the checkpoint's, agreed between the ranks."""

    def __init__(self, directory: str, config: Any, prefix: str, dtype: torch.dtype | None,
                 what: str) -> None:
        self.directory, self.config, self.prefix, self.dtype = directory, config, prefix, dtype
        self.what = what
        self.digest = ""

    def resolve(self) -> tuple[dict[str, SavedSource], nn.Module, Any]:
        saved: Saved = read_saved(self.directory, self.prefix)
        self.digest = saved.digest
        model = meta_model(self.config, self.what)
        wanted, model = resolve_state(model)
        check_against_model(saved.tensors, wanted, self.prefix)
        keys = list(wanted)
        saved.check_files(keys)
        dtypes = {k: self.dtype if self.dtype is not None and saved.tensors[k].dtype
                  .is_floating_point else saved.tensors[k].dtype for k in keys}
        first_float = next((dtypes[k] for k in keys if dtypes[k].is_floating_point), None)
        if first_float is not None:  # (config.json's dtype is the model's, as written)
            model.to(first_float)
        sources = {k: SavedSource(saved.tensors[k], dtypes[k], self.directory) for k in keys}
        return sources, model, lambda world: saved_holdings(saved.tensors, keys, dtypes, world)


def meta_model(config: Any, what: str = "convert_dcp_to_hf") -> nn.Module:
    """The model class ``config`` names (its ``architectures``, else a causal LM), built on
    the meta device: no weight is allocated or initialized."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{what} builds the model from its config with transformers: pip "
                          "install --no-build-isolation -e '.[export]'") from None
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(os.path.join(os.fspath(config), "config.json")):
            raise ValueError(f"{what}: config={os.fspath(config)!r} holds no config.json; pass "
                             "the directory of the model's config (or a PretrainedConfig)")
        config = transformers.AutoConfig.from_pretrained(os.fspath(config))
    if not isinstance(config, transformers.PretrainedConfig):
        raise ValueError(f"{what}: config must be a transformers PretrainedConfig or a "
                         f"directory with config.json, got {type(config).__name__}")
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)
