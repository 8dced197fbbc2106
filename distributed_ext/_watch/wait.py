"""Waiting on collective work in a worker thread while the calling thread watches its
peers' liveness: a dead peer is named, a slow one waited for (the rule: the package's
docstring)."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext._watch.endpoint import _probe
from distributed_ext._watch.heartbeat import post_failure, posted_failure
from distributed_ext._watch.interrupts import DeferredInterrupts
from distributed_ext._watch.store import (
    _KEY,
    CHECK_EVERY_S,
    GONE_AFTER_S,
    GRACE_S,
    _refuses,
    _silent_after_s,
    _store_address,
    _store_host_rank,
    watch_client,
)
from distributed_ext._watch.whereabouts import POSTS, Watch, describe_absent


class LocalFailure(Exception):
    """Raised by a worker's body for a failure of this rank's own (not the transport's):
    raised in the caller as ``cause``, with no dead peer to look for."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class PeerFailure(RuntimeError):
    """A transfer with global rank ``rank`` failed: the transport lost that peer."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(f"the transfer with rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause


class _Liveness:
    """Tells dead peers from slow ones: see the module docstring for the rule."""

    def __init__(self, ranks: list[int]) -> None:
        # A connection of our own, made while the store was alive: reads that no blocked
        # store call of another thread holds up, and no reconnecting to a dead store.
        self.store = watch_client()
        me = dist.get_rank() if dist.is_initialized() else -1
        self.ranks = [r for r in ranks if r != me]
        self.seen: dict[int, tuple[bytes, float]] = {}
        self.verdicts: dict[int, str] = {}  # rank -> why it is named dead
        self.silent_after = _silent_after_s(strict=False)

    def dead(self) -> list[int]:
        """Peers named dead now (gone, or silent past the limit), the longest silent first
        (one a peer already named, first of all)."""
        if self.store is None:
            return []
        now = time.monotonic()
        out: list[tuple[float, int]] = []
        for r in self.ranks:
            key = _KEY + str(r)
            try:
                if not self.store.check([key]):
                    continue  # never beat: not yet in a collective of ours, not known dead
                value = self.store.get(key)
            except Exception:
                # The store itself is unreachable: its host is gone. Where that host is a
                # peer (rank 0 under tcp:// or env:// without torchrun) and its port now
                # refuses connections, that peer's process is gone: named. Else (torchrun's
                # agent, another host) there is no way to tell; the transport decides.
                return self._store_host_gone()
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
                continue
            stalled = now - last[1]
            if stalled < GONE_AFTER_S:
                continue
            if stalled >= self.silent_after:
                self.verdicts[r] = (
                    f"it has been silent for {stalled:.0f} s: no heartbeat, and its process "
                    "is stopped, starved or on a host that cannot be reached (the limit is "
                    f"DISTRIBUTED_EXT_SILENT_AFTER_S={self.silent_after:g} s)")
                out.append((last[1], r))
            elif _probe(self.store, r) == "gone":
                self.verdicts[r] = (f"its process is gone: its heartbeat stopped {stalled:.1f} s "
                                    "ago and its liveness endpoint is closed")
                out.append((last[1], r))
        posted = posted_failure() if out else None
        return [r for _t, r in sorted(out, key=lambda e: (posted is None or e[1] != posted[0], e))]

    def _store_host_gone(self) -> list[int]:
        host = _store_host_rank()
        address = _store_address(self.store)
        if host is None or host not in self.ranks or address is None or not _refuses(address):
            return []
        self.verdicts[host] = (f"its process is gone: the process group's store it hosted "
                               f"({address[0]}:{address[1]}) refuses connections")
        return [host]

    def why(self, rank: int) -> str:
        return self.verdicts.get(rank, "its heartbeat stopped")


_DONE = object()


@dataclass
class _Worker:
    body: Callable[[_Worker], None]
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    error: BaseException | None = None

    def report(self, progress: int) -> None:
        """Called by ``body``: hands a progress value to the waiting thread (in order)."""
        self.events.put(progress)

    def run(self) -> None:
        try:
            self.body(self)
        except BaseException as exc:  # carried to the waiting thread
            self.error = exc
        finally:
            self.events.put(_DONE)


def run_watched(
    body: Callable[[Any], None],
    ranks: list[int],
    what: str,
    on_progress: Callable[[int], None] | None = None,
) -> BaseException | None:
    """Runs ``body(worker)`` in a worker thread; the calling thread waits, watching ``ranks``.

    ``body`` posts and waits for the work of one step (it is never interrupted, so it always
    waits for everything it posted) and may call ``worker.report(progress)``. While it runs,
    the calling thread calls ``on_progress(progress)`` for each report, in order, and from
    ``GRACE_S`` on checks the liveness of ``ranks`` (global ranks).

    Returns:
        The first exception ``on_progress`` raised (it is never called again after one), so
        that the caller can carry it to every rank; None if none.

    Raises:
        RuntimeError: a rank of ``ranks`` died (named), the group is unusable.
        PeerFailure: from ``body``, as raised there; any other exception of ``body`` too.
        KeyboardInterrupt: a second interrupt during this wait, or one outside any
            :class:`DeferredInterrupts` block once the work is done.
    """
    worker = _Worker(body)
    thread = threading.Thread(target=worker.run, name=f"distributed_ext {what}", daemon=True)
    thread.start()
    error, callback_error, liveness = _await(worker.events, lambda: worker.error, ranks, what,
                                             on_progress)
    if error is not None:
        _raise_worker_error(error, liveness, ranks, what)
    return callback_error


def _await(events: queue.SimpleQueue, error_of: Callable[[], BaseException | None] | None,
           ranks: list[int], what: str, on_progress: Callable[[int], None] | None
           ) -> tuple[BaseException | None, BaseException | None, _Liveness | None]:
    """Waits for ``_DONE`` on ``events`` while watching ``ranks``; see :func:`run_watched`.

    Returns:
        ``(the worker's error, the progress callback's first error, the liveness watch if one
        started)`` -- the watch's observations let a later attribution start from them.
    """
    note = POSTS.enter(ranks, what)  # (where this rank is, for its peers' watches)
    try:
        return _await_posted(events, error_of, ranks, what, on_progress, note)
    finally:
        POSTS.leave(note)


def _await_posted(events: queue.SimpleQueue, error_of: Callable[[], BaseException | None] | None,
                  ranks: list[int], what: str, on_progress: Callable[[int], None] | None,
                  note: Any) -> tuple[BaseException | None, BaseException | None,
                                      _Liveness | None]:
    deferral = DeferredInterrupts.current()
    interrupt: BaseException | None = None
    callback_error: BaseException | None = None
    start = time.monotonic()
    liveness: _Liveness | None = None
    watch: Watch | None = None  # (the peers' whereabouts: a mismatch, the absent named)
    next_check = start + GRACE_S
    finished = False
    while not finished:
        try:
            try:
                event = events.get(timeout=CHECK_EVERY_S)
            except queue.Empty:
                event = None
            while event is not None:
                if event is _DONE:
                    finished = True
                elif on_progress is not None and callback_error is None:
                    try:
                        on_progress(event)
                    except BaseException as exc:  # noqa: BLE001 - carried, never escapes mid-transfer
                        callback_error = exc
                try:
                    event = events.get_nowait()
                except queue.Empty:
                    event = None
            if finished:
                break
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_EVERY_S
                if liveness is None:
                    liveness = _Liveness(ranks)
                dead = liveness.dead()
                if dead:
                    post_failure(dead[0], liveness.why(dead[0]))
                    raise RuntimeError(_dead_message(what, dead, liveness,
                                                     " while this rank waited for it"))
                if watch is None:
                    watch = Watch(ranks, note, what, start)
                watch.check(now)
        except (KeyboardInterrupt, SystemExit) as exc:
            if interrupt is not None or DeferredInterrupts.any_pending():
                raise  # a second interrupt: leave now, the work stays with its thread
            interrupt = exc
            sys.stderr.write(
                f"distributed_ext: {type(exc).__name__} during {what}; finishing the posted "
                "transfers first so that no peer is left waiting (interrupt again to leave "
                "now)\n"
            )
    if interrupt is not None:
        if deferral is None:
            raise interrupt
        if deferral.pending is None:
            deferral.pending = interrupt
    return (error_of() if error_of is not None else None), callback_error, liveness


def _raise_worker_error(error: BaseException, liveness: _Liveness | None, ranks: list[int],
                        what: str) -> None:
    """Raises ``error``, naming the dead rank behind a transport error where one is found."""
    if isinstance(error, LocalFailure):
        raise error.cause
    if isinstance(error, PeerFailure) or not isinstance(error, RuntimeError):
        raise error  # not a transport error (gloo's are RuntimeErrors): nothing to attribute
    # A transport error names an address at best; find the rank whose death caused it:
    # one a peer already named, else one whose heartbeat stops.
    posted = posted_failure()
    if posted is not None:
        dead_rank, reporter, reason = posted
        raise RuntimeError(
            f"{what}: rank {dead_rank} died or failed (rank {reporter} saw: {reason}); "
            f"the process group can no longer be used -- the job must stop (here the "
            f"transport said: {error})"
        ) from error
    liveness = liveness or _Liveness(ranks)
    dead = _attribute(liveness)
    if dead:
        post_failure(dead[0], liveness.why(dead[0]))
        raise RuntimeError(_dead_message(what, dead, liveness, "") + f" (the transport said: "
                           f"{error})") from error
    if "timed out" in str(error).lower() or "timeout" in str(error).lower():
        # Every peer alive: the wait outlasted the group's timeout for ranks that never came.
        absent = describe_absent(ranks, what)
        raise RuntimeError(
            f"{what}: the process group's timeout passed while this rank waited"
            + (f" for {absent}" if absent else "") + "; every rank must make the same calls "
            f"of distributed_ext in the same order (the transport said: {error})") from error
    raise error


def _dead_message(what: str, dead: list[int], liveness: _Liveness, when: str) -> str:
    return (
        f"{what}: rank {dead[0]} died ({liveness.why(dead[0])}{when})"
        + (f"; ranks {dead} are all dead or silent" if len(dead) > 1 else "")
        + "; the process group can no longer be used -- the job must stop"
    )


def _attribute(liveness: _Liveness) -> list[int]:
    """The peers found gone within one staleness window (empty: nobody is known dead)."""
    deadline = time.monotonic() + GONE_AFTER_S + 3 * CHECK_EVERY_S
    while True:
        dead = liveness.dead()
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(CHECK_EVERY_S)


def wait_work(work: Any, ranks: list[int], what: str, device: torch.device | None = None) -> None:
    """Waits for one collective ``work`` object (``async_op=True``), watching ``ranks``.

    On a CUDA device the wait also synchronizes, so that the result can be read on the host.
    """
    if device is None or device.type != "cuda":
        # gloo collectives complete a future from gloo's own thread: wait on that, with no
        # thread of ours to start (a status round takes a few hundred microseconds).
        try:
            future = work.get_future()
        except RuntimeError:
            future = None
        if future is not None:
            events: queue.SimpleQueue = queue.SimpleQueue()
            future.add_done_callback(lambda _f: events.put(_DONE))
            error, _callback_error, liveness = _await(events, None, ranks, what, None)
            if error is None:
                try:
                    work.wait()  # complete by now: returns at once, or raises its error
                except BaseException as exc:  # noqa: BLE001 - named below where possible
                    error = exc
            if error is not None:
                _raise_worker_error(error, liveness, ranks, what)
            return

    def body(_worker: Any) -> None:
        work.wait()
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    run_watched(body, ranks, what)
