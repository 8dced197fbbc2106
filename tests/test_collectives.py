"""all_reduce / broadcast_from fail together; the ModelOpt-style helpers on top of them."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks

import distributed_ext as dx

WORLDS = [2, 3]


def _then_still_usable(result):
    """After a (possibly failed) collective, a following one must work on every rank."""
    after = dx.all_reduce("after", lambda: dist.get_rank(), sum)
    t = torch.ones(1)
    dist.all_reduce(t)
    return result, after, t.item()


def _catching(fn):
    try:
        return ("ok", fn())
    except SystemExit as exc:
        return ("exit", exc.code)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


# -- single process --------------------------------------------------------------------------


def test_single_process_runs_fn_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dx.all_reduce("x", lambda: 4, lambda vs: vs) == [4]
    assert dx.broadcast_from("x", lambda: "v") == "v"
    assert dx.allgather(3) == [3] and dx.allreduce(3) == 3 and dx.broadcast(9) == 9
    with pytest.raises(KeyError):
        dx.all_reduce("x", lambda: {}["missing"], sum)


def test_launch_without_group_raises_instead_of_waiting(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ran = []
    with pytest.raises(RuntimeError, match="not set up"):
        dx.all_reduce("x", lambda: ran.append(1), sum)
    with pytest.raises(RuntimeError, match="not set up"):
        dx.broadcast_from("x", lambda: ran.append(1))
    assert ran == []


# -- all_reduce ------------------------------------------------------------------------------


def _all_reduce_values():
    r = dist.get_rank()
    return (dx.all_reduce("ranks", lambda: r * 10 + 1, lambda vs: vs),
            dx.all_reduce("min", lambda: 100 - r, min))


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_combines_in_rank_order(world):
    values = assert_all_ok(run_ranks(_all_reduce_values, world))
    expected = ([r * 10 + 1 for r in range(world)], 100 - (world - 1))
    assert values == [expected] * world


def _all_reduce_failing_on(failing):
    def fn():
        if dist.get_rank() in failing:
            raise ValueError(f"bad batch on rank {dist.get_rank()}")
        return 1

    return _then_still_usable(_catching(lambda: dx.all_reduce("batch", fn, sum)))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("failing", [(1,), (0, 1)])
def test_all_reduce_error_on_some_ranks(world, failing):
    values = assert_all_ok(run_ranks(_all_reduce_failing_on, world, failing))
    first = min(failing)
    for r, (result, after, t) in enumerate(values):
        if r in failing:
            assert result == ("raised", "ValueError", f"bad batch on rank {r}")
        else:
            assert result[:2] == ("raised", "RuntimeError")
            assert f"rank {first} failed with ValueError: bad batch on rank {first}" in result[2]
        assert after == sum(range(world)) and t == world


def _all_reduce_exits(codes, error_rank):
    def fn():
        r = dist.get_rank()
        if r == error_rank:
            raise OSError("disk gone")
        if r in codes:
            raise SystemExit(codes[r])
        return 0

    return _then_still_usable(_catching(lambda: dx.all_reduce("exit", fn, sum)))


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_system_exits_every_rank(world):
    codes = {1: 4} if world == 2 else {1: 4, 2: 5}
    values = assert_all_ok(run_ranks(_all_reduce_exits, world, codes, None))
    for r, (result, after, _) in enumerate(values):
        assert result == ("exit", codes.get(r, 4)), (r, result)
        assert after == sum(range(world))


def test_all_reduce_error_beats_system_exit():
    # Rank 1 exits, rank 2 errors: rank 2 raises its own, ranks 0 and 1 a RuntimeError.
    values = assert_all_ok(run_ranks(_all_reduce_exits, 3, {1: 4}, 2))
    assert values[2][0] == ("raised", "OSError", "disk gone")
    for r in (0, 1):
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "rank 2 failed with OSError: disk gone" in values[r][0][2]


def _unpicklable(kind):
    def fn():
        if dist.get_rank() != 1:
            return 1
        if kind == "lambda":
            return lambda: 0
        if kind == "lock":
            return threading.Lock()
        return socket.socket()

    return _then_still_usable(_catching(lambda: dx.all_reduce("value", fn, len)))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["lambda", "lock", "socket"])
def test_all_reduce_unpicklable_value(world, kind):
    values = assert_all_ok(run_ranks(_unpicklable, world, kind))
    assert values[1][0][:2] == ("raised", "TypeError") and "does not pickle" in values[1][0][2]
    for r in set(range(world)) - {1}:
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "rank 1 failed with TypeError" in values[r][0][2]


def _different_labels():
    label = "load" if dist.get_rank() != 1 else "calibrate"
    return _then_still_usable(_catching(lambda: dx.all_reduce(label, lambda: 1, sum)))


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_different_labels_fail_everywhere(world):
    values = assert_all_ok(run_ranks(_different_labels, world))
    for result, after, _ in values:
        assert result[:2] == ("raised", "RuntimeError")
        assert "'load'" in result[2] and "'calibrate'" in result[2] and "rank 1" in result[2]
        assert after == sum(range(world))


# -- broadcast_from --------------------------------------------------------------------------


def _broadcast_values(src):
    return dx.broadcast_from("env", lambda: {"host_rank": dist.get_rank(), "pid": os.getpid()},
                             rank=src)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_from_runs_on_rank_only(world):
    src = world - 1
    values = assert_all_ok(run_ranks(_broadcast_values, world, src))
    assert all(v == values[src] for v in values) and values[src]["host_rank"] == src


def _broadcast_failing(src, exit_code):
    def fn():
        assert dist.get_rank() == src, "fn ran on a rank other than src"
        if exit_code is not None:
            raise SystemExit(exit_code)
        raise FileNotFoundError("config.json missing on this node")

    return _then_still_usable(_catching(lambda: dx.broadcast_from("cfg", fn, rank=src)))


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_from_error(world):
    values = assert_all_ok(run_ranks(_broadcast_failing, world, 1, None))
    assert values[1][0] == ("raised", "FileNotFoundError", "config.json missing on this node")
    for r in set(range(world)) - {1}:
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "rank 1 failed with FileNotFoundError: config.json missing" in values[r][0][2]
        assert values[r][1] == sum(range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_from_system_exit(world):
    values = assert_all_ok(run_ranks(_broadcast_failing, world, 0, 6))
    assert [v[0] for v in values] == [("exit", 6)] * world


def _broadcast_unpicklable():
    return _then_still_usable(_catching(lambda: dx.broadcast_from("v", threading.Lock)))


def test_broadcast_from_unpicklable():
    values = assert_all_ok(run_ranks(_broadcast_unpicklable, 2))
    assert values[0][0][:2] == ("raised", "TypeError")
    assert values[1][0][:2] == ("raised", "RuntimeError") and "TypeError" in values[1][0][2]


def _broadcast_other_label():
    label = "a" if dist.get_rank() == 0 else "b"
    return _then_still_usable(_catching(lambda: dx.broadcast_from(label, lambda: 42, rank=0)))


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_from_other_label(world):
    values = assert_all_ok(run_ranks(_broadcast_other_label, world))
    assert values[0][0] == ("ok", 42)  # rank sees no other label, and returns
    for r in range(1, world):
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "'a'" in values[r][0][2] and "'b'" in values[r][0][2]
        assert values[r][1] == sum(range(world))


def _broadcast_rank_outside(src):
    return _then_still_usable(_catching(lambda: dx.broadcast_from("x", lambda: 1, rank=src)))


@pytest.mark.parametrize("src", [5, -1])
def test_broadcast_from_rank_outside_group(src):
    values = assert_all_ok(run_ranks(_broadcast_rank_outside, 3, src))
    for result, after, _ in values:
        assert result[:2] == ("raised", "ValueError") and f"rank={src}" in result[2]
        assert after == 3


# -- groups ----------------------------------------------------------------------------------


def _on_subgroup():
    me = dist.get_rank()
    sub = dist.new_group([1, 2])
    out = {"world": dx.all_reduce("w", lambda: me, lambda vs: vs)}
    if me in (1, 2):
        out["sub"] = dx.all_reduce("s", lambda: me, lambda vs: vs, group=sub)
        out["bcast"] = dx.broadcast_from("b", lambda: f"from {me}", rank=2, group=sub)
        out["outside"] = _catching(lambda: dx.broadcast_from("b", lambda: 0, rank=0, group=sub))
        out["fail"] = _catching(
            lambda: dx.all_reduce("f", lambda: 1 // (me - 1), sum, group=sub))
        out["helpers"] = (dx.allgather(me, group=sub), dx.allreduce(me, group=sub),
                          dx.allreduce(me, "max", group=sub), dx.broadcast(me, src=1, group=sub))
    out["after"] = dx.all_reduce("after", lambda: 1, sum)
    return out


def test_collectives_on_a_subgroup():
    values = assert_all_ok(run_ranks(_on_subgroup, 3))
    for v in values:
        assert v["world"] == [0, 1, 2] and v["after"] == 3
    for r in (1, 2):
        v = values[r]
        assert v["sub"] == [1, 2] and v["bcast"] == "from 2"
        assert v["outside"][:2] == ("raised", "ValueError")
        assert v["helpers"] == ([1, 2], 3, 2, 1)
    assert values[1]["fail"][:2] == ("raised", "ZeroDivisionError")
    assert values[2]["fail"][:2] == ("raised", "RuntimeError")
    assert "rank 1 failed with ZeroDivisionError" in values[2]["fail"][2]
    assert "sub" not in values[0]


# -- helpers ---------------------------------------------------------------------------------


def _helpers():
    me = dist.get_rank()
    calls = []

    @dx.master_only
    def read_config():
        calls.append(me)
        return {"lr": 0.1, "from": me}

    return (dx.allgather({"r": me}), dx.allreduce(me + 1), dx.allreduce(me, "min"),
            dx.broadcast(f"obj{me}", src=1), read_config(), calls,
            _catching(lambda: dx.allreduce(1, "median")))


def test_helpers_world_3():
    values = assert_all_ok(run_ranks(_helpers, 3))
    for r, v in enumerate(values):
        assert v[0] == [{"r": 0}, {"r": 1}, {"r": 2}]
        assert v[1:5] == (6, 0, "obj1", {"lr": 0.1, "from": 0})
        assert v[5] == ([0] if r == 0 else [])
        assert v[6][:2] == ("raised", "ValueError")


def _allgather_unpicklable():
    obj = threading.Lock() if dist.get_rank() == 0 else 1
    return _then_still_usable(_catching(lambda: dx.allgather(obj)))


def test_allgather_unpicklable_fails_everywhere():
    values = assert_all_ok(run_ranks(_allgather_unpicklable, 2))
    assert values[0][0][:2] == ("raised", "TypeError")
    assert values[1][0][:2] == ("raised", "RuntimeError")


# -- a rank that dies ------------------------------------------------------------------------


def _dies_during(which):
    if dist.get_rank() == 1:
        os._exit(9)
    if which == "all_reduce":
        return _catching(lambda: dx.all_reduce("x", lambda: 1, sum))
    return _catching(lambda: dx.broadcast_from("x", lambda: 1, rank=0))


@pytest.mark.parametrize("which", ["all_reduce", "broadcast_from"])
def test_dead_peer_makes_others_raise_within_timeout(which):
    res = run_ranks(_dies_during, 3, which, pg_timeout=10, timeout=60)
    assert res[1].exit_code == 9
    for r in (0, 2):
        assert not res[r].timed_out, "a live rank hung waiting for a dead peer"
        assert res[r].value[0] == "raised", res[r]


# -- labels of any length and characters (issue 10, item 1) ---------------------------------

_LONG = "calibrate/" + "x" * 400  # over the 256 UTF-8 bytes a status record shows
_SURROGATE = "amax-\udc80-sync"  # a lone surrogate: not encodable as strict UTF-8


def _labels(label, other):
    r = dist.get_rank()
    mine = other if (other is not None and r == 1) else label
    red = _catching(lambda: dx.all_reduce(mine, lambda: r, sum))
    bc = _catching(lambda: dx.broadcast_from(mine, lambda: "v", rank=0))
    return _then_still_usable((red, bc))


@pytest.mark.parametrize("label", [_LONG, _SURROGATE, "é" * 200], ids=["long", "surrogate", "utf8"])
def test_any_label_works(label):
    values = assert_all_ok(run_ranks(_labels, 2, label, None))
    for (red, bc), after, _t in values:
        assert red == ("ok", 1) and bc == ("ok", "v")
        assert after == 1


def test_labels_differing_after_256_bytes_fail_everywhere_with_a_clipped_label():
    # Two labels equal in their first 400 characters: compared whole, shown clipped.
    values = assert_all_ok(run_ranks(_labels, 2, _LONG + "-a", _LONG + "-b"))
    for r, ((red, bc), after, _t) in enumerate(values):
        assert red[:2] == ("raised", "RuntimeError") and "different labels" in red[2]
        assert "rank 0" in red[2] and "rank 1" in red[2] and len(red[2]) < 600
        if r == 0:  # broadcast_from: rank sees no other label and returns
            assert bc == ("ok", "v")
        else:
            assert bc[:2] == ("raised", "RuntimeError") and "broadcasts label" in bc[2]
        assert after == 1


# -- every way fn can fail is agreed (issue 10, item 2) --------------------------------------


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str of this exception raises")

    def __repr__(self):
        raise RuntimeError("repr too")


class _Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.lock = threading.Lock()

    def __reduce__(self):
        raise TypeError("cannot pickle this exception")


def _raise_kind(kind):
    import asyncio

    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "CancelledError":
        raise asyncio.CancelledError("task cancelled")
    if kind == "GeneratorExit":
        raise GeneratorExit
    if kind == "BadStr":
        raise _BadStr
    raise _Unpicklable


def _fn_fails_with(kind, which):
    import time

    def fn():
        if dist.get_rank() == 1:
            _raise_kind(kind)
        return 7

    t0 = time.monotonic()
    try:
        if which == "all_reduce":
            result = ("ok", dx.all_reduce("odd", fn, sum))
        else:
            result = ("ok", dx.broadcast_from("odd", fn, rank=1))
    except BaseException as exc:  # noqa: BLE001 - the test inspects what each rank raised
        result = ("raised", type(exc).__name__, dx_describe(exc))
    return _then_still_usable((result, time.monotonic() - t0))


def dx_describe(exc):
    from distributed_ext._agree import describe_exception

    return describe_exception(exc)


@pytest.mark.parametrize("which", ["all_reduce", "broadcast_from"])
@pytest.mark.parametrize(
    "kind, type_name",
    [("KeyboardInterrupt", "KeyboardInterrupt"), ("CancelledError", "CancelledError"),
     ("GeneratorExit", "GeneratorExit"), ("BadStr", "_BadStr"), ("Unpicklable", "_Unpicklable")],
)
def test_every_way_fn_fails_is_agreed(kind, type_name, which):
    # pg_timeout 60 s: a peer left waiting would time out far past the 5 s asserted below.
    values = assert_all_ok(run_ranks(_fn_fails_with, 3, kind, which, timeout=60))
    for r, ((result, seconds), after, t) in enumerate(values):
        assert seconds < 5, (r, seconds)
        if r == 1:
            assert result[:2] == ("raised", type_name), result
        else:
            assert result[:2] == ("raised", "RuntimeError"), result
            assert f"rank 1 failed with {type_name}" in result[2], result
        assert after == 3 and t == 3  # the group is still usable


# -- allreduce min/max on tensors (issue 10, item 13) ----------------------------------------


def _allreduce_tensors():
    r = dist.get_rank()
    t = torch.tensor([1.0 + r, 5.0 - r, float(r % 2)])
    out = {red: dx.allreduce(t, red) for red in ("sum", "min", "max")}
    out["scalar_max"] = dx.allreduce(r, "max")
    try:
        dx.allreduce(t, "mean")
    except ValueError as exc:
        out["bad"] = str(exc)
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def test_allreduce_min_max_are_element_wise_on_tensors():
    values = assert_all_ok(run_ranks(_allreduce_tensors, 3))
    for v in values:
        assert v["sum"] == [6.0, 12.0, 1.0]
        assert v["min"] == [1.0, 3.0, 0.0]
        assert v["max"] == [3.0, 5.0, 1.0]
        assert v["scalar_max"] == 2
        assert "reduction='mean'" in v["bad"] and "'max'" in v["bad"]


def _killed_inside_fn(which):
    import signal
    import time

    dx.all_reduce("warm", lambda: 1, sum)  # every rank has beaten at least once

    def fn():
        if dist.get_rank() == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return 1

    t0 = time.monotonic()
    if which == "all_reduce":
        result = _catching(lambda: dx.all_reduce("x", fn, sum))
    else:
        result = _catching(lambda: dx.broadcast_from("x", fn, rank=1))
    return result, time.monotonic() - t0


@pytest.mark.parametrize("which", ["all_reduce", "broadcast_from"])
def test_a_rank_killed_inside_fn_is_named_within_10_s_whatever_the_group_timeout(which):
    res = run_ranks(_killed_inside_fn, 3, which, pg_timeout=300, timeout=120)
    assert res[1].exit_code == -9
    for r in (0, 2):
        (kind, *rest), seconds = res[r].value
        assert kind == "raised" and rest[0] == "RuntimeError", res[r].value
        assert "rank 1 died" in rest[1], rest[1]
        assert seconds < 10.5, seconds  # 0.5 s in fn, then the death is named within 10 s
