"""The liveness watch's store: its timings (the beat, the grace, the checks, the limits),
its keys, the watch's own store connection (made while the store is alive), and whether
the store's host still answers."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 0.5
GRACE_S = 1.0
CHECK_EVERY_S = 0.5
GONE_AFTER_S = 1.5


def env_seconds(name: str, default: float, valid: Callable[[float], bool], expected: str,
                strict: bool) -> float:
    """The seconds of environment variable ``name`` (``default`` where unset). A value that
    is not a number or fails ``valid``: ValueError saying ``expected`` where ``strict``
    (checked at import, before any collective), else a note on stderr and ``default`` (read
    again by each wait, which must not raise on one rank mid-collective)."""
    raw = os.environ.get(name, f"{default:g}")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if valid(value):
        return value
    message = f"{name}={raw!r}: expected {expected}; unset it for the default {default:g}"
    if strict:
        raise ValueError(message)
    sys.stderr.write(f"distributed_ext: {message}; using {default:g}\n")
    return default


def _silent_after_s(strict: bool = True) -> float:
    """``DISTRIBUTED_EXT_SILENT_AFTER_S`` (default 90): how long a silent peer is waited for
    (:func:`env_seconds`)."""
    return env_seconds("DISTRIBUTED_EXT_SILENT_AFTER_S", 90.0, lambda v: v > GONE_AFTER_S,
                       f"a number of seconds above {GONE_AFTER_S} (how long a silent peer is "
                       "waited for before it is named dead)", strict)


SILENT_AFTER_S = _silent_after_s()
_KEY = "distributed_ext/alive/"
_WHERE_KEY = "distributed_ext/where/"
_FAILED_KEY = "distributed_ext/failed"



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
