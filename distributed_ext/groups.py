"""Process-group wrappers: DistributedProcessGroup and ParallelState."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from distributed_ext import runtime
from distributed_ext.collectives import allgather

__all__ = ["DistributedProcessGroup", "ParallelState"]

_UNUSED = -1


def _check_group(group: object, name: str) -> None:
    # dist.new_group() hands non-members GroupMember.NON_GROUP_MEMBER (-100); torch answers
    # rank/size -1 for it, so it passes through.
    if group is None or group == _UNUSED or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if isinstance(group, int) and not isinstance(group, bool):
        raise ValueError(
            f"{name}: an int group must be -1 (not used), got {group}; pass a ProcessGroup, "
            "None for the whole world, or -1"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name}: expected a torch.distributed.ProcessGroup, None or -1, got "
            f"{type(group).__name__}"
        )


class DistributedProcessGroup:
    """A convenient wrapper around torch.distributed.ProcessGroup objects.

    ``group=None`` is the default (world) group; ``-1`` means the group is not used. As in
    ModelOpt's utilities, a group is initialized only while torch.distributed is (so code that
    guards its collectives with :meth:`is_initialized` runs in a single process too); when it
    is not, :meth:`rank` and :meth:`world_size` answer -1 and :meth:`get_dist_syncd_obj`
    passes the object through.
    """

    def __init__(self, group: dist.ProcessGroup | int | None = None) -> None:
        """Initialize the distributed process group."""
        _check_group(group, "DistributedProcessGroup")
        self.group = group

    def is_initialized(self) -> bool:
        """Check if the distributed process group is initialized.

        True when torch.distributed is initialized and the group is used (not -1); False in
        a single process without a process group, whatever the group.
        """
        return runtime.is_initialized() and self.group != _UNUSED

    def rank(self) -> int:
        """Get the rank of the current process group (-1 when not used)."""
        if not self.is_initialized():
            return _UNUSED
        return runtime.rank(group=self.group)  # type: ignore[arg-type]

    def world_size(self) -> int:
        """Get the world size of the current process group (-1 when not used)."""
        if not self.is_initialized():
            return _UNUSED
        return runtime.size(group=self.group)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"group: {self.group}, initialized: {self.is_initialized()}, "
                f"world size: {self.world_size()}, rank: {self.rank()}")

    @staticmethod
    def get_dist_syncd_obj(
        obj: Any,
        groups: DistributedProcessGroup | list[DistributedProcessGroup],
        op: Callable[[list[Any]], Any],
    ) -> Any:
        """Get the distributed synchronized object across the specified distributed groups.

        For each group in turn, gathers every member's ``obj`` (in group rank order) and
        replaces ``obj`` with ``op`` of that list; unused groups (-1) pass ``obj`` through.
        Values travel pickled between ranks of one job (see :func:`allgather`).
        """
        if not isinstance(groups, list):
            groups = [groups]
        for group in groups:
            if not group.is_initialized():
                continue
            obj = op(allgather(obj, group=group.group))  # type: ignore[arg-type]
        return obj


class ParallelState:
    """A class to manage various parallel groups such as data parallel, tensor parallel etc.

    A group that is not used is -1; a group that is None is the default (whole world) group.
    """

    def __init__(
        self,
        data_parallel_group: dist.ProcessGroup | int | None = None,
        tensor_parallel_group: dist.ProcessGroup | int | None = -1,
        expert_model_parallel_group: dist.ProcessGroup | int | None = -1,
    ) -> None:
        """Initialize the parallel state."""
        self.data_parallel_group = DistributedProcessGroup(data_parallel_group)
        self.tensor_parallel_group = DistributedProcessGroup(tensor_parallel_group)
        self.expert_model_parallel_group = DistributedProcessGroup(expert_model_parallel_group)

    def __repr__(self) -> str:
        return (
            f"data_parallel_group: {self.data_parallel_group}, "
            f"tensor_parallel_group: {self.tensor_parallel_group}, "
            f"expert_model_parallel_group: {self.expert_model_parallel_group}"
        )
