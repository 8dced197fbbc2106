"""DistributionPlan, set_distribution_plan and distribution_plan."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.nn as nn
from harness import assert_all_ok, run_ranks

import distributed_ext as dx


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2), nn.ReLU()))
    m.language_model = nn.Linear(2, 2)
    return m


def _recorded_anywhere(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "_distributed_ext_plan" in m.__dict__]


def test_plan_defaults_and_properties():
    p = dx.DistributionPlan()
    assert (p.world_size, p.ep_size, p.dense, p.edp) == (1, 1, "replicate", 1)
    assert not p.is_expert_parallel and not p.is_fsdp_dense
    q = dx.DistributionPlan(world_size=8, ep_size=4, dense="fsdp")
    assert q.edp == 2 and q.is_expert_parallel and q.is_fsdp_dense
    assert hash(q) == hash(dx.DistributionPlan(8, 4, "fsdp")) and q == dx.DistributionPlan(8, 4, "fsdp")
    with pytest.raises(AttributeError):
        q.world_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, text",
    [({"world_size": 0}, "world_size"), ({"ep_size": 0}, "ep_size"), ({"world_size": -2}, "world_size"),
     ({"world_size": 6, "ep_size": 4}, "does not divide"), ({"dense": "tp"}, "dense"),
     ({"world_size": 2.0}, "world_size")],
)
def test_invalid_plans(kwargs, text):
    with pytest.raises(ValueError, match=text):
        dx.DistributionPlan(**kwargs)


def test_record_on_model_and_every_submodule():
    model = _model()
    plan = dx.DistributionPlan()
    dx.set_distribution_plan(model, plan)
    assert dx.distribution_plan(model) is plan
    assert dx.distribution_plan(model.language_model) is plan  # e.g. a VLM's language model
    assert dx.distribution_plan(model[1][0]) is plan
    assert len(_recorded_anywhere(model)) == len(list(model.named_modules()))


def test_second_recording_raises_and_leaves_model_as_it_was():
    model = _model()
    dx.set_distribution_plan(model[1], dx.DistributionPlan())  # a submodule records one
    before = _recorded_anywhere(model)
    with pytest.raises(RuntimeError, match="submodule '1'"):
        dx.set_distribution_plan(model, dx.DistributionPlan())  # the same plan included
    assert _recorded_anywhere(model) == before  # nothing recorded anywhere new
    with pytest.raises(RuntimeError, match="already records"):
        dx.set_distribution_plan(model[1], dx.DistributionPlan())


def test_world_size_must_match_the_run():
    model = _model()
    with pytest.raises(ValueError, match="world_size=2"):
        dx.set_distribution_plan(model, dx.DistributionPlan(world_size=2))
    assert _recorded_anywhere(model) == []
    with pytest.raises(TypeError):
        dx.set_distribution_plan(model, "replicate")  # type: ignore[arg-type]


def test_no_plan_single_process_is_default():
    model = _model()
    assert dx.distribution_plan(model) == dx.DistributionPlan()


def test_module_added_later_records_none():
    model = _model()
    dx.set_distribution_plan(model, dx.DistributionPlan())
    model.extra = nn.Linear(2, 2)
    assert "_distributed_ext_plan" not in model.extra.__dict__


def _in_a_run_of_two():
    model = _model()
    out = {}
    try:
        dx.distribution_plan(model)
    except RuntimeError as exc:
        out["unrecorded"] = str(exc)
    plan = dx.DistributionPlan(world_size=dist.get_world_size(), dense="fsdp")
    dx.set_distribution_plan(model, plan)
    out["recorded"] = dx.distribution_plan(model.language_model) == plan
    model.late = nn.Linear(1, 1)
    try:
        dx.distribution_plan(model.late)
    except RuntimeError as exc:
        out["late"] = str(exc)
    return out


def test_in_a_run_of_several_ranks():
    for v in assert_all_ok(run_ranks(_in_a_run_of_two, 2)):
        assert "run of 2 ranks" in v["unrecorded"] and v["recorded"] is True
        assert "records no plan" in v["late"]


def _replicate_plan_on_an_fsdp2_model():
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    try:
        dx.set_distribution_plan(model, dx.DistributionPlan(world_size=dist.get_world_size()))
        return ("recorded",)
    except ValueError as exc:
        refused = str(exc)
    assert _recorded_anywhere(model) == []  # left as it was
    dx.set_distribution_plan(model, dx.DistributionPlan(world_size=dist.get_world_size(),
                                                        dense="fsdp"))
    return ("refused", refused)


def test_a_replicate_plan_on_an_fsdp2_sharded_model_is_refused():
    for v in assert_all_ok(run_ranks(_replicate_plan_on_an_fsdp2_model, 2)):
        assert v[0] == "refused" and "dense='fsdp'" in v[1] and "FSDP2-sharded" in v[1], v
