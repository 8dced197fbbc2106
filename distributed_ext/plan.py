"""DistributionPlan: how a model is placed over the ranks of a run, recorded on the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

from distributed_ext import runtime
from distributed_ext.fsdp import is_fsdp2_model

__all__ = ["DistributionPlan", "distribution_plan", "recorded_plan", "set_distribution_plan"]

_PLAN_ATTR = "_distributed_ext_plan"
_DENSE = ("replicate", "fsdp")


@dataclass(frozen=True)
class DistributionPlan:
    """How a model is distributed over the ranks of a run.

    Attributes:
        world_size: the ranks that hold the model; 1 for a single process.
        ep_size: the expert-parallel degree: an MoE's routed experts are sharded over groups of
            ``ep_size`` ranks. 1 shards none.
        dense: how the rest of the model (everything without expert parallelism) is placed:
            ``"replicate"`` gives every rank a whole copy, ``"fsdp"`` FSDP2-shards it.

    Every rank calibrates on its own data, so data parallelism spans the whole world, and each
    expert shard is replicated ``edp = world_size / ep_size`` times. Immutable and hashable.

    Raises:
        ValueError: a size below 1, ``ep_size`` not dividing ``world_size``, or ``dense``
            outside {"replicate", "fsdp"}.
    """

    world_size: int = 1
    ep_size: int = 1
    dense: Literal["replicate", "fsdp"] = "replicate"

    def __post_init__(self) -> None:
        for name in ("world_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DistributionPlan: {name} must be an int of at least 1, got "
                                 f"{value!r}")
        if self.world_size % self.ep_size:
            raise ValueError(
                f"DistributionPlan: ep_size={self.ep_size} does not divide world_size="
                f"{self.world_size}; each expert shard must be replicated a whole number of "
                "times (edp = world_size / ep_size)"
            )
        if self.dense not in _DENSE:
            raise ValueError(f"DistributionPlan: dense must be one of {_DENSE}, got "
                             f"{self.dense!r}")

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: how many ranks hold a replica of each expert shard."""
        return self.world_size // self.ep_size

    @property
    def is_expert_parallel(self) -> bool:
        """Whether routed experts are sharded across ranks."""
        return self.ep_size > 1

    @property
    def is_fsdp_dense(self) -> bool:
        """Whether the dense part is FSDP2-sharded rather than replicated."""
        return self.dense == "fsdp"


def recorded_plan(module: nn.Module) -> DistributionPlan | None:
    """The plan recorded on ``module`` (:func:`set_distribution_plan`), or None: unlike
    :func:`distribution_plan`, no plan is never an error here."""
    return module.__dict__.get(_PLAN_ATTR)


def set_distribution_plan(model: nn.Module, plan: DistributionPlan) -> None:
    """Record that ``model`` is distributed as ``plan``, on it and on every submodule it has now.

    Code handed a submodule (such as a VLM's language model) then reads the same plan as code
    handed the whole model; a module added afterwards records none. A model is distributed
    once, and its plan recorded once: recording a plan on a model that, or any of whose
    submodules, already records one raises (the same plan included) and leaves the model as it
    was.

    Raises:
        TypeError: ``model`` is not an nn.Module or ``plan`` not a DistributionPlan.
        ValueError: ``plan.world_size`` differs from the live run's size, or the plan says
            ``dense="replicate"`` of an FSDP2-sharded model.
        RuntimeError: the model or a submodule already records a plan.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_distribution_plan: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    if not isinstance(plan, DistributionPlan):
        raise TypeError(f"set_distribution_plan: plan must be a DistributionPlan, got "
                        f"{type(plan).__name__}")
    live = runtime.size()
    if plan.world_size != live:
        raise ValueError(
            f"set_distribution_plan: plan.world_size={plan.world_size} but this run has {live} "
            f"rank(s); record DistributionPlan(world_size={live}, ...)"
        )
    if plan.dense == "replicate" and plan.world_size > 1 and is_fsdp2_model(model):
        # Code that trusts the plan would take every rank's dense weights for a whole copy.
        raise ValueError(
            f"set_distribution_plan: the model is FSDP2-sharded (fully_shard), but {plan} "
            "says its dense part is replicated; record DistributionPlan(world_size="
            f"{plan.world_size}, ep_size={plan.ep_size}, dense='fsdp')"
        )
    # Check everything before writing anything, so a refused call leaves no trace.
    modules = list(model.named_modules())
    for name, module in modules:
        existing = recorded_plan(module)
        if existing is not None:
            where = "the model" if not name else f"submodule {name!r}"
            raise RuntimeError(
                f"set_distribution_plan: {where} already records {existing}; a model is "
                "distributed once and its plan recorded once (no code re-distributes a model "
                "it loaded)"
            )
    for _name, module in modules:
        module.__dict__[_PLAN_ATTR] = plan


def distribution_plan(model: nn.Module) -> DistributionPlan:
    """How ``model`` is distributed: the plan recorded on it (:func:`set_distribution_plan`).

    A model with no plan recorded is a single process's (``DistributionPlan()``), unless it
    shows otherwise: one that is FSDP2-sharded, or held in a run of several ranks, raises rather
    than be taken for one. That includes a module added to a model after its plan was recorded:
    read the plan off the model it was added to.

    Raises:
        RuntimeError: no plan is recorded and the model is FSDP2-sharded or the run has
            several ranks.
    """
    plan = recorded_plan(model)
    if plan is not None:
        return plan

    name = type(model).__name__
    if is_fsdp2_model(model):
        raise RuntimeError(
            f"distribution_plan: {name} is FSDP2-sharded but records no plan; whoever sharded "
            "it records one with set_distribution_plan(model, DistributionPlan(...)) (or read "
            "the plan off the whole model this module belongs to)"
        )
    if runtime.is_distributed_run():
        raise RuntimeError(
            f"distribution_plan: {name} records no plan in a run of {runtime.size()} ranks, "
            "so it cannot be taken for a single process's model; record one with "
            "set_distribution_plan (or read the plan off the whole model this module was "
            "added to)"
        )
    return DistributionPlan()
