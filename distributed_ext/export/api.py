"""A sharded model's full state on one rank: as a Hugging Face checkpoint
(:func:`export_hf_checkpoint`), or as a dict (:func:`gather_full_state`). The rounds both
run: :mod:`.rounds`."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from distributed_ext.export.files.publish import check_directory
from distributed_ext.export.files.sinks import FileSink, MemorySink
from distributed_ext.export.files.writers import WRITERS, check_writers
from distributed_ext.export.plan.quantized import Quantized
from distributed_ext.export.plan.safetensors import layout_files, parse_shard_size
from distributed_ext.export.plan.types import Entry
from distributed_ext.export.rounds import Call, _export

__all__ = ["export_hf_checkpoint", "gather_full_state"]


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector for the block (reference counting still frees
    everything without cycles). Why: an export allocates a few small objects per tensor, and
    each collection that this triggers walks every object the process holds -- a model's
    100k DTensors and modules -- which made an export of many small tensors 2.5x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def export_hf_checkpoint(model_or_state: nn.Module | dict, directory: str | os.PathLike[str],
                         dst: int = 0, group: dist.ProcessGroup | None = None, *,
                         max_shard_size: int | str = "5GB",
                         chunk_bytes: int | None = None, writers: str = "auto") -> None:
    """Writes a sharded model's full state as ONE Hugging Face checkpoint in ``directory``.

    Collective over ``group``. A module is written as ``save_pretrained`` writes it (the same
    keys, shapes, dtypes and bytes: tied weights left out, transformers' weight conversions
    reverted so fused MoE experts are written per expert, ``config.json`` and
    ``generation_config.json`` from its configs); a state dict with its own keys. DTensors of
    every placement torch emits but ``Partial`` (FSDP2, TP, torch's 2-D recipe with
    ``_StridedShard``, EP, HSDP) are written from their local shards, no rank gathering a
    tensor; a model inside ``torch.compile`` or DDP (around it or a submodule) under the keys
    of the model inside. A model NVIDIA ModelOpt quantized is written as ModelOpt's own
    ``export_hf_checkpoint`` writes it (quantized weights, scales, ``hf_quant_config.json``),
    each rank quantizing the rows it holds. The files are built in a hidden stage inside the
    directory and published only once every byte has landed on every rank; a crash at any
    instant leaves the earlier checkpoint, the new one, or one that no loader accepts; nothing
    in the directory but the checkpoint's files is touched, and one export of a directory is
    live at a time. Placements, writers, publishing and the quantized formats:
    ``docs/checkpoint.md``.

    Args:
        model_or_state: The (sharded) model, or a state dict, on every rank of ``group``.
        directory: Where the checkpoint is published (created if missing, as its parents).
        dst: The global rank that makes and publishes the files.
        group: The process group (default: the world).
        max_shard_size: The largest file, in bytes or as ``"5GB"``/``"500MiB"``.
        chunk_bytes: Transport piece size (default 16 MiB).
        writers: ``"all"``: every rank writes the bytes it holds at their final offsets
            (every rank must see the directory as dst does); ``"dst"``: dst writes every
            byte as it arrives; ``"auto"`` (default): ``"all"`` where every rank sees the
            directory, else ``"dst"``.

    Returns:
        None, on every rank, once the checkpoint is published (durable: fsynced).

    Raises:
        ValueError: on every rank, before any byte moves: arguments that differ between
            ranks; a bad entry (a ``Partial`` DTensor, a dtype safetensors cannot store,
            blocks that do not tile a tensor); a conversion that is not a set of blocks; a
            quantized format or layout that is not written from the shards (the message names
            the module and the fix); a ``directory`` that cannot take a checkpoint, holds a
            directory where a checkpoint file goes, or is being exported into by another live
            export.
        RuntimeError: on every rank: another rank's failure, named (a full disk, a dead or
            interrupted rank, a failed commit); the directory then holds the earlier
            checkpoint. Under a distributed launch with no process group set up.

    Memory: no rank holds the model or a whole tensor. dst holds two transport chunks per
    sender (``chunk_bytes``), a 16 MiB bounce buffer per writing thread (two), and up to
    64 MiB of 1 MiB file regions assembled from short runs; a sender its shards, three 1 MiB
    packing slots and at most one contiguous copy of one non-contiguous piece; with
    ``writers="all"`` every rank also its own writer's buffers (the same sizes). A quantized
    export adds the quantized bytes of the messages in flight and the arithmetic's
    temporaries for 1 MiB of rows. Measured peaks: ``benchmarks/RESULTS.md``.
    """
    what = "export_hf_checkpoint"
    path = os.fspath(directory)

    def make_sink(entries: list[Entry], model: nn.Module | None, join: str | None,
                  quantized: Quantized | None) -> FileSink:
        return FileSink(path, layout_files(entries, parse_shard_size(max_shard_size)), model,
                        join, quantized)

    # Checked on every rank and agreed in the metadata round, with dst and chunk_bytes
    # ("5GB" and 5000000000 are the same size: compared parsed, where they parse).
    try:
        shard_value: Any = parse_shard_size(max_shard_size)
    except (TypeError, ValueError):
        shard_value = max_shard_size  # raised by check() inside the round, on this rank
    agreed = (("max_shard_size", shard_value), ("directory", path), ("writers", writers))

    def check() -> None:
        parse_shard_size(max_shard_size)
        check_writers(writers, what)
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        check_directory(path, what, on_dst=me == dst)

    with _cyclic_gc_paused():
        _export(Call(model_or_state, dst, group, make_sink, chunk_bytes, what,
                     agreed=agreed, directory=path, commit=True, check=check,
                     writers=writers if writers in WRITERS else "dst", quantize=True))


def gather_full_state(model_or_state: nn.Module | dict, dst: int = 0,
                      group: dist.ProcessGroup | None = None, *,
                      hub_keys: bool = False) -> dict | None:
    """The full state of a sharded model (or state dict) as CPU tensors on ``dst``; None elsewhere.

    Collective; the same inputs, assembly and failure rules as :func:`export_hf_checkpoint`
    (tied weights once). The keys are the model's in-memory names, as ``state_dict()`` has
    them -- a state dict for ``load_state_dict`` of the same model class. With
    ``hub_keys=True`` they are instead the keys and tensors ``export_hf_checkpoint`` writes
    (the hub's layout: e.g. one tensor per expert where transformers fuses a MoE's experts in
    memory), for code that wants the checkpoint's tensors without a file.

    Memory on dst: the full state once (the returned CPU tensors, filled in place) plus two
    transport chunks per sender (and the pinned and device chunks of
    :func:`export_hf_checkpoint` for GPU-resident shards); nothing else.
    """
    what = "gather_full_state"
    with _cyclic_gc_paused():
        sink, _model = _export(Call(model_or_state, dst, group,
                                    lambda entries, model, _join, _q: MemorySink(entries, model),
                                    None, what, hub_keys=hub_keys))
    return None if sink is None else sink.tensors
