"""This rank's beat (a native thread, no GIL) and liveness endpoint, started once per
process; and a failure posted to every rank through the store."""

from __future__ import annotations

import atexit

import torch.distributed as dist

from distributed_ext import _native
from distributed_ext._watch.endpoint import _Endpoint
from distributed_ext._watch.store import (
    _FAILED_KEY,
    _KEY,
    HEARTBEAT_INTERVAL_S,
    _clone,
    _default_store,
    watch_client,
)

_atexit_registered = False  # (the beat stopped at exit: registered once)


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
