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

One module per job: :mod:`.store` (timings, keys, the watch's own store connection),
:mod:`.endpoint` (the liveness port and its probe), :mod:`.heartbeat` (this rank's beat and
posted failures), :mod:`.interrupts` (deferred Ctrl-C), :mod:`.wait` (work waited on in a
worker thread while its peers are watched).
"""

from distributed_ext._watch.endpoint import (  # noqa: F401 - the module's names, as before the split
    _MAX_HELD,
    _advertised_address,
    _Endpoint,
    _links,
    _probe,
    _unreachable,
)
from distributed_ext._watch.heartbeat import (  # noqa: F401 - the module's names, as before the split
    ensure_heartbeat,
    post_failure,
    posted_failure,
)
from distributed_ext._watch.interrupts import (  # noqa: F401 - the module's names, as before the split
    DeferredInterrupts,
    _record_sigint,
)
from distributed_ext._watch.store import (  # noqa: F401 - the module's names, as before the split
    _FAILED_KEY,
    _KEY,
    _WHERE_KEY,
    CHECK_EVERY_S,
    GONE_AFTER_S,
    GRACE_S,
    HEARTBEAT_INTERVAL_S,
    SILENT_AFTER_S,
    _client_lock,
    _clone,
    _default_store,
    _refuses,
    _silent_after_s,
    _store_address,
    _store_host_rank,
    watch_client,
)
from distributed_ext._watch.wait import (  # noqa: F401 - the module's names, as before the split
    _DONE,
    LocalFailure,
    PeerFailure,
    _attribute,
    _await,
    _dead_message,
    _Liveness,
    _raise_worker_error,
    _Worker,
    run_watched,
    wait_work,
)
from distributed_ext._watch.whereabouts import POSTS, WARN_EVERY_S  # noqa: F401

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
