"""Watched waits: progress in order, callback errors carried, interrupts deferred; the heartbeat."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from harness import assert_all_ok, run_ranks

from distributed_ext import _native, _watch


def test_progress_in_order_and_a_raising_callback_is_carried_not_raised():
    seen = []

    def body(worker):
        for k in range(5):
            worker.report(k)

    def on_progress(k):
        seen.append(k)
        if k == 2:
            raise ValueError("bar broke")

    err = _watch.run_watched(body, [], "test", on_progress)
    assert seen == [0, 1, 2] and isinstance(err, ValueError)


def test_an_error_of_the_body_is_raised_in_the_caller():
    def body(_worker):
        raise OSError("disk")

    with pytest.raises(OSError, match="disk"):
        _watch.run_watched(body, [], "test")


def _interrupt_waits_for_the_work():
    finished = threading.Event()

    def body(_worker):
        time.sleep(1.0)
        finished.set()

    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        with _watch.DeferredInterrupts():
            _watch.run_watched(body, [], "test")
            inside = finished.is_set()  # the work completed before anything was raised
    except KeyboardInterrupt:
        return inside, finished.is_set()
    return "no interrupt", None


def test_an_interrupt_waits_for_the_work_then_is_delivered_by_the_block():
    # In a process of its own: a SIGINT must never reach the test runner.
    assert assert_all_ok(run_ranks(_interrupt_waits_for_the_work, 1, init=False)) == [
        (True, True)]


def _beats():
    _watch.ensure_heartbeat()
    _watch.ensure_heartbeat()  # idempotent
    time.sleep(2 * _watch.HEARTBEAT_INTERVAL_S + 0.3)
    store = dist.distributed_c10d._get_default_store()
    return _native.heartbeat_count(), int(store.get(f"distributed_ext/alive/{dist.get_rank()}"))


def test_every_rank_beats_into_the_store():
    for count, stored in assert_all_ok(run_ranks(_beats, 2)):
        assert count >= 2 and stored >= 2


def _nested_interrupt():
    def body(_worker):
        time.sleep(1.0)

    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        with _watch.DeferredInterrupts() as outer:
            with _watch.DeferredInterrupts():
                _watch.run_watched(body, [], "inner")
            # The inner block did not raise: the outer one owns the interrupt now.
            owned = isinstance(outer.pending, KeyboardInterrupt)
    except KeyboardInterrupt:
        return owned
    return "no interrupt"


def test_a_nested_collective_hands_its_interrupt_to_the_enclosing_one():
    assert assert_all_ok(run_ranks(_nested_interrupt, 1, init=False)) == [True]


def _interrupt_between_waits():
    """Ctrl-C while the collective runs plain Python (no wait): recorded, not raised there."""
    reached_end = False
    try:
        with _watch.DeferredInterrupts() as block:
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # Python code between rounds
                pass
            recorded = isinstance(block.pending, KeyboardInterrupt)
            reached_end = True
    except KeyboardInterrupt:
        pass
    restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    second_left_at_once = False
    try:
        with _watch.DeferredInterrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # the escape hatch
            time.sleep(0.3)
    except KeyboardInterrupt:
        second_left_at_once = True
    return reached_end and recorded, restored, second_left_at_once


def test_an_interrupt_between_waits_is_recorded_and_a_second_leaves_at_once():
    # A KeyboardInterrupt raised between rounds (starting a thread, say) would leave this rank
    # a round ahead of its peers; the block records it wherever it lands.
    assert assert_all_ok(run_ranks(_interrupt_between_waits, 1, init=False)) == [
        (True, True, True)]
