"""A flag that stops every rank's own writes once one rank has failed (``writers="all"``).

Why: with every rank writing, a rank writes its own share -- a GB or a hundred -- between
two rounds that no peer waits on. Its failure (a full disk, a read that fails, Ctrl-C) is
agreed in the round after, so without this its peers would first write their whole shares
into files that are then thrown away: minutes at scale before every rank raises. The
failing rank raises the flag in the process group's store; each rank reads it between two
of its messages (at most every :data:`CHECK_EVERY_S`, or every ``world`` ms where that is
longer: the store, one server, then answers at most ~1000 reads a second), and on seeing it
writes nothing more of its own. It still takes part in every round its peers wait on (the exchange of shared
blocks keeps sending and receiving), so nothing hangs.

Safe by construction: only a rank that will report a failure in the round that agrees the
data raises the flag (its own exception, or an interrupt it defers into that round), so a
rank that stopped writing can never take part in a commit. The key names the export's
stage directory (unique to the call), so a flag left in a long-lived store never touches
another export.
"""

from __future__ import annotations

import time

from distributed_ext import _watch

# How often a writing rank reads the flag, at least: one store round trip (~0.1 ms) each.
CHECK_EVERY_S = 0.05


class StopSignal:
    """The flag of one export (``key``: its stage path; ``world``: the group's size, which
    spaces the reads out). ``interrupts``: the export's
    :class:`~distributed_ext._watch.DeferredInterrupts`, whose pending Ctrl-C counts as
    this rank's failure (raised in the agreeing round) and so raises the flag.

    Threads: :meth:`seen` is called by one writing thread at a time, :meth:`post` from any
    thread, both on the watch's own store connection (:func:`_watch.watch_client`, made
    while the store was alive: never a reconnect to a dead store)."""

    def __init__(self, key: str, world: int,
                 interrupts: _watch.DeferredInterrupts | None = None) -> None:
        self.key = f"distributed_ext/export-stop/{key}"
        self._every = max(CHECK_EVERY_S, world / 1000)
        self._interrupts = interrupts
        self._seen = self._posted = False
        self._next_check = 0.0

    def post(self) -> None:
        """Raises the flag for every rank (best effort: the failure is agreed either way)."""
        self._seen = True
        if self._posted:
            return
        self._posted = True
        try:
            store = _watch.watch_client()
            if store is not None:
                store.set(self.key, "1")
        except Exception:  # noqa: BLE001 - the agreeing round still raises everywhere
            pass

    def seen(self) -> bool:
        """Whether some rank failed (or this one holds an interrupt): stop writing."""
        if self._seen:
            return True
        if self._interrupts is not None and self._interrupts.pending is not None:
            self.post()
            return True
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self._every
        try:
            store = _watch.watch_client()
            if store is None:
                return False
            self._seen = bool(store.check([self.key]))
        except Exception:  # noqa: BLE001 - a store gone: the agreeing round decides
            return False
        return self._seen
