"""The liveness endpoint: a TCP port only the kernel answers, on the address this rank's
peers reach its host at, and the probe that tells a closed one (a dead process) from a
silent one."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import selectors
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from distributed_ext._watch.store import _WHERE_KEY

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
