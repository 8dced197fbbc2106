"""The rounds of an export (:func:`_export`), on every rank of the group:

0. For a model ModelOpt quantized (:func:`_fuse_quantized`): its shared-input layers fused,
   and each quantized weight probed by one rank (ModelOpt's export of a few rows of it:
   its global scales, the written dtypes and shapes), every rank getting every probe.
1. Metadata round (``all_reduce``): each rank describes its in-memory entries as compact
   tables -- per key an index into a few distinct signatures (dtype, global shape, and for
   a DTensor its placements and mesh), and the keys themselves only where ranks hold
   different ones (else a digest of them). A bad entry (a ``Partial`` placement, a dtype
   safetensors cannot store) raises on every rank before any byte moves.
2. Plan, computed alike on every rank from that metadata: who holds which block of each
   in-memory tensor (a DTensor's blocks computed locally from its shape, mesh and
   placements), the tensors to write (for a model, the hub's layout that ``save_pretrained``
   writes: :mod:`plan.keys`, each written tensor a set of boxes of in-memory
   tensors), and for each, which rank sends which block (replicas once: dst's own copy if it
   has one, else the least-loaded holder's; a model's recorded
   :class:`~distributed_ext.DistributionPlan` is checked against what the ranks hold), and
   an agreed error for keys whose ranks disagree on dtype or shape, whose blocks do not cover
   the tensor, or whose conversion cannot be streamed.
3. Preparing round: dst makes the files in a hidden stage inside the directory (or
   allocates the full tensors); a failure raises on every rank. With ``writers="all"``
   (:mod:`files.writers`) every rank then opens them to write its own long runs itself, and
   the ranks agree who writes each block their runs share (:mod:`transport.shared_blocks`: the blocks dealt
   out, each rank planning the owners of ~1/W of them).
4. Data: each rank's pieces travel as the messages of :func:`plan_messages` -- large pieces
   in ``chunk_bytes`` pieces from their own memory, small ones packed by the compiled core --
   and dst writes each message to its places as it arrives (small runs in one native call per
   file, large ones with ``O_DIRECT`` where the filesystem takes it:
   :mod:`distributed_ext._direct_io`), while a second thread writes dst's own pieces, which
   never cross the link. Waits are watched (:mod:`distributed_ext._watch`).
5. Final round: any failure (a full disk, a dead peer, an interrupt) makes every rank raise,
   and dst removes its temporary files; else dst renames them into place, writes the index,
   ``config.json`` and ``generation_config.json``, and removes stale shards of an earlier
   checkpoint, as ``save_pretrained`` does.

The checkpoint's layout and the families tested: ``docs/checkpoint.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_ext import _agree, _watch, runtime
from distributed_ext.collectives import _require_group_if_launched, all_reduce
from distributed_ext.export.files.publish import _commit_round
from distributed_ext.export.files.sinks import FileSink
from distributed_ext.export.files.writers import resolve_writers
from distributed_ext.export.plan import keys as _keys
from distributed_ext.export.plan import probes as _probes
from distributed_ext.export.plan import quantized as _quantized
from distributed_ext.export.plan import shared_inputs as _shared_inputs
from distributed_ext.export.plan.entries import (
    Described,
    _Args,
    describe_state,
    resolve_state,
)
from distributed_ext.export.plan.holdings import Holding, agree_plan, merge_holdings
from distributed_ext.export.plan.pieces import check_keys, plan_entries
from distributed_ext.export.plan.quantized import Quantized
from distributed_ext.export.plan.safetensors import _DTYPE_BY_NAME
from distributed_ext.export.plan.types import Entry
from distributed_ext.export.plan.wrappers import unwrap
from distributed_ext.export.transport import shared_blocks as _edges
from distributed_ext.export.transport.prepare import _prepare_transfer
from distributed_ext.export.transport.stop import StopSignal
from distributed_ext.export.transport.transfer import EXPORT_CHUNK_BYTES, _write_data, _write_own
from distributed_ext.plan import recorded_plan


@dataclass
class Call:
    """One export's arguments, each under its own name on its way down the rounds.

    ``make_sink(entries, model, join, quantized)`` runs on dst in the preparing round (its
    failure is agreed); with ``writers`` "all" or "auto" (:mod:`files.writers`), where every
    rank sees dst's stage, it runs on every other rank too, with ``join`` that stage's path.
    ``agreed``: the caller's own arguments, compared between ranks in the metadata round
    (``check()`` validates them there, on every rank). ``commit``: dst commits the sink in a
    last round every rank joins. ``quantize``: a model ModelOpt quantized is written as
    ModelOpt's export writes it (:mod:`plan.quantized`)."""

    model_or_state: nn.Module | dict
    dst: int
    group: dist.ProcessGroup | None
    make_sink: Callable[[list[Entry], nn.Module | None, str | None, Quantized | None], Any]
    chunk_bytes: int | None
    what: str
    hub_keys: bool = True
    agreed: tuple[tuple[str, Any], ...] = ()
    directory: str | None = None
    commit: bool = False
    check: Callable[[], Any] | None = None
    writers: str = "dst"
    quantize: bool = False
    # A checkpoint on disk instead of a model in memory (:mod:`export.convert`): its
    # ``resolve()`` gives (each key's source, the meta model, its holdings by world size)
    # and its ``digest`` is agreed with the arguments.
    saved: Any = None

    def chunk(self) -> int:
        chunk = EXPORT_CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"{self.what}: chunk_bytes must be a positive int (bytes per "
                             f"transport message), got {self.chunk_bytes!r}")
        return chunk

    @property
    def quantized_model(self) -> bool:
        return self.quantize and self.hub_keys and isinstance(self.model_or_state, nn.Module)


@dataclass
class _Held:
    """What the metadata round found on this rank: its entries' local blocks, the model, the
    chunk size, its Described, and the quantized model's plan."""

    local: dict[str, torch.Tensor]
    model: nn.Module | None
    chunk: int
    described: Described
    quantized: Quantized | None
    # Who holds which block, by the group's size, where it is not what the ranks describe
    # (a checkpoint's saved chunks, read by the rank that is given each)
    holdings: Callable[[int], dict[str, Holding]] | None = None


@dataclass
class _Parts:
    """The preparing rounds' products on this rank: dst's (or a joined writer's) sink and
    the prepared transfer."""

    sink: Any = None
    prepared: Any = None

    def release(self) -> None:
        """A failed round's cleanup: the buffers released and dst's stage removed."""
        if self.prepared is not None:
            self.prepared.release()
            self.prepared.release_local()
        if self.sink is not None:
            self.sink.abort()


def _export(call: Call) -> tuple[Any, nn.Module | None]:
    """The rounds of the module docstring; returns (dst's sink, the model)."""
    _keys.forget()  # (what an earlier export remembered: the model may have changed since)
    _quantized.forget()
    if not runtime.is_initialized():
        return _export_alone(call)
    ctx = _agree.resolve_group(call.group, call.what)
    fused = _fuse_quantized(unwrap(call.model_or_state), call.group, call.what, ctx.rank,
                            ctx.size) if call.quantized_model else _Fused()
    with _watch.DeferredInterrupts() as deferred:
        held, described = _metadata_round(call, fused, ctx)
        dst_rank = ctx.group_rank_of(call.dst)
        if dst_rank is None:
            raise ValueError(f"{call.what}: dst={call.dst} is not a member of the group (global "
                             f"ranks {ctx.ranks}); pass the global rank of one of them")
        # A sender makes only its own pieces; dst all of them (it lays out the files). Where
        # every rank may write its own bytes, replicated blocks are split between their
        # holders (planned again without, should the ranks turn out not to share the files).
        keep = None if ctx.rank == dst_rank else ctx.rank
        entries = _plan(call, held, described, dst_rank, ctx.ranks, keep,
                        spread=call.writers != "dst")
        parts = _Parts()
        _preparing_round(call, held, ctx, parts, entries, dst_rank, deferred)
        if call.writers != "dst":
            _writers_rounds(call, held, described, ctx, parts, entries, dst_rank, keep, deferred)
        _data_round(call, held, ctx, parts, dst_rank, deferred)
        sink = parts.sink if ctx.rank == dst_rank else None  # (a writer's own: closed)
        if call.commit:
            _commit_round(sink, ctx, deferred, call.what)
    return sink, held.model


def _export_alone(call: Call) -> tuple[Any, nn.Module | None]:
    """The export in one process with no process group: the same plan, dst writing it all."""
    _require_group_if_launched(call.what)
    if call.dst != 0:
        raise ValueError(f"{call.what}: dst={call.dst}, but there is no process group: the one "
                         "process is rank 0 (pass dst=0, or set the group up first)")
    if call.quantized_model:
        inner = unwrap(call.model_or_state)
        if _shared_inputs.needs_gather(inner):
            _shared_inputs.fuse_pre_quant_scales_alone(inner)
    held = _describe(call, _Fused())
    entries = _plan(call, held, [held.described], 0, [0])
    sink = call.make_sink(entries, held.model, None, held.quantized)
    prepared = None
    try:
        prepared = _prepare_transfer(held.local, entries, None, 0, held.chunk)
        _write_own(prepared.stager, sink, prepared.messages)
        if call.commit:
            sink.commit()
    except BaseException:
        sink.abort()
        raise
    finally:
        if prepared is not None:
            prepared.release()
    return sink, held.model


def _describe(call: Call, fused: _Fused) -> _Held:
    """This rank's entries described (run inside the metadata round, so that a
    ``state_dict()`` hook or a check that raises on one rank is raised on every rank)."""
    chunk = call.chunk()
    if call.check is not None:
        call.check()
    holdings = None
    if call.saved is not None:  # a checkpoint on disk: each key read where it is planned
        state, model, holdings = call.saved.resolve()
    elif fused.state is not None:  # (resolved in the quantized layers' round already)
        state, model = fused.state, unwrap(call.model_or_state)
    else:
        state, model = resolve_state(call.model_or_state)
    quantized = None
    if call.quantize and call.hub_keys and model is not None:
        # (state rewritten as ModelOpt writes it; a format not written by blocks raises)
        quantized = _quantized.prepare(model, state, probes=fused.probes,
                                       quant_config=fused.config)
    recorded = recorded_plan(model) if model is not None else None
    local: dict[str, torch.Tensor] = {}  # (each key's local block, looked up once here)
    if holdings is None:
        described = describe_state(state, None if recorded is None else astuple(recorded),
                                   local)
    else:  # (every rank reads the same checkpoint: its digest is agreed below)
        described, local = Described([], b"", []), state
    agreed = call.agreed
    if call.quantize:  # every rank must compute the same tensors from the same calibration
        agreed += (("the quantized model (formats, shapes, scales)",
                    None if quantized is None else quantized.digest),)
    if call.saved is not None:
        agreed += (("the checkpoint (its keys, dtypes, shapes and saved chunks)",
                    call.saved.digest),)
    described.args = _Args(call.dst, chunk, agreed)
    if call.hub_keys and model is not None and runtime.rank() == call.dst:
        # Whether transformers converts this model's keys, decided once, on dst: its table of
        # conversions (900 regular expressions) is costly to build in each process, which
        # every rank of a host would otherwise pay at once on its cores.
        described.converts = _keys.has_conversions(model)
    return _Held(local, model, chunk, described, quantized, holdings)


def _metadata_round(call: Call, fused: _Fused, ctx: _agree.GroupContext
                    ) -> tuple[_Held, list[Described]]:
    """Every rank describes its entries; every rank gets every rank's Described, and raises
    alike where the ranks passed different arguments."""
    mine: list[_Held] = []

    def describe() -> Described:
        mine.append(_describe(call, fused))
        return mine[-1].described.summary()

    summaries = all_reduce(f"{call.what} (metadata)", describe, list, call.group)
    described = resolve_described(summaries, mine[-1].described, call.what, call.group)
    # From here on every rank computes the same from the same metadata: an error below is
    # raised by every rank alike.
    _check_args(described, ctx, call.what)
    return mine[-1], described


def _plan(call: Call, held: _Held, described: list[Described], dst_rank: int,
          ranks: list[int], keep: int | None = None, spread: bool = False) -> list[Entry]:
    """The entries, computed alike on every rank from every rank's Described."""
    if held.holdings is not None:
        holdings = held.holdings(len(ranks))
    else:
        holdings = merge_holdings(described, ranks, dst_rank,
                                  agree_plan([d.plan for d in described], ranks))
    written = None
    if call.hub_keys and held.model is not None:
        written = _keys.resolve_written(held.model, {
            k: (_DTYPE_BY_NAME[h.sig.dtype], h.sig.shape) for k, h in holdings.items()},
            described[dst_rank].converts)
    if written is not None and held.quantized is not None:
        written = _quantized.apply(written, held.quantized)
    entries = plan_entries(holdings, written, dst_rank, ranks, keep, spread)
    check_keys(entries)
    return entries


def _agreed(call: Call, ctx: _agree.GroupContext, parts: _Parts, stage: str,
            step: Callable[[], Any]) -> list[_agree.Status]:
    """Runs ``step`` here and agrees its outcome (every rank's status, with the fields it
    returned); on any failure (on any rank) every rank releases its parts and raises."""
    return _agree.agree(call.what, ctx, step, stage=stage, cleanup=parts.release)


def _preparing_round(call: Call, held: _Held, ctx: _agree.GroupContext, parts: _Parts,
                     entries: list[Entry], dst_rank: int,
                     deferred: _watch.DeferredInterrupts) -> None:
    """dst makes the files; with one writer, every rank its transfer's buffers."""

    def prepare() -> None:
        interrupted = deferred.take()  # one that landed in the metadata round fails here
        if interrupted is not None:
            raise interrupted
        if ctx.rank == dst_rank:
            parts.sink = call.make_sink(entries, held.model, None, held.quantized)
        if call.writers == "dst":
            parts.prepared = _prepare_transfer(held.local, entries, ctx, dst_rank, held.chunk)

    _agreed(call, ctx, parts, "preparing", prepare)


def _writers_rounds(call: Call, held: _Held, described: list[Described],
                    ctx: _agree.GroupContext, parts: _Parts, entries: list[Entry],
                    dst_rank: int, keep: int | None,
                    deferred: _watch.DeferredInterrupts) -> None:
    """Who writes (:func:`files.writers.resolve_writers`); every rank joins dst's stage where
    it writes its own bytes; then who writes each block their runs share."""
    try:
        mode, stage, mapped = resolve_writers(
            call.writers, None if parts.sink is None else parts.sink.stage.path, ctx,
            dst_rank, call.group, call.what, call.directory)
    except BaseException:
        parts.release()
        raise

    def joined_layout() -> FileSink:
        """The files; a sender opens them (joins dst's stage) here."""
        if parts.sink is None:
            parts.sink = call.make_sink(entries, held.model, stage, held.quantized)
        return parts.sink

    def join() -> tuple[int, int]:
        nonlocal entries
        if mode == "dst":  # (auto, where some rank does not see the files)
            entries = _plan(call, held, described, dst_rank, ctx.ranks, keep)
        parts.prepared = _prepare_transfer(held.local, entries, ctx, dst_rank, held.chunk,
                                           local=mode == "all", layout=joined_layout,
                                           mapped=mapped)
        if mode == "all":
            parts.prepared.stop = StopSignal(stage, ctx.size, deferred)
        edges = parts.prepared.edges
        if edges is None:
            return (0, 0)
        return (int(len(edges.rows) > 0), int(bool(edges.zones)))

    # (Each rank's status fields say whether it has fragments of shared blocks, and whether
    # it writes, sends or receives TP rows' regions.)
    statuses = _agreed(call, ctx, parts, "preparing the writers", join)
    fragments = any(s.fields[0] for s in statuses)
    if fragments or any(s.fields[1] for s in statuses):
        _agreed(call, ctx, parts, "preparing the shared blocks", lambda: _edges.prepare_round(
            parts.prepared.edges, parts.sink, entries, held.local, ctx, dst_rank,
            _edges.round_cap(held.chunk), call.what, resolve=fragments))


def _data_round(call: Call, held: _Held, ctx: _agree.GroupContext, parts: _Parts,
                dst_rank: int, deferred: _watch.DeferredInterrupts) -> None:
    """The bytes move; then every rank agrees whether any rank failed."""
    sink, prepared = parts.sink, parts.prepared
    assert prepared is not None
    try:
        failure = _write_data(held.local, prepared, sink, ctx, dst_rank, call.what)
    except _watch.PeerFailure as exc:
        if sink is not None:
            sink.abort()
        raise _agree.peer_failure_error(call.what, exc) from exc.cause
    _agree.agree(call.what, ctx, failure=failure or deferred.take(), stage="transfer",
                 cleanup=None if sink is None else sink.abort)


def _fuse_quantized(model: nn.Module, group: dist.ProcessGroup | None, what: str,
                    index: int = 0, count: int = 1) -> _Fused:
    """ModelOpt's fusing of the shared-input layers of a model quantized with pre-quant scales
    (AWQ, SmoothQuant), which rescales their weights (:func:`plan.shared_inputs.needs_gather`):
    first agreed by every rank (a model quantized so on some ranks only is a ValueError on
    every rank; one round, also for any other model), then done from each rank's rows
    (:class:`plan.shared_inputs.Resmooth`: each rank's amax pieces gathered in one agreed
    round, then applied by every rank, its outcome agreed; no weight gathered). Where that
    cannot be done by rows (on any rank), ModelOpt's own function runs on every rank instead
    (its forward and weight updates, collective under FSDP2) and its outcome is agreed.
    Every other format is fused by each rank alone, in the first round. (ModelOpt's
    forward is the one step here whose collectives are not ours: a rank that fails inside it
    leaves its peers in that collective until the watch or the group's timeout names it.)

    Returns (:class:`_Fused`) every quantized weight's probe
    (:func:`plan.quantized.probe_share`), each rank (group rank ``index`` of ``count``)
    computing its share once the layers are fused, and the last rank ModelOpt's quantization
    config: in the first round, else in one more; None for a model ModelOpt did not quantize
    on any rank, and where ``count`` is 1 (then :func:`plan.quantized.prepare` probes them
    all). Beside them, where the probes were made in the first round: this rank's model
    state, resolved there once the layers were fused (nothing changes the model after it),
    for the metadata round to take instead of resolving it again (a walk of the model
    saved; a rank's failure there is agreed as in the metadata round); else None."""
    state: dict[str, Any] | None = None
    Share = tuple[dict[str, _probes.Probe] | None, dict[str, Any] | None]

    def share(pre_quant: bool) -> Share:
        """This rank's probes, and the config where it asks it; ``pre_quant``: whether the
        model has pre-quant scales (their layers then fused already, by the rounds below:
        not again)."""
        nonlocal state
        if count == 1:  # (prepare probes them all: the same, with no second look at them)
            return None, None
        probes, state, config = _probes.probe_share(
            model, lambda: resolve_state(model)[0], index, count, pre_quant=pre_quant)
        return probes, config

    def first() -> tuple[bool, Share]:
        if _shared_inputs.needs_gather(model):
            return True, (None, None)
        return False, share(pre_quant=False)

    got = all_reduce(f"{what} (opening)", first, list, group)
    flags = [flag for flag, _share in got]
    if not any(flags):
        return _merge_shares([share for _flag, share in got], state)
    if not all(flags):
        ranks = [r for r, f in enumerate(flags) if not f]
        raise ValueError(f"{what}: the model has ModelOpt's pre-quant scales (AWQ, SmoothQuant) "
                         f"on some ranks but not on group ranks {ranks}; quantize it alike on "
                         "every rank")
    resmooth = _shared_inputs.Resmooth(model)
    pieces = all_reduce(f"{what} (the pre-quant scales of layers that share an input, from "
                        "each rank's rows)", resmooth.pieces, list, group)
    if all(p is not None for p in pieces):
        all_reduce(f"{what} (fusing the pre-quant scales of layers that share an input)",
                   lambda: resmooth.apply(pieces), list, group)
    else:
        all_reduce(f"{what} (fusing the pre-quant scales of layers that share an input)",
                   lambda: _shared_inputs.fuse_shared_inputs(model), list, group)
    if count == 1:
        return _Fused()
    return _merge_shares(all_reduce(f"{what} (the quantized weights' probes, each rank "
                                    "its share)", lambda: share(pre_quant=True), list, group), None)


@dataclass
class _Fused:
    """What the quantized layers' rounds (:func:`_fuse_quantized`) hand the metadata round:
    every rank's probes merged (None where no rank probed: then ModelOpt's steps before it
    quantizes run in :func:`plan.quantized.prepare`), ModelOpt's quantization config where
    a rank asked it, and this rank's state where it was resolved there."""

    probes: dict[str, _probes.Probe] | None = None
    config: dict[str, Any] | None = None
    state: dict[str, Any] | None = None


def _merge_shares(shares: list[tuple[dict[str, _probes.Probe] | None,
                                     dict[str, Any] | None]],
                  state: dict[str, Any] | None) -> _Fused:
    """The ranks' shares of the probes as one dict (a weight no share has is probed where it
    is planned), and the config the one rank that asked it sent."""
    if all(probes is None for probes, _config in shares):
        return _Fused(state=state)
    config = next((c for _probes, c in shares if c is not None), None)
    return _Fused({k: v for probes, _c in shares if probes is not None
                   for k, v in probes.items()}, config, state)


def resolve_described(summaries: list[Described], mine: Described, what: str,
                      group: dist.ProcessGroup | None) -> list[Described]:
    """Every rank's Described from the ranks' summaries (the same on every rank): where all
    digests are equal, each rank's keys are this rank's own (nothing more is sent); else
    the keys and ids are exchanged in one more agreed round, which every rank joins (every
    rank sees the same digests)."""
    if all(d.digest == summaries[0].digest for d in summaries):
        tables = [(mine.keys, mine.sig_ids)] * len(summaries)
    else:
        tables = all_reduce(f"{what} (keys)", lambda: (mine.keys, mine.sig_ids), list, group)
    return [Described(keys, ids, d.signatures, d.plan, d.args, d.digest, d.converts)
            for d, (keys, ids) in zip(summaries, tables)]


def _check_args(described: list[Described], ctx: _agree.GroupContext, what: str) -> None:
    """ValueError on every rank alike if the ranks passed different arguments."""
    first = described[0].args
    for name, index in [("dst", None), ("chunk_bytes", None)] + [
            (n, i) for i, (n, _v) in enumerate(first.extra)]:
        if index is None:
            values = [getattr(d.args, name) for d in described]
        else:
            values = [d.args.extra[index][1] for d in described]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {ctx.ranks[r]}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{what}: {name} differs between ranks ({listing}); every rank "
                             f"must pass the same {name}")
