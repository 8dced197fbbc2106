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


# -- liveness: gone is named at once, silent only after the limit ----------------------------


def _tcp_group(world, port, pg_timeout=150.0):
    """A gloo group over a TCPStore (what torchrun sets up): its client serializes calls."""
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=int(os.environ["RANK"]), world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))


def _stopped_and_blocked_ranks(world, port, pause_s, block_s):
    import datetime
    import subprocess

    import distributed_ext as dx

    _tcp_group(world, port)
    rank = dist.get_rank()
    dx.all_reduce("warm-up", lambda: rank, list)  # every rank beats from here on
    time.sleep(1.0)
    if rank == 1:
        # Stopped whole (a debugger, a cgroup freeze, a VM snapshot): no thread of it runs.
        subprocess.Popen(["bash", "-c", f"kill -STOP {os.getpid()}; sleep {pause_s}; "
                                        f"kill -CONT {os.getpid()}"])
        time.sleep(0.5)  # stopped in here
    if rank == 2:
        # Blocked in a store call of the group's own client (new_group waiting for a late
        # peer): the heartbeat must not wait behind it.
        store = dist.distributed_c10d._get_default_store()
        try:
            store.wait(["distributed_ext-test/never"], datetime.timedelta(seconds=block_s))
        except Exception:  # noqa: BLE001 - the store call's own timeout: expected
            pass
    start = time.monotonic()
    values = dx.all_reduce("after the pause", lambda: rank * 10, list)
    return values, time.monotonic() - start


def test_a_stopped_rank_and_a_rank_blocked_in_the_store_are_waited_for_not_named_dead():
    from harness import free_port

    # (8 s: three times the grace and the gone limit together (1 + 1.5 s); the watch
    # checks them throughout)
    pause_s, block_s = 8, 5
    results = run_ranks(_stopped_and_blocked_ranks, 3, 3, free_port(), pause_s, block_s,
                        init=False, timeout=240, rank_env={r: {"RANK": str(r)} for r in range(3)})
    values = assert_all_ok(results)
    for got, _waited in values:
        assert got == [0, 10, 20]
    # Rank 0 really waited for the stopped rank (it was watched, past the grace, throughout).
    assert values[0][1] >= pause_s - 5, values


def _store_host_leaves(world, port):
    import distributed_ext as dx

    _tcp_group(world, port)
    rank = dist.get_rank()
    dx.all_reduce("warm-up", lambda: rank, list)
    if rank == 0:
        os._exit(0)  # the store's host: gone, with the store
    time.sleep(6.0)  # 12 beats' time
    return _native.heartbeat_failed()


def test_the_heartbeat_stops_once_the_stores_host_is_gone_instead_of_logging_each_beat():
    from harness import free_port

    results = run_ranks(_store_host_leaves, 2, 2, free_port(), init=False, timeout=60,
                        rank_env={r: {"RANK": str(r)} for r in range(2)})
    assert results[1].ok, results[1]
    assert results[1].value is True  # it gave up
    warnings = [line for line in results[1].output.splitlines() if "[c10d]" in line]
    # Three failed beats at most (one or two lines each), not one per beat until exit.
    assert len(warnings) <= 6, warnings


def _silence_limit_named(world):
    import distributed_ext as dx

    rank = dist.get_rank()
    pids = dx.all_reduce("warm-up", os.getpid, list)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # never continued: rank 0 kills it
    start = time.monotonic()
    try:
        dx.all_reduce("after", lambda: rank, list)
        outcome = "no error"
    except RuntimeError as exc:
        outcome = str(exc)
    waited = time.monotonic() - start
    os.kill(pids[1], signal.SIGKILL)
    return outcome, waited


def test_a_rank_silent_past_the_limit_is_named_with_the_limit():
    results = run_ranks(_silence_limit_named, 2, 2, timeout=40,
                        env={"DISTRIBUTED_EXT_SILENT_AFTER_S": "6"})
    message, waited = results[0].value
    assert "rank 1 died" in message and "silent" in message, message
    assert "DISTRIBUTED_EXT_SILENT_AFTER_S=6" in message, message
    assert 5 <= waited < 15, waited


def test_the_silence_limit_is_checked():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import distributed_ext"], capture_output=True,
                         text=True, env={**os.environ, "DISTRIBUTED_EXT_SILENT_AFTER_S": "1"})
    assert out.returncode != 0
    assert "DISTRIBUTED_EXT_SILENT_AFTER_S='1'" in out.stderr, out.stderr[-2000:]


def _store_host_killed(port, world, where, death_file):
    """A group on a TCPStore hosted by rank 0 (``tcp://``, as mp.spawn or srun launch it);
    rank 0 is SIGKILLed mid-call, taking the store with it."""
    import torch

    import distributed_ext as dx

    rank = int(os.environ["TEST_RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(
                                seconds=120))

    dying = threading.Lock()

    def die():
        # dst's writes run in several threads: the first to get here records the time and
        # dies; another opening the file after it ("w") would leave it empty.
        dying.acquire()
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    dx.gather_bytes(b"warm", 0)  # the heartbeat and the watch's store client started
    try:
        if where == "gather":
            if rank == 0:
                threading.Timer(0.5, die).start()
            dx.gather_bytes(bytes(2**30), 0, chunk_bytes=2**20)
        else:
            import distributed_ext.export.files.sinks as sinks

            if rank == 0:
                real = sinks.FileSink.write_batch

                def write_batch(self, data, rows, **kw):
                    die()
                    real(self, data, rows, **kw)

                sinks.FileSink.write_batch = write_batch
            state = {f"r{rank}.w{i}": torch.full((2**16,), float(i)) for i in range(64)}
            dx.export_hf_checkpoint(state, os.path.join(os.path.dirname(death_file), "ckpt"),
                                    writers="dst")
        return ("ok", time.time())
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return ("raised", time.time(), type(exc).__name__, str(exc))


@pytest.mark.parametrize("where", ["gather", "export"])
def test_the_death_of_the_rank_hosting_the_store_is_named_within_10_s(where, tmp_path):
    from harness import free_port

    world, death_file = 3, str(tmp_path / "death")
    res = run_ranks(_store_host_killed, world, free_port(), world, where, death_file,
                    init=False, timeout=100,
                    rank_env={r: {"TEST_RANK": str(r)} for r in range(world)})
    assert res[0].exit_code == -9, res[0]
    with open(death_file) as f:
        died = float(f.read())
    for r in (1, 2):
        assert not res[r].timed_out, f"rank {r} hung"
        outcome = res[r].value
        assert outcome is not None, res[r]
        assert outcome[0] == "raised" and "rank 0" in outcome[3], outcome
        assert outcome[1] - died < 10, (r, outcome[1] - died, outcome)


def _endpoint_address():
    import socket

    import distributed_ext as dx

    dx.gather_bytes(b"x", 0)  # starts the heartbeat and the endpoint
    store = _watch._default_store()
    where = store.get(_watch._WHERE_KEY + str(dist.get_rank())).decode().split()
    port = int(where[1])
    # Where else this host can be reached: its outward address (a UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
            outward = probe.getsockname()[0]
        except OSError:
            outward = None
    reached = {}
    for address in ("127.0.0.1", outward):
        if address is None or address.startswith("127."):
            continue
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            reached[address] = True
        except OSError:
            reached[address] = False
    return where[0], port, reached


def test_the_liveness_endpoint_listens_only_where_its_peers_reach_it():
    values = assert_all_ok(run_ranks(_endpoint_address, 2))
    for published, _port, reached in values:
        # One host: the peers reach each other on loopback, so it listens there alone.
        assert published == "127.0.0.1", values
        if not reached:
            pytest.skip("this host has no address but loopback to try the endpoint on")
        assert not any(reached.values()), reached  # refused on every other interface
