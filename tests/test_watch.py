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


def test_an_interrupt_waits_for_the_work_then_is_delivered_by_the_block():
    finished = threading.Event()

    def body(_worker):
        time.sleep(0.5)
        finished.set()

    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        with _watch.DeferredInterrupts():
            _watch.run_watched(body, [], "test")
            assert finished.is_set()  # the work completed before anything was raised
    assert finished.is_set()


def _beats():
    _watch.ensure_heartbeat()
    _watch.ensure_heartbeat()  # idempotent
    time.sleep(2 * _watch.HEARTBEAT_INTERVAL_S + 0.3)
    store = dist.distributed_c10d._get_default_store()
    return _native.heartbeat_count(), int(store.get(f"distributed_ext/alive/{dist.get_rank()}"))


def test_every_rank_beats_into_the_store():
    for count, stored in assert_all_ok(run_ranks(_beats, 2)):
        assert count >= 2 and stored >= 2


def test_a_nested_collective_hands_its_interrupt_to_the_enclosing_one():
    def body(_worker):
        time.sleep(0.4)

    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        with _watch.DeferredInterrupts() as outer:
            with _watch.DeferredInterrupts():
                _watch.run_watched(body, [], "inner")
            # The inner block did not raise: the outer one owns the interrupt now.
            assert isinstance(outer.pending, KeyboardInterrupt)
