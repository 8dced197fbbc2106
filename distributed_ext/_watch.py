"""Waiting on collective work without hanging: dead peers are named, interrupts are deferred.

A rank that waits in ``work.wait()`` for a peer that died waits out the process group's
timeout (30 min by default) on gloo whenever the transport does not notice the death itself
(a sender whose receiver was killed, say). Here the waiting happens in a worker thread while
the calling thread watches:

- **Liveness.** Every rank that uses a collective of this package beats a counter in the
  process group's own store from a native thread (``csrc/heartbeat.cpp``: no GIL, so a busy
  rank still beats). A wait that lasts longer than ``GRACE_S`` reads its peers' counters every
  ``CHECK_EVERY_S``; a peer whose counter has not moved for ``DEAD_AFTER_S`` is dead, and the
  waiting rank raises a RuntimeError naming it, well before any process-group timeout. A peer
  that has never beaten (it has not reached its first collective yet) is never called dead.
  Cost: nothing for a wait shorter than the grace; then one store read per peer per check.
- **Interrupts.** A Ctrl-C during a collective is deferred wherever it lands (the main
  thread's SIGINT handler records it; a KeyboardInterrupt, or any exception a signal handler
  raises, that arrives while the calling thread waits is caught there): the posted work is
  still waited for, so no peer is left blocked in a transfer and no buffer a transfer writes
  into is freed. The collective then carries it to every rank as its failure (see
  :class:`DeferredInterrupts`). A second interrupt leaves at once (the escape hatch when
  something else hangs).

Work still pending when a dead peer is named stays referenced by its (daemon) worker thread,
so the memory it reads or writes is never freed under it; the group is unusable by then.
"""

from __future__ import annotations

import atexit
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed_ext import _native

__all__ = [
    "CHECK_EVERY_S",
    "DEAD_AFTER_S",
    "GRACE_S",
    "DeferredInterrupts",
    "PeerFailure",
    "ensure_heartbeat",
    "post_failure",
    "posted_failure",
    "run_watched",
    "wait_work",
]

HEARTBEAT_INTERVAL_S = 0.5
GRACE_S = 1.0
CHECK_EVERY_S = 0.5
DEAD_AFTER_S = 4.0
_KEY = "distributed_ext/alive/"
_FAILED_KEY = "distributed_ext/failed"

_atexit_registered = False


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without it: no liveness, plain waits
        return None


def ensure_heartbeat() -> None:
    """Starts this process's heartbeat into the default group's store (idempotent, cheap)."""
    global _atexit_registered
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _default_store()
    if store is None:
        return
    _native.start_heartbeat(store, _KEY + str(dist.get_rank()), int(HEARTBEAT_INTERVAL_S * 1000))
    if not _atexit_registered:
        # Stop the native thread before the interpreter (and torch's statics) go away.
        atexit.register(_native.stop_heartbeat)
        _atexit_registered = True


def post_failure(rank: int, reason: str) -> None:
    """Tells every rank, through the store, that ``rank`` died or failed (the first post wins).

    A rank whose own transfer then breaks -- because the rank that saw the death raised and
    left -- names the root cause from this post instead of the peer that merely left after it.
    Read only once a transfer has already failed (:func:`posted_failure`), so a post left in a
    long-lived store can at worst rename a failure, never cause one.
    """
    store = _default_store()
    if store is None:
        return
    me = dist.get_rank() if dist.is_initialized() else -1
    value = f"{rank}:{me}:{reason[:300]}"
    try:
        store.compare_set(_FAILED_KEY, "", value)
    except Exception:  # noqa: BLE001 - best effort: the caller raises either way
        pass


def posted_failure() -> tuple[int, int, str] | None:
    """``(dead rank, reporting rank, reason)`` posted by :func:`post_failure`, if any."""
    store = _default_store()
    if store is None:
        return None
    try:
        if not store.check([_FAILED_KEY]):
            return None
        raw = store.get(_FAILED_KEY).decode("utf-8", "replace")
        rank, reporter, reason = raw.split(":", 2)
        return int(rank), int(reporter), reason
    except Exception:  # noqa: BLE001 - a store that is gone, or a value not ours
        return None


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
    """Tells dead peers from slow ones by whether their heartbeat counters move."""

    def __init__(self, ranks: list[int]) -> None:
        self.store = _default_store()
        me = dist.get_rank() if dist.is_initialized() else -1
        self.ranks = [r for r in ranks if r != me]
        self.seen: dict[int, tuple[bytes, float]] = {}

    def dead(self) -> list[int]:
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
                # The store itself is unreachable: its host (rank 0's node, or the launcher)
                # is gone, and with it any way to tell; the transport's own errors decide.
                return []
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
            elif now - last[1] >= DEAD_AFTER_S:
                out.append((last[1], r))
        # The one silent longest first; a rank a peer already named dead before all others.
        posted = posted_failure() if out else None
        return [r for _t, r in sorted(out, key=lambda e: (posted is None or e[1] != posted[0], e))]


class DeferredInterrupts:
    """Collects interrupts that arrive during a collective; delivered when it is done.

    Use as a context manager around a whole collective. Inside it, a Ctrl-C is recorded
    instead of raised, wherever it lands: in the main thread, with Python's default SIGINT
    handler, the outermost block installs a handler that records it (a KeyboardInterrupt
    raised between two rounds -- starting a thread, say -- would leave this rank one round
    ahead of its peers); elsewhere, waits (``run_watched``) catch it. A collective with a
    status round still ahead folds :meth:`take` into that round (every rank then raises);
    whatever is left is raised on leaving the block, once every rank has finished the
    collective's rounds. A second Ctrl-C while one is pending leaves at once.
    """

    _local = threading.local()

    def __init__(self) -> None:
        self.pending: BaseException | None = None
        self._previous_handler: Any = None

    def __enter__(self) -> DeferredInterrupts:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if not stack and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handler = signal.signal(signal.SIGINT, _record_sigint)
        stack.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        stack = self._local.stack
        stack.pop()
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None
        if exc is None and self.pending is not None:
            pending, self.pending = self.pending, None
            if stack:  # nested in a larger collective: it decides when every rank raises
                if stack[-1].pending is None:
                    stack[-1].pending = pending
                return
            raise pending

    def take(self) -> BaseException | None:
        """The deferred interrupt, if any, now owned by the caller (cleared here)."""
        pending, self.pending = self.pending, None
        return pending

    @classmethod
    def current(cls) -> DeferredInterrupts | None:
        stack = getattr(cls._local, "stack", None)
        return stack[-1] if stack else None

    @classmethod
    def any_pending(cls) -> bool:
        """Whether a block of this thread already holds an interrupt."""
        return any(d.pending is not None for d in getattr(cls._local, "stack", None) or [])


def _record_sigint(signum: int, frame: Any) -> None:
    """SIGINT inside a :class:`DeferredInterrupts` block: recorded for the collective to
    carry; a second one (one is already pending) leaves at once."""
    deferral = DeferredInterrupts.current()
    if deferral is None or DeferredInterrupts.any_pending():
        raise KeyboardInterrupt
    deferral.pending = KeyboardInterrupt()
    sys.stderr.write("distributed_ext: KeyboardInterrupt during a collective; finishing it "
                     "on every rank first so that no peer is left waiting (interrupt again "
                     "to leave now)\n")


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
    deferral = DeferredInterrupts.current()
    interrupt: BaseException | None = None
    callback_error: BaseException | None = None
    start = time.monotonic()
    liveness: _Liveness | None = None
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
                    post_failure(dead[0], "its heartbeat stopped")
                    raise RuntimeError(_dead_message(what, dead, " while this rank waited for it"))
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
    dead = _attribute(liveness or _Liveness(ranks))
    if dead:
        post_failure(dead[0], "its heartbeat stopped")
        raise RuntimeError(_dead_message(what, dead, "") + f" (the transport said: "
                           f"{error})") from error
    raise error


def _dead_message(what: str, dead: list[int], when: str) -> str:
    return (
        f"{what}: rank {dead[0]} died (its heartbeat stopped {DEAD_AFTER_S:.0f} s ago{when})"
        + (f"; ranks {dead} are all silent" if len(dead) > 1 else "")
        + "; the process group can no longer be used -- the job must stop"
    )


def _attribute(liveness: _Liveness) -> list[int]:
    """The peers found dead within one staleness window (empty: nobody is known dead)."""
    deadline = time.monotonic() + DEAD_AFTER_S + 2 * CHECK_EVERY_S
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
