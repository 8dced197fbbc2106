"""Where each rank is: its current call of ours, posted in the store it beats in, so that a
rank waiting for peers can say where each absent one is -- in which of our calls, or in none
of ours since when -- and can tell a peer in a *different* call at the same point (a
mismatch: both raise at once) from a late one (a warning every ``WARN_EVERY_S`` while it
waits; the peer is never called dead for being late).

The *point* of a wait is the number of status rounds this process has begun on the wait's
group (every rank of a group joins every status round of ours on it, in the same order) and
the call whose round that was. Each watched wait posts ``in`` with its point on entry and
``out`` with the time on exit; the note travels with the native heartbeat's next beat (at
most ``HEARTBEAT_INTERVAL_S`` later, never a store call on the caller's path).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from distributed_ext import _native
from distributed_ext._watch.store import env_seconds, watch_client

_NOTE_KEY = "distributed_ext/where-call/"
_SEP = "\x1f"
# A peer at our point in another call for this long (its note unchanged) is a mismatch.
MISMATCH_AFTER_S = 3.0
# How often a stalled wait reads its peers' notes (from MISMATCH_AFTER_S on).
LOOK_EVERY_S = 1.0

_log = logging.getLogger("distributed_ext")


def _warn_every_s(strict: bool = True) -> float | None:
    """``DISTRIBUTED_EXT_WAIT_WARNING_S``: seconds between a waiting rank's warnings naming
    its absent peers (default 30; ``0`` or ``off`` turns them off: None); read as
    :func:`~distributed_ext._watch.store.env_seconds`."""
    raw = os.environ.get("DISTRIBUTED_EXT_WAIT_WARNING_S", "30").strip()
    if raw.lower() in ("0", "off", "none", "false", "no"):
        return None
    return env_seconds("DISTRIBUTED_EXT_WAIT_WARNING_S", 30.0,
                       lambda v: 0 < v < float("inf"),
                       "a positive number of seconds between warnings about absent ranks, or "
                       "0/off for none", strict)


WARN_EVERY_S = _warn_every_s()


def group_key(ranks: list[int]) -> str:
    """A short name of a group by its members' global ranks (the same on every member)."""
    return _group_key(tuple(ranks))


@functools.lru_cache(maxsize=64)
def _group_key(ranks: tuple[int, ...]) -> str:
    # (cached: asked at every wait's entry and status round, the ranks of a world of 1000s)
    return hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()


@dataclass
class Note:
    """One rank's whereabouts as posted: ``state`` "in" a wait of ours (``what``) at ``count``
    status rounds begun on group ``group``, whose last was ``call``; or "out" of every wait
    of ours since ``since`` (wall clock), the last having been ``what``."""

    version: int
    state: str
    group: str
    count: int
    call: str
    what: str
    since: float

    def encode(self) -> str:
        return _SEP.join((str(self.version), self.state, self.group, str(self.count),
                          self.call, self.what, repr(self.since)))

    @classmethod
    def decode(cls, raw: bytes) -> Note | None:
        """The note, or None for a value that is not one (checked field by field)."""
        parts = raw.decode("utf-8", "replace").split(_SEP)
        if len(parts) != 7 or parts[1] not in ("in", "out"):
            return None
        try:
            return cls(int(parts[0]), parts[1], parts[2], int(parts[3]), parts[4], parts[5],
                       float(parts[6]))
        except ValueError:
            return None


class _Posts:
    """This process's points and its posted note (thread-safe: waits run on several
    threads; the outermost wait's entry and exit are posted)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[str, tuple[int, str]] = {}
        self.version = 0
        self.depth = 0

    def begin_round(self, ranks: list[int], call: str) -> None:
        with self.lock:
            key = group_key(ranks)
            count, _call = self.rounds.get(key, (0, ""))
            self.rounds[key] = (count + 1, call)

    def point(self, ranks: list[int]) -> tuple[str, int, str]:
        with self.lock:
            key = group_key(ranks)
            count, call = self.rounds.get(key, (0, ""))
            return key, count, call

    def enter(self, ranks: list[int], what: str) -> Note:
        key, count, call = self.point(ranks)
        with self.lock:
            self.depth += 1
            self.version += 1
            note = Note(self.version, "in", key, count, call, what, time.time())
            if self.depth == 1:
                self._post(note)
            return note

    def leave(self, note: Note) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.version += 1
                self._post(Note(self.version, "out", note.group, note.count, note.call,
                                note.what, time.time()))

    @staticmethod
    def _post(note: Note) -> None:
        if dist.is_available() and dist.is_initialized():
            _native.set_heartbeat_note(_NOTE_KEY + str(dist.get_rank()), note.encode())


POSTS = _Posts()


def read_notes(ranks: list[int]) -> dict[int, Note | None]:
    """Each of ``ranks``' posted note (None: it has posted none, i.e. never waited in a call
    of ours; or the store cannot be read)."""
    store = watch_client()
    out: dict[int, Note | None] = {}
    for r in ranks:
        key = _NOTE_KEY + str(r)
        try:
            out[r] = Note.decode(store.get(key)) if store is not None and \
                store.check([key]) else None
        except Exception:  # noqa: BLE001 - a store that is gone: nothing to say
            out[r] = None
    return out


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.1f} min ago"


def where(rank: int, note: Note | None, mine: Note) -> str:
    """Where ``rank`` is, for a message: in which call of ours, or in none since when."""
    if note is None:
        return f"rank {rank} has not waited in any call of distributed_ext yet"
    if note.state == "out":
        return (f"rank {rank} is in none of distributed_ext's calls since "
                f"{_ago(time.time() - note.since)} (its last: {note.what})")
    if note.group != mine.group:
        return f"rank {rank} is in {note.what} on another group"
    return f"rank {rank} is in {note.what}"


def joined(note: Note | None, mine: Note) -> bool:
    """Whether a peer has reached (or passed) this wait's point on its group."""
    return note is not None and note.group == mine.group and (
        note.count > mine.count or (note.count == mine.count and note.state == "in"))


class Watch:
    """What a stalled wait (``mine``: its note) says of its peers: :meth:`check` raises a
    mismatch and logs the absent ranks every ``WARN_EVERY_S``; :meth:`absent` describes
    them for an error."""

    def __init__(self, ranks: list[int], mine: Note, what: str, start: float) -> None:
        me = dist.get_rank() if dist.is_initialized() else -1
        self.peers = [r for r in ranks if r != me]
        self.mine, self.what, self.start = mine, what, start
        self.warn_every = _warn_every_s(strict=False)
        self.next_warn = start + self.warn_every if self.warn_every else float("inf")
        self.next_look = start + MISMATCH_AFTER_S
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (note version, first seen)

    def check(self, now: float) -> None:
        """Reads the peers' notes when due; RuntimeError for a peer in another call at this
        point for ``MISMATCH_AFTER_S``; a warning naming the absent ones when due."""
        if now < self.next_look and now < self.next_warn:
            return
        self.next_look = now + LOOK_EVERY_S
        notes = read_notes(self.peers)
        for r, note in notes.items():
            if note is None or note.state != "in" or note.group != self.mine.group or \
                    note.count != self.mine.count or note.call == self.mine.call:
                self.seen.pop(r, None)
                continue
            version, first = self.seen.setdefault(r, (note.version, now))
            if version != note.version:
                self.seen[r] = (note.version, now)
            elif now - first >= MISMATCH_AFTER_S:
                raise RuntimeError(
                    f"{self.what}: ranks are in different calls of distributed_ext at the same "
                    f"point: rank {dist.get_rank()} in {self.mine.call}, rank {r} in "
                    f"{note.call}; every rank must make the same calls in the same order "
                    "(the process group can no longer be used -- the job must stop)")
        if now >= self.next_warn:
            self.next_warn = now + (self.warn_every or float("inf"))
            absent = self.absent(notes)
            if absent:
                _log.warning("distributed_ext: %s has waited %.0f s for %s (set "
                             "DISTRIBUTED_EXT_WAIT_WARNING_S to change how often this is "
                             "said, 0 to silence it)", self.what, now - self.start, absent)

    def absent(self, notes: dict[int, Note | None] | None = None) -> str:
        """The peers that have not reached this wait's point, and where each is ("" if none)."""
        notes = read_notes(self.peers) if notes is None else notes
        late = [(r, n) for r, n in notes.items() if not joined(n, self.mine)]
        if not late:
            return ""
        ranks = [r for r, _n in late]
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, not in "
                "this call: " + "; ".join(where(r, n, self.mine) for r, n in late))


def describe_absent(ranks: list[int], what: str) -> str:
    """:meth:`Watch.absent` for an error raised once a wait ended (a transport's timeout):
    the peers that have not reached this process's current point on the group."""
    group, count, call = POSTS.point(ranks)
    mine = Note(0, "in", group, count, call, what, time.time())
    try:
        return Watch(ranks, mine, what, time.monotonic()).absent()
    except Exception:  # noqa: BLE001 - an error message must not fail for want of a store
        return ""
