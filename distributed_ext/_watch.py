"""Waiting on collective work without hanging: dead peers are named, interrupts are deferred.

A rank that waits in ``work.wait()`` for a peer that died waits out the process group's
timeout (30 min by default) on gloo whenever the transport does not notice the death itself
(a sender whose receiver was killed, say). Here the waiting happens in a worker thread while
the calling thread watches:

- **Liveness.** Every rank that uses a collective of this package beats a counter in the
  process group's store from a native thread (``csrc/heartbeat.cpp``: no GIL, so a busy rank
  still beats), through its own clone of the store (``Store.clone()``: a connection of its
  own, so a thread of the rank blocked in a store call -- ``new_group`` waiting for a late
  peer -- cannot hold the beat up). Every rank also listens on a liveness endpoint, a TCP
  port that only the kernel answers (no data ever crosses it), bound to the address its
  peers reach this host at (never every interface), published in the store. A wait that
  lasts longer than ``GRACE_S`` reads its peers' counters every ``CHECK_EVERY_S``, through
  the watch's own store connection (:func:`watch_client`), made while the store was alive:
  where the rank hosting the store dies (rank 0 under ``tcp://``/``env://`` without
  torchrun), a fresh clone would keep reconnecting until the group's timeout; instead the
  store's refused port names that rank. The rule:

  * a peer whose counter has not moved for ``GONE_AFTER_S`` (1.5 s) and whose endpoint is
    closed or refuses a connection is **gone** (its process exited: a crash, SIGKILL, an
    OOM kill -- the kernel closes a dead process's sockets), and is named at once: within
    about 3 s of its death;
  * a peer whose counter has not moved but whose endpoint is still there (a process that is
    stopped, frozen, starved or swapping: the kernel answers for it), or whose endpoint
    cannot be reached at all (its host vanished, or a firewall), is **silent**; it is named
    dead only after ``SILENT_AFTER_S`` (90 s by default; the environment variable
    ``DISTRIBUTED_EXT_SILENT_AFTER_S`` sets it, checked at import, read at each wait). So a
    rank paused for up to 60 s by a debugger or a cgroup freeze is waited for, and a host
    that vanishes is named after the limit.

  A peer that has never beaten (it has not reached its first collective yet) is never
  called dead. Limits: a dead process's port taken by another process within seconds makes
  it look silent (named after the limit); an endpoint behind a firewall likewise. Cost:
  nothing for a wait shorter than the grace; then one store read per peer per check, and
  one connection per stalled peer (kept for later checks).
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
import contextlib
import ipaddress
import os
import queue
import selectors
import signal
import socket
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
    "GONE_AFTER_S",
    "GRACE_S",
    "SILENT_AFTER_S",
    "DeferredInterrupts",
    "PeerFailure",
    "ensure_heartbeat",
    "post_failure",
    "posted_failure",
    "run_watched",
    "wait_work",
    "watch_client",
]

HEARTBEAT_INTERVAL_S = 0.5
GRACE_S = 1.0
CHECK_EVERY_S = 0.5
GONE_AFTER_S = 1.5


def _silent_after_s(strict: bool = True) -> float:
    """``DISTRIBUTED_EXT_SILENT_AFTER_S`` (default 90): checked at import (a ValueError
    then, before any collective); read again by each watched wait, so that a launcher or a
    test may set it after import (a bad value there falls back to 90 with a warning: a
    watch must not raise on one rank mid-collective)."""
    raw = os.environ.get("DISTRIBUTED_EXT_SILENT_AFTER_S", "90")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > GONE_AFTER_S:
        message = (f"DISTRIBUTED_EXT_SILENT_AFTER_S={raw!r}: expected a number of seconds "
                   f"above {GONE_AFTER_S} (how long a silent peer is waited for before it is "
                   "named dead); unset it for the default 90")
        if strict:
            raise ValueError(message)
        sys.stderr.write(f"distributed_ext: {message}; using 90\n")
        return 90.0
    return value


SILENT_AFTER_S = _silent_after_s()
_KEY = "distributed_ext/alive/"
_WHERE_KEY = "distributed_ext/where/"
_FAILED_KEY = "distributed_ext/failed"

_atexit_registered = False


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without it: no liveness, plain waits
        return None


def _clone(store: Any) -> Any:
    """A clone of ``store`` with its own connection (the store itself where it cannot)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - a store type without clone: shared, as before
        return store


# The watch's own connection to the default store: (the store, its clone).
_client: tuple[Any, Any] | None = None
_client_lock = threading.Lock()


def watch_client() -> Any:
    """This process's connection to the default group's store for reads that must never
    block behind another thread's store call (the liveness checks, the export's stop flag):
    a clone, made once per store by :func:`ensure_heartbeat` while the store's host is alive
    -- never at the moment a wait stalls, when that host may be the peer that died (a clone
    of a dead TCPStore keeps reconnecting until the group's timeout). None without a store.
    Thread-safe (the store client serializes its calls; every call made on it is short)."""
    global _client
    store = _default_store()
    if store is None:
        return None
    with _client_lock:
        if _client is None or _client[0] is not store:
            _client = (store, _clone(store))
        return _client[1]


def _store_address(store: Any) -> tuple[str, int] | None:
    """Where a TCPStore's server listens (None for another kind of store)."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return (host, int(port)) if host and port else None


def _store_host_rank() -> int | None:
    """The global rank whose process hosts the default store's server: rank 0 where the
    group made its own TCPStore (``tcp://`` or ``env://`` without torchrun: mp.spawn, srun,
    hand-written launchers); None under torchrun's agent store (the agent hosts it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    return 0


def _refuses(address: tuple[str, int]) -> bool:
    """Whether a TCP server at ``address`` refuses connections: its process is gone (the
    kernel closed its listening socket)."""
    try:
        with socket.create_connection(address, timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable or slow: cannot tell


def ensure_heartbeat() -> None:
    """Starts this process's heartbeat into the default group's store and its liveness
    endpoint, and the watch's store connection (idempotent, cheap)."""
    global _atexit_registered
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _default_store()
    if store is None:
        return
    watch_client()
    key = _KEY + str(dist.get_rank())
    if _native.heartbeat_running(store, key):
        return
    client = _clone(store)
    _Endpoint.publish(client, dist.get_rank(), store)
    _native.start_heartbeat(store, client, key, int(HEARTBEAT_INTERVAL_S * 1000))
    if not _atexit_registered:
        # Stop the native thread before the interpreter (and torch's statics) go away.
        atexit.register(_native.stop_heartbeat)
        _atexit_registered = True


# Connections an endpoint holds at most (one per watching peer is the need).
_MAX_HELD = 4096


class _Endpoint:
    """This process's liveness endpoint: a listening TCP socket whose only message is that
    it exists. Peers connect to it when a rank's heartbeat stalls; the kernel accepts for a
    stopped process and closes or refuses for a dead one. Accepted connections are held
    (never read or written) until the peer closes them."""

    _lock = threading.Lock()
    _port: int | None = None
    _address = ""

    @classmethod
    def _start(cls, address: str) -> int:
        """Listens on ``address`` only -- where peers reach this host (loopback on one
        machine), never every interface."""
        with cls._lock:
            if cls._port is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind((address, 0))
                listener.listen(128)
                listener.setblocking(False)
                cls._port = listener.getsockname()[1]
                cls._address = address
                threading.Thread(target=cls._serve, args=(listener,), daemon=True,
                                 name="distributed_ext liveness endpoint").start()
            return cls._port

    @staticmethod
    def _serve(listener: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        while True:
            for key, _mask in selector.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock is listener:
                        conn, _addr = listener.accept()
                        if len(selector.get_map()) > _MAX_HELD:
                            conn.close()  # a flood (a port scan): hold no more descriptors
                            continue
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ)
                    elif not sock.recv(256):  # the peer closed it
                        selector.unregister(sock)
                        sock.close()
                except OSError:
                    if sock is not listener:
                        with contextlib.suppress(Exception):
                            selector.unregister(sock)
                        sock.close()

    @classmethod
    def publish(cls, client: Any, rank: int, store: Any) -> None:
        """Starts the endpoint (once per process) and publishes where it listens."""
        try:
            port = cls._start(_advertised_address(store))
            value = f"{cls._address} {port} {socket.gethostname()} {os.getpid()}"
            client.set(_WHERE_KEY + str(rank), value)
        except Exception:  # noqa: BLE001 - without it, a stalled peer is only ever silent
            pass


def _advertised_address(store: Any) -> str:
    """The address peers reach this host at: the one it reaches the store's host from (a
    TCPStore's, else ``MASTER_ADDR``'s), else loopback (peers on other hosts then find the
    endpoint unreachable, and fall back to the silence limit)."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    host = getattr(inner, "host", None) or os.environ.get("MASTER_ADDR")
    if host:
        with contextlib.suppress(OSError), \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(getattr(inner, "port", 0) or 9)))  # sends nothing
            return probe.getsockname()[0]
    return "127.0.0.1"


# Connections to peers' endpoints, kept between checks: (rank, published value) -> socket.
_links: dict[tuple[int, str], socket.socket] = {}
_unreachable: dict[tuple[int, str], float] = {}  # when a connection last timed out


def _probe(store: Any, rank: int) -> str:
    """Whether ``rank``'s process is ``"gone"`` (its endpoint closed or refused), ``"here"``
    (the kernel still answers for it) or ``"unknown"`` (not published, or unreachable)."""
    try:
        if not store.check([_WHERE_KEY + str(rank)]):
            return "unknown"
        value = store.get(_WHERE_KEY + str(rank)).decode("utf-8", "replace")
        address, port, hostname, _pid = value.split()
        if ipaddress.ip_address(address).is_loopback and hostname != socket.gethostname():
            return "unknown"  # a loopback address of another host: not reachable from here
        port_number = int(port)
    except Exception:  # noqa: BLE001 - a store that is gone, or a value not ours
        return "unknown"
    link = (rank, value)
    sock = _links.get(link)
    if sock is None:
        if time.monotonic() - _unreachable.get(link, -1e9) < 5.0:
            return "unknown"  # a connect timed out just now: do not stall every check
        try:
            sock = socket.create_connection((address, port_number), timeout=1.0)
        except ConnectionRefusedError:
            return "gone"
        except OSError:
            _unreachable[link] = time.monotonic()
            return "unknown"
        sock.setblocking(False)
        _links[link] = sock
    try:
        data = sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return "here"  # open, nothing to read: the kernel holds it for a live process
    except OSError:  # reset: the process died with the connection open
        data = b""
    if data:
        return "unknown"  # the endpoint never sends: not ours
    del _links[link]
    sock.close()
    return "gone"


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
                    post_failure(dead[0], liveness.why(dead[0]))
                    raise RuntimeError(_dead_message(what, dead, liveness,
                                                     " while this rank waited for it"))
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
