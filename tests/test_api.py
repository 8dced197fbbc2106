"""The public API matches the spec (../shared/spec/distributed_api.txt): names, parameters, defaults."""

from __future__ import annotations

import inspect

import pytest

import distributed_ext as dx

_EMPTY = inspect.Parameter.empty

# name -> the spec's parameters in order, with defaults (_EMPTY: required). Extra parameters
# we add must come after these and be keyword-only or defaulted.
SPEC_FUNCTIONS = {
    "all_reduce": [("label", _EMPTY), ("fn", _EMPTY), ("combine", _EMPTY)],
    "allgather": [("obj", _EMPTY), ("group", None)],  # issue 3: the source library's helpers
    "allreduce": [("obj", _EMPTY), ("reduction", "sum"), ("group", None)],
    "backend": [],
    "broadcast": [("obj", _EMPTY), ("src", 0), ("group", None)],
    "barrier": [("group", None)],
    "broadcast_from": [("label", _EMPTY), ("fn", _EMPTY), ("rank", 0)],
    "distributed_run": [("timeout", None), ("device", "cuda")],
    "distribution_plan": [("model", _EMPTY)],
    "fsdp2_wrap": [("model", _EMPTY), ("shard_root", True), ("mp_policy", None),
                   ("cpu_offload", False)],
    "gather_bytes": [("data", _EMPTY), ("dst", _EMPTY), ("group", None),
                     ("chunk_bytes", 268435456)],
    "gather_state_dicts": [("state", _EMPTY), ("dst", _EMPTY), ("group", None)],
    "is_available": [],
    "is_distributed_launch": [],
    "is_distributed_run": [],
    "is_fsdp2_model": [("model", _EMPTY)],
    "is_initialized": [],
    "is_master": [("group", None)],
    "rank": [("group", None)],
    "set_distribution_plan": [("model", _EMPTY), ("plan", _EMPTY)],
    "size": [("group", None)],
}

SPEC_INITS = {
    "DistributedProcessGroup": [("group", None)],
    "DistributedState": [("rank", _EMPTY), ("world_size", _EMPTY), ("device", _EMPTY)],
    "DistributionPlan": [("world_size", 1), ("ep_size", 1), ("dense", "replicate")],
    "ParallelState": [("data_parallel_group", None), ("tensor_parallel_group", -1),
                      ("expert_model_parallel_group", -1)],
}


def _check(sig: inspect.Signature, expected: list, skip_self: bool = False) -> None:
    params = list(sig.parameters.values())[1 if skip_self else 0:]
    got = [(p.name, p.default) for p in params[: len(expected)]]
    assert got == expected
    for extra in params[len(expected):]:
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY or extra.default is not _EMPTY


@pytest.mark.parametrize("name", sorted(SPEC_FUNCTIONS))
def test_spec_functions(name):
    fn = getattr(dx, name)
    assert callable(fn) and name in dx.__all__
    _check(inspect.signature(fn), SPEC_FUNCTIONS[name])


@pytest.mark.parametrize("name", sorted(SPEC_INITS))
def test_spec_classes(name):
    cls = getattr(dx, name)
    assert isinstance(cls, type) and name in dx.__all__
    _check(inspect.signature(cls.__init__), SPEC_INITS[name], skip_self=True)


def test_spec_members():
    g = dx.DistributedProcessGroup
    for member in ("is_initialized", "rank", "world_size"):
        assert callable(getattr(g, member))
    assert isinstance(inspect.getattr_static(g, "get_dist_syncd_obj"), staticmethod)
    _check(inspect.signature(g.get_dist_syncd_obj), [("obj", _EMPTY), ("groups", _EMPTY),
                                                    ("op", _EMPTY)])
    assert isinstance(dx.DistributedState.is_main, property)
    for prop in ("edp", "is_expert_parallel", "is_fsdp_dense"):
        assert isinstance(getattr(dx.DistributionPlan, prop), property)
