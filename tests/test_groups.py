"""DistributedProcessGroup and ParallelState on the world and on subgroups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import assert_all_ok, run_ranks

import distributed_ext as dx


def test_unused_group_is_minus_one():
    g = dx.DistributedProcessGroup(-1)
    assert (g.is_initialized(), g.rank(), g.world_size()) == (False, -1, -1)


def test_default_group_in_a_single_process_is_not_initialized_like_modelopt():
    # ModelOpt's calibration guards torch.distributed calls with is_initialized(): in one
    # process without a process group it must be False (rank and size -1).
    g = dx.DistributedProcessGroup()
    assert (g.is_initialized(), g.rank(), g.world_size()) == (False, -1, -1)
    assert "initialized: False" in repr(g)
    assert dx.DistributedProcessGroup.get_dist_syncd_obj(5, [g], sum) == 5
    ps = dx.ParallelState()
    assert not ps.data_parallel_group.is_initialized()


def _amax_sync_guarded_as_modelopt_does():
    """Calibration code written for ModelOpt: a data-parallel amax sync behind the guard."""
    amax = torch.tensor([1.0, 4.0]) * (dist.get_rank() + 1) if dist.is_initialized() else \
        torch.tensor([1.0, 4.0])
    group = dx.ParallelState().data_parallel_group
    if group.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group.group)
    return amax.tolist(), repr(group)


def test_amax_sync_guard_in_one_process_and_on_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _amax_sync_guarded_as_modelopt_does()[0] == [1.0, 4.0]  # no process group: skipped
    values = assert_all_ok(run_ranks(_amax_sync_guarded_as_modelopt_does, 2))
    for amax, text in values:
        assert amax == [2.0, 8.0] and "initialized: True" in text


@pytest.mark.parametrize("bad, exc", [(3, ValueError), (0, ValueError), ("world", TypeError)])
def test_bad_group_arguments(bad, exc):
    with pytest.raises(exc, match="(?i)group"):
        dx.DistributedProcessGroup(bad)
    with pytest.raises(exc):
        dx.ParallelState(tensor_parallel_group=bad)


def test_parallel_state_defaults():
    ps = dx.ParallelState()
    assert ps.data_parallel_group.group is None  # the world, once there is a process group
    assert not ps.tensor_parallel_group.is_initialized()
    assert not ps.expert_model_parallel_group.is_initialized()
    assert "tensor_parallel_group" in repr(ps)


def _groups_world_3():
    me = dist.get_rank()
    sub = dist.new_group([0, 2])
    world = dx.DistributedProcessGroup(None)
    subgroup = dx.DistributedProcessGroup(sub)
    ps = dx.ParallelState(data_parallel_group=sub, tensor_parallel_group=None)
    out = {
        "world": (world.rank(), world.world_size()),
        "sub": (subgroup.rank(), subgroup.world_size()),
        "ps": (ps.data_parallel_group.rank(), ps.tensor_parallel_group.world_size(),
               ps.expert_model_parallel_group.rank()),
        "max_world": dx.DistributedProcessGroup.get_dist_syncd_obj(me * 10, world, max),
    }
    if me in (0, 2):
        # Across the subgroup, then the unused group (-1 passes through).
        out["sum_sub"] = dx.DistributedProcessGroup.get_dist_syncd_obj(
            me + 1, [subgroup, dx.DistributedProcessGroup(-1)], sum
        )
    return out


def test_groups_and_subgroups_world_3():
    values = assert_all_ok(run_ranks(_groups_world_3, 3))
    for r, v in enumerate(values):
        assert v["world"] == (r, 3) and v["max_world"] == 20
    assert values[0]["sub"] == (0, 2) and values[2]["sub"] == (1, 2)
    assert values[0]["ps"] == (0, 3, -1) and values[2]["ps"] == (1, 3, -1)
    assert values[0]["sum_sub"] == values[2]["sum_sub"] == 1 + 3
    assert "sum_sub" not in values[1]
    assert values[1]["sub"] == (-1, -1)  # a non-member of the subgroup
