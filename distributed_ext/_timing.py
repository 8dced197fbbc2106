"""The one timing loop of the CLI and the benchmarks: the first call, then the warm ones.

A job that exports once pays the first call (connections, thread pools, page faults into
fresh memory), so every figure reports it beside the warm median and the spread of the warm
calls. Each call starts from ``sync()`` (a barrier across ranks), so all ranks enter it
together, and its wall time is measured on the calling rank up to its return.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Timing", "merge_launches", "time_calls"]


@dataclass
class Timing:
    """Seconds of the first call and of each warm call after it."""

    first: float
    warm: list[float] = field(default_factory=list)
    # Every fresh launch's first call where the figures pool several (:func:`merge_launches`;
    # ``first`` is then their median), else empty.
    firsts: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """The warm median (the first call's time when there are no warm calls)."""
        return statistics.median(self.warm) if self.warm else self.first

    @property
    def low(self) -> float:
        return min(self.warm) if self.warm else self.first

    @property
    def high(self) -> float:
        return max(self.warm) if self.warm else self.first

    @property
    def spread(self) -> float:
        """max / min of the warm calls (1.0 when fewer than two)."""
        return self.high / self.low if self.low > 0 else float("inf")


def time_calls(call: Callable[[int], Any], repeat: int,
               sync: Callable[[], None] = lambda: None,
               after: Callable[[int, Any], None] | None = None) -> Timing:
    """Times ``call(i)`` for ``i = 0`` (the first call) and ``1..repeat`` (warm).

    Args:
        call: The measured call; gets its index (0 is the first).
        repeat: Warm calls after the first.
        sync: Run before each call, outside the timing (e.g. ``dist.barrier``).
        after: Gets ``(i, what call returned)`` outside the timing (checks, freeing).
    """
    times: list[float] = []
    for i in range(repeat + 1):
        sync()
        start = time.perf_counter()
        value = call(i)
        times.append(time.perf_counter() - start)
        if after is not None:
            after(i, value)
        value = None
    return Timing(times[0], times[1:])


def merge_launches(timings: list[Timing]) -> Timing:
    """The Timings of one route in several fresh launches as one: ``first`` the median of
    their first calls (each kept in ``firsts``), ``warm`` every warm call of them all. A
    first call moves with what the machine is doing at that moment (by half or more on a
    small machine, the disk's own write as much): its median over launches, each beside the
    other routes' of the same round, is the figure a comparison can stand on."""
    if not timings:
        raise ValueError("merge_launches: no timings")
    if len(timings) == 1:
        return timings[0]
    firsts = [t.first for t in timings]
    return Timing(statistics.median(firsts), [w for t in timings for w in t.warm], firsts)
