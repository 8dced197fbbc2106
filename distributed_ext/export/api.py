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
from distributed_ext.export.rounds import _export

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
    """Writes a sharded model's full state as ONE Hugging Face checkpoint on global rank ``dst``.

    Collective over ``group``. ``model_or_state`` is an ``nn.Module`` or a state dict. A
    module is written as ``save_pretrained`` writes it: the same keys, shapes, dtypes and
    bytes (tied weights and ``_keys_to_ignore_on_save`` left out; transformers' own
    ``revert_weight_conversion`` applied, so a MoE whose experts are fused in memory is
    written one tensor per expert, in the hub's names), with ``config.json`` and
    ``generation_config.json`` from its ``config``/``generation_config``. Each written
    tensor is a set of blocks of in-memory tensors (renames, splits, selections,
    transposes), streamed from where they live: no rank materializes a fused tensor. A
    conversion that is not such a set of blocks (a cast, arithmetic) raises ValueError on
    every rank before any byte moves, naming the key. A state dict is written with its own
    keys. A module inside wrappers that rename its keys (``torch.compile``'s ``_orig_mod``,
    DDP's or ``DataParallel``'s ``module``, at the top or around a submodule) is written
    under the keys of the model inside, with its config; any other module whose whole state
    is one Hugging Face model at some path is refused on every rank naming that path (pass
    the model itself), never written under the wrapper's keys. DTensors (every placement
    torch emits but ``Partial``: ``Shard(d)``, ``_StridedShard(d, split_factor)`` in any mesh
    position -- FSDP2 over TP, EP with FSDP, TP of fused experts -- and ``Replicate``, on
    meshes of any rank, uneven and empty shards, DTensors on a sub-mesh of the group as
    replicas over the rest) are assembled from their local shards, each rank's shard placed
    as the set of row ranges torch's own splitting gives it, with no redistribute; a plain
    tensor every
    rank holds is written once and its copies never cross the link (dst's own copy with one
    writer; split between its holders where every rank writes: see Writers); a key only some
    ranks hold comes from one that holds it (replicas spread over their holders). A model
    that records a :class:`~distributed_ext.DistributionPlan` is checked against it: the
    group must be the plan's world, and every plain tensor held by every rank (the dense
    part under ``dense="replicate"``: none of it crosses the link) or by an expert shard's
    ``edp`` replicas; anything else raises ValueError on every rank before any byte moves.

    Quantized models: a model that NVIDIA ModelOpt quantized (``mtq.quantize``; its
    quantizers are detected, nothing to pass) is written as ModelOpt's own
    ``export_hf_checkpoint(model, dtype=..., export_dir=...)`` writes it in one process: the
    same keys, dtypes, shapes and bytes (quantized weights and their ``weight_scale``,
    ``weight_scale_2``, ``input_scale``, ``pre_quant_scale`` and KV cache scales; the other
    tensors as they are; a MoE's fused experts split per expert, each with its expert's
    quantizer), ``hf_quant_config.json``, and ``config.json`` with its
    ``quantization_config``. Every rank computes the rows of each quantized tensor from the
    rows of the weight it holds, with ModelOpt's own export function on a stand-in of those
    rows, a message's worth at a time, where it writes or sends them: no rank gathers a
    weight. Formats: FP8 (per-tensor, per-channel), INT8 (weight-only, SmoothQuant), NVFP4
    (W4A4, W4A16), INT4 AWQ; any other is a ValueError on every rank naming the module and
    the format, before any byte moves, as is a shard boundary that splits what a format
    computes together (INT4 AWQ packs two rows in a byte: the message names the rows), a
    column-split weight (the formats are computed along whole rows), and ranks that hold
    different calibration results. As ModelOpt's export does, the quantizers of layers
    that read one input are first fused in place (one input amax and one per-tensor weight
    amax for q, k, v; gate, up) -- the groups found by a forward of two tokens on a
    weightless replica of the model, so no weight is read --; where there are pre-quant
    scales (INT4 AWQ, INT8 SmoothQuant), whose fusing rescales the weights of such groups and
    folds the scale into the norm before them, ModelOpt's own function runs on every rank (a
    forward of the model, gathering those groups' weights one group at a time, as ModelOpt
    does). Memory beyond an unquantized
    export: the quantized bytes of the messages in flight (at most three chunks in each
    thread that sends or writes them) and the arithmetic's temporaries for 1 MiB of rows at
    a time (FP8 and NVFP4, in the compiled core: none -- a bfloat16 FP8 weight under a
    finite positive scale is divided there, other FP8 weights looked up in a 64 KiB table
    each, every such weight's kept where they fit in 32 MiB, else the last 64: 4 MiB; the
    other formats, ModelOpt's own arithmetic: several float32 copies of them). Written direct, a
    rank's quantized messages are computed into three slots of transparent huge pages (a
    direct write from them is few segments), of which only what a message touches takes
    memory.
    ModelOpt stays optional (the ``[quantize]`` extra).

    Output: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_size`` each plus ``model.safetensors.index.json``, readable by
    ``safetensors.safe_open`` and ``from_pretrained``.

    Writers: with ``writers="all"`` every rank writes the bytes of its own pieces into the
    files at their final offsets (dst makes the files and publishes them), so an FSDP2
    model's bytes never cross the link and the export runs at the speed of every rank's disk
    path; a replicated block (an HSDP shard, a plain tensor several ranks hold) is written
    once, split by rows between its holders (from 2 MiB: 1 MiB or more each), each writing
    its rows from its own copy. Each 4 KiB block of the files has one writer: a block two
    ranks' runs share is written by the rank holding most of its bytes (dst where it holds
    the header or short runs), to which the other sends its bytes there (under 4 KiB at
    each end of a run; the ranks plan who owns what, each the blocks dealt to it, in one
    preparing round). That needs a directory every rank sees as dst does (a shared
    filesystem, or one machine): dst writes a probe with a random token into its stage and
    every rank reads it back. ``"dst"``: dst writes every byte (no shared filesystem needed).
    ``"auto"`` (default): ``"all"`` where every rank sees the directory (one host's local
    disk included), else ``"dst"``; ``"all"`` where some rank does not see it is a
    ValueError on every rank naming those ranks. The rows of a ``Shard(1)``/TP layout
    (runs under 64 KiB, interleaved with the other TP ranks'; under HSDP each column block
    sent by one of its holders) are written by region: each 1 MiB region of such a tensor
    by the rank sending most of its bytes (TP ranks of equal columns in turn), which
    assembles it whole -- its own rows and those the others send it -- and writes it once;
    the partial blocks at the tensor's ends and other short runs (small tensors) go to dst,
    which assembles them likewise. On a RAM filesystem (tmpfs, /dev/shm: every rank then
    on one host) nothing of that travels: every rank copies every byte it holds, short runs
    and shared blocks included, into a shared mapping of the files (its pages are the
    files' storage, so the ranks fill one file at once instead of taking turns on its lock,
    and a 2 KiB TP row costs a copy, not a message); measured, torch's FSDP x TP recipe,
    1 GiB at world 4 on /dev/shm: ``benchmarks/RESULTS.md``. Same files, byte for byte,
    every way.

    Memory: dst never holds the model. Each file's header is computed from the metadata the
    ranks exchange, and bytes are written to their place as they arrive: dst holds two
    transport chunks per sender (``chunk_bytes``, default 16 MiB), a 16 MiB bounce buffer
    for direct writes per writing thread (two; each with a helper thread that writes), three
    1 MiB slots where its own small tensors are packed, up to 64 MiB of 1 MiB file regions
    being assembled from short runs (small tensors, the rows of a ``Shard(1)``/TP layout),
    and metadata (a few hundred bytes per tensor; a block's runs are arithmetic, never a
    list); its large blocks are written from its own tensors. The files bypass the page
    cache (``O_DIRECT``) where the filesystem allows -- short runs too, once their region is
    whole -- so the checkpoint takes no kernel memory either, and is on the disk when the
    call returns (elsewhere the page cache holds it until ``fsync``, before publishing). A
    sender holds its shards, three 1 MiB slots where its small pieces are packed, and at
    most one contiguous copy of one piece at a time where a piece is not contiguous in its
    shard (a transposed or column block), on the piece's own device. With ``writers="all"``
    a sender also holds, for the pieces it writes itself, three host slots (pinned for GPU
    bytes: one) and a 16 MiB bounce buffer for direct writes; dst as above; and every rank,
    for the blocks its runs share and the TP rows' regions, one message of up to 4 MiB per
    rank it sends to and two per rank it receives from (a few: its neighbours in the files,
    its TP group) and three 4 MiB slots where its own are packed, up to 64 MiB of the
    1 MiB regions it owns being assembled (TP rows: a region completes as its rows arrive,
    in file order), and 40 bytes per fragment (a run's end: at most two per run) of its
    table, plus while the owners are planned ~200 bytes per fragment dealt to it (~1/W of
    the world's). Mapped (a RAM filesystem, every rank writing): none of the exchange's
    buffers; a rank's resident memory counts the file pages one message's rows touch while
    it copies them (rows of 2 KiB of a TP layout: twice the message's bytes), unmapped
    before the next.

    Cost: by bytes, not tensor count. Pieces under 1 MiB are packed into shared messages by
    the compiled core and written by dst in one native call per file and message; the
    metadata round carries compact tables; a DTensor's blocks are computed on every rank from
    its global shape, mesh and placements. Python's cyclic garbage collector is paused for
    the call (its collections walk every object a large model holds).

    GPU-resident shards never cross whole: on NCCL they are sent from device memory chunk by
    chunk and dst receives into two device chunks per sender, staged through a pinned chunk
    to the files; on gloo a sender stages them through three pinned chunks, and dst writes its
    own through one. Device memory: at most two chunks per sender on dst, three on a sender
    whose shards are on the host under NCCL; no rank gathers a full parameter on its GPU.
    Pinned memory: at most three chunks (leased from the package's one pinned pool).

    Failure: arguments that differ between ranks, a bad entry (a ``Partial`` DTensor -- the
    message says to ``redistribute`` it to ``Replicate`` on that mesh dim --, a wrapper's
    keys that collide once unwrapped, a dtype or key safetensors cannot store, ranks that
    disagree on
    a key's dtype or shape, blocks that do not tile a tensor exactly), a ``state_dict()`` that
    raises, an allocation or a ``config`` that does not serialize raise on every rank before
    any byte moves; a failure during the transfer (a full disk, a dead peer, Ctrl-C) or the
    commit (an fsync or rename error) makes every rank raise; with ``writers="all"`` a rank
    whose own writes fail (or that is interrupted) stops its peers' own writes too (a flag in
    the group's store, read between messages), so they raise within moments rather than
    after writing their shares (a rank that dies is named at its peers' next wait). Under a
    distributed launch with no process group set up, RuntimeError. The checkpoint is built
    in a hidden stage inside the directory and renamed into it in an order that makes a
    partial state fail to load (the earlier entry points moved aside first, the new one
    last), so a crash at any instant leaves the earlier checkpoint, the new one, or a
    directory without an entry point that every loader refuses -- never a mix that loads; a
    failed commit puts the earlier files back. The directory itself is never replaced or
    re-permissioned, and nothing in it but the checkpoint's files (shards, index, the
    configs it writes, stale shards of an earlier checkpoint, as ``save_pretrained``
    removes them) is touched: subdirectories, mounts, a tokenizer are left as they are. A
    ``directory`` that cannot take a checkpoint (``""``, a symlink loop, a file, a place
    that cannot be written) is a ValueError on every rank in the metadata round, naming it.
    See ``docs/checkpoint.md``.

    Args:
        model_or_state: The (sharded) model, or a state dict, on every rank of ``group``.
        directory: Where dst writes (created if missing).
        dst: The global rank that writes.
        group: The process group (default: the world).
        max_shard_size: The largest file, in bytes or as ``"5GB"``/``"500MiB"``.
        chunk_bytes: Transport piece size (default 16 MiB).
        writers: ``"auto"``, ``"all"`` or ``"dst"``: who writes the files (see Writers).
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
    extra = (("max_shard_size", shard_value), ("directory", path), ("writers", writers))

    def check() -> None:
        parse_shard_size(max_shard_size)
        check_writers(writers, what)
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        check_directory(path, what, on_dst=me == dst)

    with _cyclic_gc_paused():
        _export(model_or_state, dst, group, make_sink, chunk_bytes, what,
                extra_args=extra, commit=True, check=check,
                writers=writers if writers in WRITERS else "dst", quantize=True)


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
        sink, _model = _export(model_or_state, dst, group,
                               lambda entries, model, _join, _q: MemorySink(entries, model), None,
                               what, hub_keys=hub_keys)
    return None if sink is None else sink.tensors
