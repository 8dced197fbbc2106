"""Interrupts deferred during a collective: a Ctrl-C (or any exception a signal handler
raises) recorded while posted work is still waited for, then delivered as the collective's
failure on every rank; a second one leaves at once."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


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
