"""gather_state_dicts across real gloo ranks."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, nccl_group_of_one, read_rss, run_ranks

import distributed_ext as dx


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    emb = torch.randn(50, 16, generator=g)
    return collections.OrderedDict(
        [("model.embed.weight", emb), ("lm_head.weight", emb),
         ("layers.0.w", torch.randn(33, 7, generator=g).to(torch.bfloat16)),
         ("layers.0.b", torch.arange(rank, rank + 5)),
         ("empty", torch.empty(0)), ("scalar", torch.tensor(float(rank))),
         ("meta", {"rank": rank, "dtype": torch.float16, "shape": torch.Size([2, rank])})])


def _check(expected: dict, got: dict) -> bool:
    assert list(got) == list(expected)
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k
    assert got["model.embed.weight"] is got["lm_head.weight"]
    return True


def _gather(dst):
    me = dist.get_rank()
    it = dx.gather_state_dicts(_state(me), dst)
    # The collective ran eagerly: a following one works before anything is iterated.
    after = dx.all_reduce("after", lambda: 1, sum)
    states = list(it)
    if me != dst:
        return len(states), after
    return [(_check(_state(r), s), type(s).__name__) for r, s in enumerate(states)], after


@pytest.mark.parametrize("world, dst", [(2, 0), (3, 2)])
def test_gather_states(world, dst):
    values = assert_all_ok(run_ranks(_gather, world, dst))
    for r, (v, after) in enumerate(values):
        assert after == world
        if r == dst:
            assert v == [(True, "OrderedDict")] * world
        else:
            assert v == 0


def _big_states_cross_chunks():
    # Tensors larger and smaller than a chunk, so chunks are both views and packed.
    me = dist.get_rank()
    g = torch.Generator().manual_seed(10 + me)
    state = {f"t{i}": torch.randn(i * 97 + 1, generator=g) for i in range(40)}
    state["big"] = torch.randn(5000, generator=g)
    out = list(dx.gather_state_dicts(state, 0, chunk_bytes=4096))
    if me:
        return None
    results = []
    for r, s in enumerate(out):
        g = torch.Generator().manual_seed(10 + r)
        exp = {f"t{i}": torch.randn(i * 97 + 1, generator=g) for i in range(40)}
        exp["big"] = torch.randn(5000, generator=g)
        results.append(all(torch.equal(exp[k], s[k]) for k in exp))
    return results


def test_many_chunks_views_and_packed():
    assert assert_all_ok(run_ranks(_big_states_cross_chunks, 2))[0] == [True, True]


def _bad_state_on_rank_1():
    me = dist.get_rank()
    state = {"w": torch.randn(3)}
    if me == 1:
        state["model.layers.3.mlp.up.weight"] = torch.randn(4, 4).to_sparse()
    try:
        list(dx.gather_state_dicts(state, 0))
        result = ("ok",)
    except Exception as exc:
        result = ("raised", type(exc).__name__, str(exc))
    after = [len(s) for s in dx.gather_state_dicts({"x": torch.ones(1)}, 0)]
    return result, after


def test_unsupported_value_raises_on_every_rank():
    values = assert_all_ok(run_ranks(_bad_state_on_rank_1, 3))
    assert values[1][0][:2] == ("raised", "TypeError")
    assert "state['model.layers.3.mlp.up.weight']" in values[1][0][2]
    assert ".to_dense()" in values[1][0][2]
    for r in (0, 2):
        assert values[r][0][:2] == ("raised", "RuntimeError")
        assert "rank 1 failed with TypeError" in values[r][0][2]
    assert values[0][1] == [1, 1, 1]


_current_rss = read_rss


def _buffers_freed_when_states_dropped():
    me = dist.get_rank()
    # 64 MiB per rank: above glibc's largest mmap threshold, so a freed buffer leaves RSS.
    state = {"w": torch.full((16 * 2**20,), float(me + 1))}
    it = dx.gather_state_dicts(state, 0)
    if me:
        return None
    del state
    gc.collect()
    steps = [_current_rss()]
    for s in it:
        steps.append(_current_rss())  # decoded: no tensor bytes copied
        assert s["w"][123].item() == s["w"][-1].item()
        del s
        gc.collect()
        steps.append(_current_rss())  # dropped: its buffer is freed
    return steps


def test_received_buffers_freed_once_consumer_drops_state():
    steps = assert_all_ok(run_ranks(_buffers_freed_when_states_dropped, 2))[0]
    mib = 2**20
    held, decoded0, dropped0, decoded1, dropped1 = steps
    assert decoded0 - held < 8 * mib and decoded1 - dropped0 < 8 * mib
    assert held - dropped0 > 56 * mib, [x / mib for x in steps]
    assert dropped0 - dropped1 > 56 * mib, [x / mib for x in steps]


def _rss_bounded():
    import resource

    me = dist.get_rank()
    n = 32 * 2**20  # 128 MiB of float32 per rank
    state = {f"w{i}": torch.full((n // 8,), float(me + i)) for i in range(8)}
    before = read_rss()
    it = dx.gather_state_dicts(state, 0, chunk_bytes=8 * 2**20)
    peak_gather = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    sums = [float(sum(t[0].item() for t in s.values())) for s in it]
    peak_all = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return peak_gather, peak_all, sums


def test_host_memory_bounded_on_dst_and_senders():
    values = assert_all_ok(run_ranks(_rss_bounded, 2))
    gathered = 2 * 128 * 2**20
    peak_gather, peak_all, sums = values[0]
    assert sums == [float(sum(range(8))), float(sum(range(1, 9)))]
    # dst: the gathered bytes and small change; decoding copies nothing.
    assert peak_all <= gathered + 3 * 8 * 2**20 + 24 * 2**20, peak_all / 2**20
    # sender: no encoded copy of its 128 MiB; at most two 8 MiB staging chunks.
    assert values[1][0] <= 2 * 8 * 2**20 + 24 * 2**20, values[1][0] / 2**20


def test_single_process():
    out = list(dx.gather_state_dicts({"a": torch.ones(2), "m": [1, "x"]}, 0))
    assert len(out) == 1 and torch.equal(out[0]["a"], torch.ones(2)) and out[0]["m"] == [1, "x"]
    with pytest.raises(TypeError, match="must be a dict"):
        list(dx.gather_state_dicts([1, 2], 0))  # type: ignore[arg-type]


def _nccl_world_1(path):
    with nccl_group_of_one(path):
        state = {"w": torch.randn(300, 300, device="cuda"), "b": torch.arange(3)}
        (out,) = list(dx.gather_state_dicts(state, 0))
        return torch.equal(out["w"], state["w"].cpu()) and torch.equal(out["b"], state["b"])


@pytest.mark.cuda
def test_gather_state_dicts_on_an_nccl_group_of_world_1(tmp_path):
    assert assert_all_ok(run_ranks(_nccl_world_1, 1, str(tmp_path / "s"), init=False)) == [True]


def _dtensor_state():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"model.embed.weight": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])}
    try:
        list(dx.gather_state_dicts(state, 0))
        return ("ok",)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


def test_dtensor_is_a_type_error_on_every_rank():
    for result in assert_all_ok(run_ranks(_dtensor_state, 2)):
        assert result[:2] == ("raised", "TypeError")
        assert "state['model.embed.weight'] is a DTensor" in result[2]
        assert "gather_full_state" in result[2] and "export_hf_checkpoint" in result[2]
