"""Collectives that fail together: every rank agrees on every rank's status before data moves.

A stage that can fail on one rank first runs locally, then every rank joins one small
collective (an all-gather, or a broadcast from the only rank that runs the stage) of a
fixed-size status record: ok / error / exit, the error's type and message, a label (its digest,
which is compared, and a clipped copy, which is shown), and a few integers (sizes). Only if
every rank is ok does data move. A failure therefore travels as data
and every rank raises, the failing rank its own error and the others a RuntimeError naming the
first cause (torch ``collective_utils`` style); no rank waits in a collective its peers skipped,
and the group stays usable afterwards.

The record is plain bytes (struct-packed), never pickle, so the same machinery serves the
transports that promise never to unpickle (gather_bytes). Every wait here goes through
:mod:`distributed_ext._watch`, so a dead peer is named instead of waited for. This module
holds the protocol (records, status rounds, raising alike) and the group context only; the
data rounds belong to the collectives that move data.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distributed_ext import _watch

OK, ERROR, EXIT = 0, 1, 2
RECORD_BYTES = 2048
N_FIELDS = 8
_MAGIC = b"DXS1"
_DIGEST_BYTES = 16
_HEADER = struct.Struct(f"<4sBq{N_FIELDS}q{_DIGEST_BYTES}sHHH")
_MAX_LABEL, _MAX_TYPE, _MAX_MESSAGE = 256, 128, 1024


def _clip(text: str, limit: int) -> bytes:
    """``text`` as UTF-8 of at most ``limit`` bytes, for display (lone surrogates escaped)."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= limit:
        return raw
    return raw[: limit - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."


def label_digest(label: str) -> bytes:
    """What ranks compare for a label: a digest of all of it, whatever its length or characters."""
    return hashlib.blake2b(label.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES).digest()


def _safe_text(obj: object, how: Callable[[object], str]) -> str | None:
    try:
        text = how(obj)
    except BaseException:  # noqa: BLE001 - an exception whose __str__ raises still travels
        return None
    return text if isinstance(text, str) else None


def describe_exception(exc: BaseException) -> str:
    """``str(exc)``, or ``repr(exc)``, or a placeholder if both raise (never raises)."""
    text = _safe_text(exc, str)
    if text is None:
        text = _safe_text(exc, repr)
    if text is None:
        text = f"<{type(exc).__name__} whose str() and repr() raise>"
    return text


@dataclass
class Status:
    """One rank's status in a stage. ``exc`` stays local; the rest travels."""

    kind: int = OK
    code: int = 0
    fields: tuple[int, ...] = (0,) * N_FIELDS
    label: str = ""
    error_type: str = ""
    message: str = ""
    exc: BaseException | None = field(default=None, repr=False, compare=False)
    digest: bytes = b""  # of the label; computed from it when not given (a decoded record's)

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = label_digest(self.label)

    @property
    def ok(self) -> bool:
        return self.kind == OK

    @classmethod
    def failed(cls, exc: BaseException, label: str = "") -> Status:
        """The status of a stage that raised ``exc`` (SystemExit becomes an exit record).

        Any BaseException is carried (KeyboardInterrupt, CancelledError, GeneratorExit), and
        one whose ``__str__`` raises is described without calling it again.
        """
        if isinstance(exc, SystemExit):
            code = exc.code
            if code is None:
                number, message = 0, ""
            elif isinstance(code, int) and -(2**63) <= code < 2**63:
                number, message = code, ""
            else:  # sys.exit("message") exits with 1 and prints the message
                number, message = 1, _safe_text(code, str) or "<unprintable exit code>"
            return cls(EXIT, number, label=label, error_type="SystemExit", message=message,
                       exc=exc)
        return cls(ERROR, 0, label=label, error_type=type(exc).__name__,
                   message=describe_exception(exc), exc=exc)

    def describe(self) -> str:
        if self.kind == EXIT:
            return f"SystemExit({self.code})"
        return f"{self.error_type}: {self.message}" if self.message else self.error_type

    def encode(self) -> torch.Tensor:
        fields = tuple(self.fields) + (0,) * (N_FIELDS - len(self.fields))
        label = _clip(self.label, _MAX_LABEL)
        etype = _clip(self.error_type, _MAX_TYPE)
        message = _clip(self.message, _MAX_MESSAGE)
        head = _HEADER.pack(_MAGIC, self.kind, self.code, *fields, self.digest, len(label),
                            len(etype), len(message))
        record = bytearray(RECORD_BYTES)
        blob = head + label + etype + message
        record[: len(blob)] = blob
        return torch.frombuffer(record, dtype=torch.uint8)

    @classmethod
    def decode(cls, record: bytes) -> Status:
        if len(record) != RECORD_BYTES or record[:4] != _MAGIC:
            raise ValueError("status record from a peer is malformed (wrong size or magic); "
                             "are all ranks running the same distributed_ext?")
        magic, kind, code, *rest = _HEADER.unpack_from(record)
        fields, digest = tuple(rest[:N_FIELDS]), rest[N_FIELDS]
        n_label, n_type, n_msg = rest[N_FIELDS + 1 :]
        if kind not in (OK, ERROR, EXIT) or _HEADER.size + n_label + n_type + n_msg > RECORD_BYTES:
            raise ValueError("status record from a peer is malformed (kind or lengths)")
        pos = _HEADER.size
        label = record[pos : pos + n_label].decode("utf-8", "replace")
        pos += n_label
        etype = record[pos : pos + n_type].decode("utf-8", "replace")
        pos += n_type
        message = record[pos : pos + n_msg].decode("utf-8", "replace")
        return cls(kind, code, fields, label, etype, message, digest=digest)

    def same_label(self, other: Status) -> bool:
        """Whether two records carry the same label (compared by digest, never clipped)."""
        return self.digest == other.digest


@dataclass
class GroupContext:
    """Where a collective runs: the group, its members' global ranks, and the tensor device."""

    group: dist.ProcessGroup | None
    rank: int  # this process's rank in the group
    ranks: list[int]  # global rank of each group rank
    device: torch.device

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def group_rank_of(self, global_rank: int) -> int | None:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            return None


def resolve_backends(group: dist.ProcessGroup | None) -> tuple[bool, bool]:
    """``(has a CPU backend, has NCCL)`` for ``group``, read once from its backend string.

    ``gloo`` -> (True, False); ``nccl`` -> (False, True); ``cpu:gloo,cuda:nccl`` -> (True,
    True); anything else (mpi, ucc, a custom backend) counts as a CPU one.
    """
    name = str(dist.get_backend(group)).lower()
    has_nccl = "nccl" in name and torch.cuda.is_available()
    has_cpu = "gloo" in name or "mpi" in name or "nccl" not in name
    return has_cpu, has_nccl


def resolve_collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """CPU tensors where the group has a CPU backend (incl. ``cpu:gloo,cuda:nccl``), else the GPU."""
    has_cpu, _ = resolve_backends(group)
    return torch.device("cpu") if has_cpu else torch.device("cuda", torch.cuda.current_device())


def group_has_nccl(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` can move CUDA tensors with NCCL (``nccl`` or ``cpu:gloo,cuda:nccl``)."""
    return resolve_backends(group)[1]


def resolve_group(group: dist.ProcessGroup | None, what: str) -> GroupContext:
    """The GroupContext of ``group`` for this process; ValueError if it is not a member."""
    me = dist.get_rank(group=group)
    if me < 0:
        raise ValueError(
            f"{what}: this process (global rank {dist.get_rank()}) is not a member of the "
            "group passed; only the group's members call a collective on it"
        )
    if group is None:
        ranks = list(range(dist.get_world_size()))
    else:
        ranks = list(dist.get_process_group_ranks(group))
    _watch.ensure_heartbeat()
    return GroupContext(group, me, ranks, resolve_collective_device(group))


def exchange(status: Status, ctx: GroupContext, what: str = "distributed_ext") -> list[Status]:
    """All-gathers every rank's status record; returns them in group rank order."""
    mine = status.encode().to(ctx.device)
    out = [torch.empty_like(mine) for _ in range(ctx.size)]
    _watch.POSTS.begin_round(ctx.ranks, what)  # (a point every rank of the group passes)
    work = dist.all_gather(out, mine, group=ctx.group, async_op=True)
    _watch.wait_work(work, ctx.ranks, f"{what} (status round)", ctx.device)
    return [Status.decode(bytes(tensor_bytes(t))) for t in out]


def agree(what: str, ctx: GroupContext, step: Callable[[], tuple[int, ...] | None] | None = None,
          *, stage: str = "", failure: BaseException | None = None,
          via: GroupContext | None = None, cleanup: Callable[[], None] | None = None
          ) -> list[Status]:
    """One agreed round, the skeleton of every collective here: runs ``step`` on this rank
    (or takes ``failure``, one already caught), carries the outcome -- success, with the
    ``fields`` the step returned, or any BaseException -- to every rank, and raises the first
    failure on every rank alike (:func:`raise_first_failure`, labelled ``what (stage)``),
    after running ``cleanup`` here (a peer lost in the round included).

    Args:
        what: The calling collective's name (its watch and error labels).
        ctx: The group.
        step: This rank's work in the round; None: only ``failure`` is agreed.
        stage: Names the round in the error (``"allocating"``, ``"transfer"``).
        failure: A failure of this rank's to carry (with no ``step``).
        via: The context whose device the records travel on (default ``ctx``).
        cleanup: Undoes this rank's part before it raises (frees buffers, removes files).

    Returns:
        Every rank's status, in group rank order, once every rank succeeded.
    """
    label = f"{what} ({stage})" if stage else what
    if step is not None:
        try:
            fields = step()
            status = Status(label=label) if fields is None else Status(fields=fields, label=label)
        except BaseException as exc:  # noqa: BLE001 - carried to every rank, raised below
            status = Status.failed(exc, label)
    else:
        status = Status(label=label) if failure is None else Status.failed(failure, label)
    try:
        statuses = exchange(status, via or ctx, what)
        raise_different_rounds(statuses, ctx, status)
        raise_first_failure(label, statuses, ctx, status)
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise
    return statuses


def raise_different_rounds(statuses: list[Status], ctx: GroupContext, own: Status) -> None:
    """RuntimeError on every rank where the ranks' records come from different rounds (the
    label of each -- its call and stage -- differs): ranks in different calls at the same
    point, naming both; the record's fields mean nothing to each other then."""
    other = next((i for i, s in enumerate(statuses) if not s.same_label(own)), None)
    if other is None:
        return
    raise RuntimeError(
        f"{own.label}: ranks are in different calls of distributed_ext at the same point: "
        f"rank {ctx.global_rank} in {own.label!r}, rank {ctx.ranks[other]} in "
        f"{statuses[other].label!r}; every rank must make the same calls in the same order"
    ) from own.exc


def broadcast_status(status: Status | None, src: int, ctx: GroupContext,
                     what: str = "distributed_ext") -> Status:
    """Broadcasts the status record of global rank ``src`` (pass it there, None elsewhere)."""
    if status is not None:
        record = status.encode().to(ctx.device)
    else:
        record = torch.empty(RECORD_BYTES, dtype=torch.uint8, device=ctx.device)
    _watch.POSTS.begin_round(ctx.ranks, what)
    work = dist.broadcast(record, src=src, group=ctx.group, async_op=True)
    _watch.wait_work(work, ctx.ranks, f"{what} (status round)", ctx.device)
    return Status.decode(bytes(tensor_bytes(record)))


def tensor_bytes(t: torch.Tensor) -> bytearray:
    """The bytes of a uint8 tensor (any device) as a new bytearray."""
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(t.reshape(-1))
    return out


def peer_failure_error(what: str, exc: _watch.PeerFailure) -> RuntimeError:
    """The RuntimeError every transport raises for a lost peer, naming the root cause.

    If another rank was already posted dead (:func:`_watch.post_failure`), this peer most
    likely left after seeing that death: the posted rank is named first. Else this peer is
    posted, so that the other survivors name it.
    """
    cause = describe_exception(exc.cause)
    posted = _watch.posted_failure()
    if posted is not None and posted[0] != exc.rank:
        dead, reporter, reason = posted
        error = RuntimeError(
            f"{what}: rank {dead} died or failed (rank {reporter} saw: {reason}); then the "
            f"transfer with rank {exc.rank} failed too ({cause}); the process group can no "
            "longer be used -- the job must stop")
    else:
        _watch.post_failure(exc.rank, f"its transfer failed: {cause}")
        error = RuntimeError(
            f"{what}: the transfer with rank {exc.rank} failed mid-transfer ({cause}); rank "
            f"{exc.rank} died or lost its connection, and the process group can no longer be "
            "used -- the job must stop")
    return error


def raise_first_failure(what: str, statuses: list[Status], ctx: GroupContext,
                        own: Status) -> None:
    """Raises on this rank if any rank failed, the same way on every rank.

    If any rank's failure is an error (not a SystemExit), a rank with such an error re-raises
    its own and every other rank raises a RuntimeError naming the first one (in group rank
    order). Else, if some ranks exited, every rank exits: a rank that exited with its own
    SystemExit, the others with the first one's code.
    """
    failed = [(i, s) for i, s in enumerate(statuses) if not s.ok]
    if not failed:
        return
    errors = [(i, s) for i, s in failed if s.kind == ERROR]
    if errors:
        if own.kind == ERROR and own.exc is not None:
            raise own.exc
        first_rank, first = errors[0]
        raise RuntimeError(
            f"{what}: rank {ctx.ranks[first_rank]} failed with {first.describe()}; "
            f"every rank raises so that none waits in a collective that rank never joins"
            + (f" ({len(errors)} ranks failed)" if len(errors) > 1 else "")
        )
    if own.kind == EXIT and own.exc is not None:
        raise own.exc
    first_rank, first = failed[0]
    raise SystemExit(first.code)
