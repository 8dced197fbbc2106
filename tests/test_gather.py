"""gather_bytes across real gloo ranks, and the device pipeline as a component (CUDA)."""

from __future__ import annotations

import array
import os
import pickle
import random

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, nccl_group_of_one, read_rss, run_ranks

import distributed_ext as dx


def _payload(rank: int, size: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1000 + rank).randbytes(size)


def _gather(sizes, dst, chunk, seed=0, kind="bytes"):
    r = dist.get_rank()
    data = _payload(r, sizes[r], seed)
    if kind == "bytearray":
        data = bytearray(data)
    elif kind == "memoryview":
        data = memoryview(bytearray(data))
    out = dx.gather_bytes(data, dst, chunk_bytes=chunk)
    if out is None:
        return None
    assert all(type(o) is bytearray for o in out)
    return [bytes(o) for o in out]


@pytest.mark.parametrize(
    "world, sizes, dst, chunk",
    [
        (2, [0, 1], 0, 1000),
        (2, [1, 0], 1, 1000),
        (3, [12345, 0, 1], 2, 1000),  # many chunks, an edge every 1000 bytes, dst != 0
        (3, [999, 1000, 1001], 1, 1000),  # one byte either side of a chunk edge
        (3, [0, 0, 0], 0, 7),
        (2, [3 * 2**20 + 5, 17], 0, 2**20),
    ],
)
def test_uneven_sizes_byte_for_byte(world, sizes, dst, chunk):
    values = assert_all_ok(run_ranks(_gather, world, sizes, dst, chunk, 1))
    for r, v in enumerate(values):
        if r == dst:
            assert v == [_payload(i, n, 1) for i, n in enumerate(sizes)]
        else:
            assert v is None


@pytest.mark.parametrize("kind", ["bytearray", "memoryview"])
def test_accepts_buffers(kind):
    sizes = [4096, 100]
    values = assert_all_ok(run_ranks(_gather, 2, sizes, 0, 1000, 2, kind))
    assert values[0] == [_payload(i, n, 2) for i, n in enumerate(sizes)]


def _gather_array_and_default_chunk():
    # Any C-contiguous buffer: an array of ints travels as its raw bytes.
    data = array.array("i", range(dist.get_rank() * 10, dist.get_rank() * 10 + 5))
    out = dx.gather_bytes(data, 0)
    return None if out is None else [bytes(o) for o in out]


def test_any_contiguous_buffer_default_chunk():
    values = assert_all_ok(run_ranks(_gather_array_and_default_chunk, 2))
    assert values[0] == [array.array("i", range(r * 10, r * 10 + 5)).tobytes() for r in range(2)]


def _random_many(seed):
    rng = random.Random(seed)
    results = []
    for _ in range(6):
        sizes = [rng.choice([0, 1, rng.randrange(1, 5000)]) for _ in range(3)]
        dst, chunk = rng.randrange(3), rng.choice([1, 13, 1000, 4096])
        results.append((sizes, dst, chunk, _gather(sizes, dst, chunk, seed)))
    return results


def test_random_payloads_and_chunks():
    values = assert_all_ok(run_ranks(_random_many, 3, 5))
    for r, runs in enumerate(values):
        for sizes, dst, _chunk, got in runs:
            if r == dst:
                assert got == [_payload(i, n, 5) for i, n in enumerate(sizes)]
            else:
                assert got is None


def _subgroup_gather():
    me = dist.get_rank()
    sub = dist.new_group([0, 2])
    if me == 1:
        return "not a member"
    data = _payload(me, 3000 + me)
    out = dx.gather_bytes(data, 2, group=sub, chunk_bytes=1000)
    bad = None
    try:
        dx.gather_bytes(data, 1, group=sub)  # rank 1 is not in the subgroup
    except ValueError as exc:
        bad = str(exc)
    return None if out is None else [bytes(o) for o in out], bad


def test_subgroup_of_world_3_with_global_dst():
    values = assert_all_ok(run_ranks(_subgroup_gather, 3))
    assert values[2][0] == [_payload(0, 3000), _payload(2, 3002)]
    assert values[0][0] is None
    for r in (0, 2):
        assert "dst=1 is not a member of the group" in values[r][1]


class Boom:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["BOOM_PATH"],))


def _malicious(path):
    os.environ["BOOM_PATH"] = path
    data = pickle.dumps(Boom()) if dist.get_rank() == 1 else b"benign"
    out = dx.gather_bytes(data, 0)
    return None if out is None else [bytes(o) for o in out]


def test_malicious_pickle_comes_back_as_raw_bytes(tmp_path):
    marker = str(tmp_path / "pwned")
    values = assert_all_ok(run_ranks(_malicious, 2, marker))
    assert values[0][0] == b"benign"
    assert values[0][1].startswith(b"\x80") and b"system" in values[0][1]
    assert not os.path.exists(marker), "a payload was unpickled"


def _bad_args(bad_rank, kind):
    me = dist.get_rank()
    data, dst, chunk = b"x" * 10, 0, 1000
    if me == bad_rank or bad_rank == "all":
        if kind == "type":
            data = "a str, not bytes"
        elif kind == "chunk":
            chunk = 0
        elif kind == "chunk_huge":
            chunk = 2**70
        elif kind == "chunk_type":
            chunk = 1.5
        elif kind == "dst":
            dst = 7
        elif kind == "chunk_mismatch":
            chunk = 2000
        elif kind == "dst_mismatch":
            dst = 1
        elif kind == "noncontiguous":
            data = memoryview(bytearray(20))[::2]
    try:
        dx.gather_bytes(data, dst, chunk_bytes=chunk)
        result = ("ok",)
    except Exception as exc:
        result = ("raised", type(exc).__name__, str(exc))
    # The group is still usable afterwards.
    after = dx.gather_bytes(b"after", 0)
    return result, None if after is None else [bytes(a) for a in after]


@pytest.mark.parametrize(
    "kind, exc, text",
    [
        ("type", "TypeError", "got str"),
        ("noncontiguous", "TypeError", "non-contiguous"),
        ("chunk", "ValueError", "chunk_bytes must be a positive"),
        ("chunk_huge", "ValueError", "below 2**62"),
        ("chunk_type", "TypeError", "chunk_bytes must be an int"),
        ("dst", "ValueError", "dst=7 is not a member"),
    ],
)
def test_bad_argument_on_one_rank_raises_on_every_rank(kind, exc, text):
    values = assert_all_ok(run_ranks(_bad_args, 3, 1, kind))
    assert values[1][0][:2] == ("raised", exc) and text in values[1][0][2]
    for r in (0, 2):
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert f"rank 1 failed with {exc}" in values[r][0][2] and text in values[r][0][2]
    assert values[0][1] == [b"after"] * 3


@pytest.mark.parametrize("kind, exc", [("chunk", "ValueError"), ("type", "TypeError")])
def test_bad_argument_on_every_rank(kind, exc):
    values = assert_all_ok(run_ranks(_bad_args, 3, "all", kind))
    for result, _after in values:
        assert result[:2] == ("raised", exc)  # each rank its own error
        assert "gather_bytes:" in result[2]
    assert values[0][1] == [b"after"] * 3


@pytest.mark.parametrize("kind, name", [("chunk_mismatch", "chunk_bytes"), ("dst_mismatch", "dst")])
def test_disagreeing_ranks_fail_together(kind, name):
    values = assert_all_ok(run_ranks(_bad_args, 3, 2, kind))
    for result, _after in values:
        assert result[:2] == ("raised", "ValueError")
        assert f"different {name}" in result[2] and "rank 2" in result[2]
    assert values[0][1] == [b"after"] * 3


def _oom_on_dst():
    # dst cannot allocate the outputs: every rank raises, nobody hangs.
    import distributed_ext._native as native

    real = native.empty_bytearray

    def failing(n, prefault=False, huge_pages=True):
        raise MemoryError(f"cannot allocate a bytearray of {n} bytes")

    if dist.get_rank() == 0:
        native.empty_bytearray = failing
    try:
        dx.gather_bytes(b"y" * 100, 0)
        result = ("ok",)
    except Exception as exc:
        result = ("raised", type(exc).__name__, str(exc))
    finally:
        native.empty_bytearray = real
    after = dx.gather_bytes(b"z", 0)
    return result, None if after is None else [bytes(a) for a in after]


def test_allocation_failure_on_dst_raises_everywhere():
    values = assert_all_ok(run_ranks(_oom_on_dst, 2))
    assert values[0][0][:2] == ("raised", "MemoryError")
    assert values[1][0][:2] == ("raised", "RuntimeError") and "MemoryError" in values[1][0][2]
    assert values[0][1] == [b"z", b"z"]


def test_single_process():
    assert dx.gather_bytes(b"abc", 0) == [bytearray(b"abc")]
    assert dx.gather_bytes(b"", 0, chunk_bytes=1) == [bytearray()]
    with pytest.raises(ValueError, match="dst=1"):
        dx.gather_bytes(b"abc", 1)
    with pytest.raises(TypeError, match="got int"):
        dx.gather_bytes(5, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        dx.gather_bytes(b"abc", 0, chunk_bytes=-1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        dx.gather_bytes(b"abc", 0, chunk_bytes=2**64)


# -- CUDA: the device pipeline -----------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("size, chunk", [(0, 8), (1, 8), (8, 8), (1000, 7), (5 * 2**20 + 3, 2**20)])
def test_device_pipeline_component_byte_exact(size, chunk):
    from distributed_ext._device_pipeline import roundtrip_through_device

    data = random.Random(size).randbytes(size)
    assert bytes(roundtrip_through_device(data, chunk)) == data


def _nccl_world_1(path):
    with nccl_group_of_one(path):
        data = random.Random(3).randbytes(3 * 2**20 + 11)
        out = dx.gather_bytes(data, 0, chunk_bytes=2**20)
        return bytes(out[0]) == data and len(out) == 1


def _nccl_world_1_large(path, size, chunk):
    import torch

    with nccl_group_of_one(path):
        data = bytearray(size)
        torch.frombuffer(data, dtype=torch.uint8).random_(0, 256)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = dx.gather_bytes(data, 0, chunk_bytes=chunk)
        peak = torch.cuda.max_memory_allocated() - base
        return out[0] == data, peak


@pytest.mark.cuda
@pytest.mark.parametrize("size, chunk", [(3 * 2**30 + 12345, 256 * 2**20 + 7),
                                         (2**31 + 1, 100 * 2**20 + 1)])
def test_multi_gb_on_nccl_world_1_with_odd_chunks_within_the_device_bound(tmp_path, size, chunk):
    ((equal, peak),) = assert_all_ok(run_ranks(_nccl_world_1_large, 1, str(tmp_path / "s"),
                                               size, chunk, init=False, timeout=600))
    assert equal
    assert peak <= 2 * 1 * chunk  # dst: 2 x world x chunk of device memory at most


@pytest.mark.cuda
def test_gather_bytes_on_an_nccl_group_of_world_1(tmp_path):
    assert assert_all_ok(run_ranks(_nccl_world_1, 1, str(tmp_path / "s"), init=False)) == [True]


def _peak_rss_during_gather(size):
    import resource

    payload = bytearray(size)
    torch.frombuffer(payload, dtype=torch.uint8).fill_(dist.get_rank() + 1)
    before = read_rss()
    out = dx.gather_bytes(payload, 0, chunk_bytes=8 * 2**20)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ok = out is None or all(o == bytes([i + 1]) * size for i, o in enumerate(out))
    return ok, peak - before


def test_peak_host_memory_is_the_outputs_only():
    size = 64 * 2**20
    values = assert_all_ok(run_ranks(_peak_rss_during_gather, 2, size))
    (ok0, dst_extra), (ok1, sender_extra) = values
    assert ok0 and ok1
    # dst: the two outputs (2 x 64 MiB) plus slack; no whole-size intermediate copy.
    assert dst_extra <= 2 * size + 24 * 2**20, dst_extra / 2**20
    # sender: sends from views of its own buffer.
    assert sender_extra <= 24 * 2**20, sender_extra / 2**20


def _peer_dies_before_gather():
    if dist.get_rank() == 1:
        os._exit(9)
    try:
        dx.gather_bytes(b"x" * 1000, 0)
        return ("ok",)
    except Exception as exc:
        return ("raised", type(exc).__name__)


def test_dead_peer_makes_gather_raise_not_hang():
    res = run_ranks(_peer_dies_before_gather, 3, pg_timeout=10, timeout=60)
    assert res[1].exit_code == 9
    for r in (0, 2):
        assert not res[r].timed_out and res[r].value[0] == "raised", res[r]


def _progress_reports():
    seen = []
    dx.gather_bytes(b"p" * (5000 + dist.get_rank()), 0, chunk_bytes=1000,
                    progress=lambda done, total: seen.append((done, total)))
    return seen


def test_progress_is_reported_on_dst_only():
    values = assert_all_ok(run_ranks(_progress_reports, 3))
    total = 5001 + 5002  # what arrives from the other ranks; dst's own bytes are not counted
    dst = values[0]
    assert dst and dst[-1] == (total, total)
    assert all(t == total for _d, t in dst)
    assert [d for d, _t in dst] == sorted(d for d, _t in dst)  # never goes backwards
    assert len(dst) >= 10  # chunk by chunk, not once at the end
    assert values[1] == [] and values[2] == []


# -- a peer that dies mid-transfer (issue 10, item 3) ----------------------------------------


def _killed_mid_transfer(victim, death_file):
    import signal
    import threading
    import time

    r = dist.get_rank()
    data = bytes(2**30)  # 1 GiB per rank, moved in 1 MiB chunks

    def die():
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_progress(done, total):
        if r == victim and done >= 64 * 2**20:  # dst: 64 MiB into a peer's bytes
            die()

    if r == victim and victim != 0:
        threading.Timer(0.25, die).start()  # a sender: a quarter second into the call
    try:
        dx.gather_bytes(data, 0, chunk_bytes=2**20, progress=on_progress)
        return ("ok", time.time())
    except BaseException as exc:  # noqa: BLE001
        return ("raised", time.time(), type(exc).__name__, str(exc))


@pytest.mark.parametrize("world, victim", [(2, 1), (2, 0), (3, 1), (3, 0)])
def test_a_peer_killed_mid_transfer_is_named_by_every_survivor_within_10_s(world, victim,
                                                                             tmp_path):
    death_file = str(tmp_path / "death")
    # The group's own timeout is far away (120 s): only the liveness watch can be this quick.
    res = run_ranks(_killed_mid_transfer, world, victim, death_file, pg_timeout=120,
                    timeout=100)
    assert res[victim].exit_code == -9, res[victim]
    with open(death_file) as f:
        died = float(f.read())
    for r in set(range(world)) - {victim}:
        assert not res[r].timed_out, f"rank {r} hung"
        outcome = res[r].value
        assert outcome[0] == "raised" and outcome[2] == "RuntimeError", outcome
        assert f"rank {victim} " in outcome[3], outcome
        assert outcome[1] - died < 10, (r, outcome[1] - died, outcome)


# -- an exception on dst during the data phase (issue 10, item 4) ----------------------------


def _failure_in_data_phase(kind, chunk):
    import signal
    import threading

    r = dist.get_rank()
    data = bytes([r + 1]) * (128 * 2**20)
    calls = []

    def on_progress(done, total):
        calls.append(done)
        if kind == "callback" and len(calls) == 3:
            raise ValueError("progress bar broke")

    if kind == "sigint" and r == 0:
        # Ctrl-C on dst while it waits for the transfer.
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        dx.gather_bytes(data, 0, chunk_bytes=chunk, progress=on_progress)
        first = ("ok",)
    except BaseException as exc:  # noqa: BLE001
        first = ("raised", type(exc).__name__, str(exc))
    # The group must be usable at once: the next gather moves every byte.
    out = dx.gather_bytes(bytes([r + 7]) * 4096, 0, chunk_bytes=1000)
    second = None if out is None else [bytes(o) == bytes([i + 7]) * 4096 for i, o in enumerate(out)]
    return first, second, len(calls)


@pytest.mark.parametrize("kind", ["callback", "sigint"])
def test_failure_on_dst_mid_transfer_is_agreed_and_the_group_stays_usable(kind):
    res = run_ranks(_failure_in_data_phase, 3, kind, 2**20, pg_timeout=60, timeout=50)
    values = assert_all_ok(res)
    expected = "ValueError" if kind == "callback" else "KeyboardInterrupt"
    assert values[0][0][:2] == ("raised", expected), values[0]
    if kind == "callback":
        assert values[0][2] == 3  # not called again after it raised
    for r in (1, 2):
        assert values[r][0][:2] == ("raised", "RuntimeError"), values[r]
        assert f"rank 0 failed with {expected}" in values[r][0][2]
    assert values[0][1] == [True, True, True]
